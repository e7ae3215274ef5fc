"""Sequences that share token prefixes laid out as prefix trees, and packed by the tokens actually computed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from areal_hpc.algo.packing import pack_microbatches


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of sequence `seq`, laid down once for every sequence whose path passes through it."""

    seq: int
    start: int  # also the position id of its first token: a segment continues its parent
    end: int
    parent: int  # index of the parent segment in the layout, -1 for a root

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class PrefixLayout:
    """Segments in layout order (a parent before its children) and, per sequence, the segment it ends in.

    A sequence's tokens are those of the segments on the path from a root to its leaf, in order. A segment
    attends to the tokens of its ancestors and causally to its own, never to a sibling's."""

    segments: list[Segment]
    leaf: list[int]

    @property
    def computed(self) -> int:
        """Token positions a forward over this layout computes."""
        return sum(s.length for s in self.segments)

    def offsets(self) -> list[int]:
        """Each segment's first position in the laid-out row."""
        out, k = [], 0
        for s in self.segments:
            out.append(k)
            k += s.length
        return out

    def ancestors(self, seg: int) -> list[int]:
        """The segments above `seg`, root first."""
        path = []
        p = self.segments[seg].parent
        while p >= 0:
            path.append(p)
            p = self.segments[p].parent
        return path[::-1]

    def positions(self, seq: int, offsets: list[int] | None = None) -> np.ndarray:
        """Where each token of sequence `seq` sits in the laid-out row (`offsets`: self.offsets(), if at hand)."""
        offsets = self.offsets() if offsets is None else offsets
        path = [*self.ancestors(self.leaf[seq]), self.leaf[seq]]
        return np.concatenate([np.arange(offsets[s], offsets[s] + self.segments[s].length) for s in path])


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _sorted(seqs: list[np.ndarray], idx: list[int]) -> list[int]:
    """Lexicographic order: sequences sharing k tokens are then neighbours, for every k."""
    return sorted(idx, key=lambda i: seqs[i].tolist())


def prefix_layout(seqs: list[np.ndarray], min_shared: int) -> PrefixLayout:
    """Lay the sequences out so that every prefix of at least `min_shared` tokens that several share is
    computed once. A shorter common run is repeated in each sequence: its own segment would cost an
    attention call per layer for little saving."""
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1, got {min_shared}")
    seqs = [np.asarray(s) for s in seqs]
    segments: list[Segment] = []
    leaf = [-1] * len(seqs)

    def build(order: list[int], start: int, parent: int) -> None:
        # order: lexicographically sorted, all sharing tokens [0, start) laid down by the ancestors
        lcps = [_lcp(seqs[a], seqs[b]) for a, b in zip(order, order[1:])]
        run = [order[0]]
        for i, common in zip(order[1:], lcps):
            if common - start >= min_shared:
                run.append(i)
            else:
                emit(run, start, parent)
                run = [i]
        emit(run, start, parent)

    def emit(run: list[int], start: int, parent: int) -> None:
        if len(run) == 1:
            segments.append(Segment(run[0], start, len(seqs[run[0]]), parent))
            leaf[run[0]] = len(segments) - 1
            return
        end = min(_lcp(seqs[a], seqs[b]) for a, b in zip(run, run[1:]))  # the whole run's common prefix
        segments.append(Segment(run[0], start, end, parent))
        me = len(segments) - 1
        rest = []
        for i in run:
            if len(seqs[i]) == end:
                leaf[i] = me  # all of it is shared (a duplicate, or a prefix of the others)
            else:
                rest.append(i)
        if rest:
            build(rest, end, me)

    if seqs:
        build(_sorted(seqs, list(range(len(seqs)))), 0, -1)
    return PrefixLayout(segments, leaf)


def clusters(seqs: list[np.ndarray], min_shared: int) -> list[list[int]]:
    """Sequences that share a prefix of at least `min_shared` tokens, transitively, in lexicographic order."""
    order = _sorted(seqs, list(range(len(seqs))))
    out: list[list[int]] = []
    for k, i in enumerate(order):
        if k and _lcp(seqs[order[k - 1]], seqs[i]) >= min_shared:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _split(seqs: list[np.ndarray], cluster: list[int], budget: int, min_shared: int) -> list[list[int]]:
    """A cluster whose tree exceeds the budget, cut into parts (each keeping its own copy of the prefix)
    in lexicographic order, so the sequences sharing most stay together."""
    parts: list[list[int]] = [[]]
    cost = 0
    for k, i in enumerate(cluster):
        # in lexicographic order a sequence shares most with its predecessor: the tree grows by the rest
        shared = _lcp(seqs[cluster[k - 1]], seqs[i]) if parts[-1] else 0
        grow = len(seqs[i]) - (shared if shared >= min_shared else 0)
        if parts[-1] and cost + grow > budget:
            parts.append([])
            cost, grow = 0, len(seqs[i])
        parts[-1].append(i)
        cost += grow
    out = []
    for part in parts:  # the estimate can fall short where a shared run is split by the threshold: check
        if len(part) > 1 and prefix_layout([seqs[i] for i in part], min_shared).computed > budget:
            half = len(part) // 2
            out += _split(seqs, part[:half], budget, min_shared) + _split(seqs, part[half:], budget, min_shared)
        else:
            out.append(part)
    return out


def pack_shared(seqs: list[np.ndarray], budget: int, min_shared: int) -> list[list[int]]:
    """Micro-batches (sorted sequence indices) whose prefix trees stay within `budget` computed tokens.

    Sequences sharing a prefix stay together where their tree fits; a cluster that does not fit is cut into
    parts that do. Parts are then packed as pack_microbatches packs sequences (a part too long for the
    budget, a single long sequence, gets a micro-batch of its own)."""
    seqs = [np.asarray(s) for s in seqs]
    units: list[list[int]] = []
    for c in clusters(seqs, min_shared):
        units += _split(seqs, c, budget, min_shared) if len(c) > 1 else [c]
    costs = [prefix_layout([seqs[i] for i in u], min_shared).computed for u in units]
    return [sorted(i for u in bin_ for i in units[u]) for bin_ in pack_microbatches(costs, budget)]
