"""Packing sequences into token-budgeted micro-batches and balancing a batch across trainers."""

from __future__ import annotations

import heapq


def _ffd_bin_count(lengths: list[int], budget: int) -> int:
    """Number of bins first-fit-decreasing uses (an over-budget item gets its own bin)."""
    loads: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, load in enumerate(loads):
            if load + n <= budget:
                loads[i] += n
                break
        else:
            loads.append(n)
    return len(loads)


def pack_microbatches(lengths: list[int], max_tokens_per_mb: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose token sums stay within the budget.

    Uses as many micro-batches as first-fit-decreasing would, then balances the token loads across
    them: longest-first, each sequence goes to the least-loaded micro-batch that still has room
    (falling back to FFD's own assignment, which always fits, if the greedy one fails). A sequence
    longer than the budget gets a micro-batch of its own. Indices within a micro-batch are sorted.
    """
    if max_tokens_per_mb <= 0:
        raise ValueError(f"max_tokens_per_mb must be > 0, got {max_tokens_per_mb}")
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    oversize = [i for i in order if lengths[i] > max_tokens_per_mb]
    fitting = [i for i in order if lengths[i] <= max_tokens_per_mb]
    n_bins = _ffd_bin_count([lengths[i] for i in fitting], max_tokens_per_mb)

    bins = _balanced_assign(fitting, lengths, n_bins, max_tokens_per_mb)
    if bins is None:
        bins = _ffd_assign(fitting, lengths, max_tokens_per_mb)
    out = [sorted(b) for b in bins if b] + [[i] for i in oversize]
    return out


def _balanced_assign(order, lengths, n_bins, budget):
    if n_bins == 0:
        return []
    heap = [(0, b) for b in range(n_bins)]  # (load, bin)
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in order:
        # least-loaded bin with room; the heap top is the least loaded overall
        if loads[heap[0][1]] + lengths[i] > budget:
            return None  # least-loaded has no room, so no bin has: give up on balancing
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        loads[b] = load + lengths[i]
        heapq.heappush(heap, (loads[b], b))
    return bins


def _ffd_assign(order, lengths, budget):
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balance_across_ranks(lengths: list[int], n_ranks: int, group_ids: list[int] | None = None) -> list[list[int]]:
    """Split sequence indices over n_ranks so token counts are as even as possible (greedy LPT).

    With group_ids, the n samples of a prompt stay on one rank (whole groups are the unit).
    """
    if n_ranks <= 0:
        raise ValueError(f"n_ranks must be > 0, got {n_ranks}")
    if group_ids is None:
        units = [[i] for i in range(len(lengths))]
    else:
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(group_ids):
            by_group.setdefault(g, []).append(i)
        units = list(by_group.values())
    units.sort(key=lambda u: -sum(lengths[i] for i in u))
    heap = [(0, r) for r in range(n_ranks)]
    shares: list[list[int]] = [[] for _ in range(n_ranks)]
    for u in units:
        load, r = heapq.heappop(heap)
        shares[r].extend(u)
        heapq.heappush(heap, (load + sum(lengths[i] for i in u), r))
    return [sorted(s) for s in shares]
