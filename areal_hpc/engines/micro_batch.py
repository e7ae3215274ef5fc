"""A micro-batch's model inputs in three layouts (packed, right-padded, prefix tree) and where its tokens sit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from areal_hpc.algo.prefix_tree import PrefixLayout
from areal_hpc.engines.prefix_attention import TreeAttention


@dataclass
class Rows:
    """The positions the head is applied to: `src` (flat model positions) and the token each predicts.

    `index` says which token of the sequences laid end to end each loss row is. With a prefix tree a head row
    can stand for several loss rows (a shared prefix's token, for each sequence through it): `inverse` maps
    each loss row to its head row, non-decreasing, and `index` is in that order. None: one head row each."""

    src: torch.Tensor
    targets: torch.Tensor
    index: torch.Tensor
    inverse: torch.Tensor | None = None


@dataclass
class MicroBatch:
    """Model inputs for a list of sequences, and where each sequence's tokens sit in them."""

    input_ids: torch.Tensor  # [1, N] packed or prefix tree, [B, L] padded
    position_ids: torch.Tensor | None  # packed and prefix tree only
    attention_mask: torch.Tensor | None  # padded only
    lengths: list[int]
    positions: int  # token positions the forward computes (padding included)
    token_pos: list[np.ndarray] | None = None  # prefix tree: where each sequence's tokens sit in the row
    tree: TreeAttention | None = None  # prefix tree: what each segment attends to

    @property
    def padding(self) -> int:
        return self.positions - sum(self.lengths) if self.tree is None else 0

    @property
    def unshared_positions(self) -> int:
        """The positions this forward stands for: what it would compute with no prefix laid down once."""
        return self.positions if self.tree is None else sum(self.lengths)

    def model_kwargs(self) -> dict:
        """What the model's forward takes besides the ids (the tree reaches the attention through its kwargs)."""
        kw = {"attention_mask": self.attention_mask, "position_ids": self.position_ids}
        return kw if self.tree is None else kw | {"prefix_tree": self.tree}

    def predicting_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat model positions that predict a next token of their own sequence, that token's position, and
        its index in the sequences laid end to end (what per-token loss inputs are indexed by)."""
        width = self.input_ids.shape[1]
        src, tgt, index, offset = [], [], [], 0
        for i, n in enumerate(self.lengths):
            if self.token_pos is not None:
                at = torch.as_tensor(self.token_pos[i], dtype=torch.long)
                src.append(at[:-1])
                tgt.append(at[1:])
            else:
                start = offset if self.position_ids is not None else i * width
                src.append(torch.arange(start, start + n - 1))
                tgt.append(src[-1] + 1)
            index.append(torch.arange(offset + 1, offset + n))
            offset += n
        device = self.input_ids.device
        return torch.cat(src).to(device), torch.cat(tgt).to(device), torch.cat(index).to(device)

    def head_rows(self) -> Rows:
        """The rows the head computes: a prefix tree's repeated (position, next token) pairs once."""
        src, tgt, index = self.predicting_rows()
        ids = self.input_ids.reshape(-1)
        if self.tree is None:
            return Rows(src, ids[tgt], index)
        base = 1 << 32  # above any token id: no device-to-host read of the largest
        unique, inverse = torch.unique(src * base + ids[tgt], return_inverse=True)
        order = torch.argsort(inverse, stable=True)
        return Rows(unique // base, unique % base, index[order], inverse[order])

    def per_sequence(self, values: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
        """Loss-row values (at `index`) -> one tensor per sequence, position 0 (no prefix) set to 0."""
        flat = values.new_zeros(sum(self.lengths)).index_put((index,), values)
        return list(flat.split(self.lengths))


def packed(seqs: list[np.ndarray], device: torch.device) -> MicroBatch:
    lengths = [len(s) for s in seqs]
    ids = torch.cat([torch.as_tensor(np.asarray(s), dtype=torch.long) for s in seqs])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return MicroBatch(ids.to(device), pos.to(device), None, lengths, sum(lengths))


def padded(seqs: list[np.ndarray], pad_token_id: int, device: torch.device) -> MicroBatch:
    """Right padding: positions stay 0..L-1, so no position ids are needed."""
    lengths = [len(s) for s in seqs]
    width = max(lengths)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(np.asarray(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return MicroBatch(ids.to(device), None, mask.to(device), lengths, len(seqs) * width)


def shared(seqs: list[np.ndarray], layout: PrefixLayout, device: torch.device) -> MicroBatch:
    """One row holding each segment of the layout once; position ids go on from the parent's, as they would
    in each sequence on its own. With no shared segment this is `packed`."""
    if len(layout.segments) == len(seqs) and all(s.parent < 0 for s in layout.segments):
        return packed(seqs, device)
    segs = layout.segments
    ids = torch.cat([torch.as_tensor(np.asarray(seqs[s.seq][s.start : s.end]), dtype=torch.long) for s in segs])
    pos = torch.cat([torch.arange(s.start, s.end) for s in segs])
    offsets = layout.offsets()
    token_pos = [layout.positions(i, offsets) for i in range(len(seqs))]
    lengths = [len(s) for s in seqs]
    return MicroBatch(
        ids[None].to(device), pos[None].to(device), None, lengths, layout.computed, token_pos, TreeAttention.of(layout)
    )
