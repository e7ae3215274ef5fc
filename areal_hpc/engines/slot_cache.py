"""The torch generation engine's KV cache: preallocated buffers that rows join and leave without copying the batch."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class _WindowLayer(DynamicLayer):
    """One layer as the model sees it: each new column is written in place, the live window is returned."""

    def __init__(self, owner: SlotCache, idx: int):
        super().__init__()
        self.owner, self.idx, self.is_initialized = owner, idx, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner._write(self.idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.start


class SlotCache:
    """Keys and values of the running rows in buffers [slots, heads, columns, dim], one pair per layer.

    Every row's next token goes in the same column (`end`), so rows stay left-padded as in one batched
    cache, but nothing is copied as the batch changes: a decode step writes one column in place, a joiner
    is written into a free slot, and a finished row's slot is filled by the last row (one row's copy).
    The attended window [start, end) starts at the first column some row still uses, so when the
    longest-lived row finishes the batch stops paying for its length. The buffers grow by doubling
    (a copy of the live window only), so a step costs attention over rows x window and nothing more.
    """

    def __init__(self, n_layers: int):
        self.n_layers, self.rows, self.start, self.end = n_layers, 0, 0, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.first: torch.Tensor | None = None  # [slots] each row's first real column
        self.margin = 0  # the widest joiner so far: room kept left of the window when it moves
        self.model_cache = DynamicCache()
        self.model_cache.layers = [_WindowLayer(self, i) for i in range(n_layers)]

    @property
    def width(self) -> int:
        return self.end - self.start

    def attention_mask(self, extra: int = 0) -> torch.Tensor:
        """[rows, width + extra] 1 where a row attends (its real tokens, and `extra` new columns)."""
        cols = torch.arange(self.start, self.end + extra, device=self.first.device)
        return (cols[None, :] >= self.first[: self.rows, None]).long()

    # -- the model's writes ----------------------------------------------------------------------
    def reserve_column(self) -> None:
        """Make room for one more column; call before a decode forward, then `advance` after it."""
        if self.end == self.keys[0].shape[2]:
            self._relayout(self.rows, self.margin)

    def advance(self) -> None:
        self.end += 1

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, col = self.rows, self.end
        self.keys[layer][:n, :, col] = k[:, :, -1]
        self.values[layer][:n, :, col] = v[:, :, -1]
        return self.keys[layer][:n, :, self.start : col + 1], self.values[layer][:n, :, self.start : col + 1]

    # -- rows joining and leaving ----------------------------------------------------------------
    def join(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor) -> None:
        """Append rows prefilled together (per layer [rows, heads, w, dim], left-padded as `mask` [rows, w])
        as the last rows."""
        joiners, w = mask.shape
        self.margin = max(self.margin, w)
        if not self.keys:  # the first joiners fix heads, head size and dtype
            _, heads, _, dim = keys[0].shape
            like = keys[0]
            self.keys = [like.new_zeros((0, heads, 0, dim)) for _ in range(self.n_layers)]
            self.values = [like.new_zeros((0, heads, 0, dim)) for _ in range(self.n_layers)]
            self.first = torch.zeros(0, dtype=torch.long, device=like.device)
        if self.rows == 0:
            self.start = self.end = w  # an empty batch: the window restarts right of the joiners' prompts
        if self.rows + joiners > self.keys[0].shape[0] or self.end - w < 0 or self.end > self.keys[0].shape[2]:
            self._relayout(self.rows + joiners, self.margin)
        n, lo = self.rows, self.end - w
        for mine_k, mine_v, k, v in zip(self.keys, self.values, keys, values, strict=True):
            mine_k[n : n + joiners, :, lo : self.end] = k
            mine_v[n : n + joiners, :, lo : self.end] = v
        self.first[n : n + joiners] = lo + (w - mask.sum(1))
        self.rows += joiners
        self.start = int(self.first[: self.rows].min())

    def drop(self, gone: set[int]) -> list[int]:
        """Remove rows; the last rows fill the freed slots. Returns, per remaining row, its old index."""
        keep = [i for i in range(self.rows) if i not in gone]
        n = len(keep)
        holes = [i for i in range(n) if i in gone]
        tails = [i for i in keep if i >= n]  # as many as there are holes, each moves into one
        order = list(range(n))
        for h, t in zip(holes, tails, strict=True):
            order[h] = t
        if holes:
            dst = torch.tensor(holes, dtype=torch.long, device=self.first.device)
            src = torch.tensor(tails, dtype=torch.long, device=self.first.device)
            window = slice(self.start, self.end)
            for buf in self.keys + self.values:
                buf[dst, :, window] = buf[src, :, window]
            self.first[dst] = self.first[src]
        self.rows = n
        if n:
            self.start = int(self.first[:n].min())  # columns no row uses any more are not attended
        return order

    def _relayout(self, rows: int, left: int) -> None:
        """Move the live window into new buffers: room for `rows` rows, `left` free columns before the
        window and as many again as it holds after it (doubling, so moves are rare)."""
        old_k, old_v = self.keys, self.values
        slots = old_k[0].shape[0]
        if rows > slots:
            slots = max(rows, 2 * slots, 8)
        width = self.width
        cols = max(2 * (left + width), left + width + 64)
        _, heads, _, dim = old_k[0].shape
        n, shift = self.rows, left - self.start
        self.keys = [k.new_zeros((slots, heads, cols, dim)) for k in old_k]
        self.values = [v.new_zeros((slots, heads, cols, dim)) for v in old_v]
        for new, old in zip(self.keys + self.values, old_k + old_v, strict=True):
            new[:n, :, left : left + width] = old[:n, :, self.start : self.end]
        first = self.first.new_zeros(slots)
        first[:n] = self.first[:n] + shift
        self.first, self.start, self.end = first, left, left + width
