"""Which joiners of one prefill share a prompt, and the left-packing of KV rows computed in two parts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharePlan:
    """How one prefill is split: each group's shared prefix computed once (part A), then each joiner's
    own tokens after it (part B) over that prefix's keys and values."""

    groups: list[list[int]]  # joiner indices per group (two or more with the same prompt)
    shared: list[int]  # tokens each group shares: the longest common prefix of its members' prompt + partial
    group_of: dict[int, int]  # joiner -> its group
    own: list[int]  # joiners with tokens of their own after the shared part (every joiner in no group)

    def start(self, j: int) -> int:
        """Where joiner j's own tokens begin."""
        g = self.group_of.get(j)
        return 0 if g is None else self.shared[g]

    def computed(self, prefixes: list[list[int]]) -> int:
        """Token positions the two parts compute (padding left out)."""
        return sum(self.shared) + sum(len(prefixes[j]) - self.start(j) for j in self.own)

    def served(self) -> int:
        """Prompt tokens each group's other members take from the shared part instead of computing them."""
        return sum((len(m) - 1) * s for m, s in zip(self.groups, self.shared, strict=True))


def common_prefix(seqs: list[list[int]], known: int = 0) -> int:
    """Length of the longest prefix all of seqs share, given that they share the first `known` tokens."""
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(known, n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return i
    return n


def plan(prompts: list[list[int]], prefixes: list[list[int]]) -> SharePlan | None:
    """Joiners with identical prompts form a group; None when no two do. A group shares the longest common
    prefix of its members' prompt + partial (a resumed request's partial is its own beyond that)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for j, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(j)
    groups = [m for m in by_prompt.values() if len(m) > 1 and prompts[m[0]]]
    if not groups:
        return None
    shared = [common_prefix([prefixes[j] for j in m], len(prompts[m[0]])) for m in groups]
    group_of = {j: g for g, m in enumerate(groups) for j in m}
    own = [j for j in range(len(prefixes)) if j not in group_of or len(prefixes[j]) > shared[group_of[j]]]
    return SharePlan(groups, shared, group_of, own)


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] ids and mask, each row's tokens at the right end."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting a row's real tokens only (padding anywhere in the row is skipped)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def pack_right(src: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, width, dim]: each row's columns where `mask` is 1 ([rows, cols], padding possibly in the
    middle), in order, at the right end; zeros before them (the slot cache never attends them)."""
    lens = mask.sum(1, keepdim=True)
    order = torch.sort(1 - mask, dim=1, stable=True).indices  # a row's real columns first, in order
    k = torch.arange(width, device=mask.device)[None, :] - (width - lens)  # target column -> k-th real column
    idx = order.gather(1, k.clamp(min=0))
    rows = torch.arange(src.shape[0], device=src.device)[:, None]
    out = src[rows, :, idx].transpose(1, 2)  # advanced indices first: [rows, width, heads, dim] -> moved back
    return torch.where((k >= 0)[:, None, :, None], out, out.new_zeros(()))
