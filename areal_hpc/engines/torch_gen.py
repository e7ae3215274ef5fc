"""Generation engine in plain torch/transformers: continuous batching over one left-padded KV cache."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch

from areal_hpc.engines.base import GenerationEngine, InFlight
from areal_hpc.engines.prefill_share import SharePlan, left_pad, pack_right, plan, positions
from areal_hpc.engines.slot_cache import SlotCache
from areal_hpc.model import load_causal_lm
from areal_hpc.model import stop_token_ids as model_stop_ids
from areal_hpc.types import GenOutput, GenRequest


def fake_quantize(state_dict: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """Every weight matrix rounded to `bits` bits per output row (symmetric, absmax scale), kept in its dtype:
    the numbers a weight-quantized rollout would compute with; vectors (norms, biases) stay exact."""
    levels = 2 ** (bits - 1) - 1
    out = {}
    for name, w in state_dict.items():
        if w.dim() != 2 or not w.is_floating_point():
            out[name] = w
            continue
        scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / levels
        out[name] = (torch.round(w.float() / scale) * scale).to(w.dtype)
    return out


class TorchGenerationEngine(GenerationEngine):
    """Continuous batching for machines without vLLM.

    The running batch's keys and values live in a SlotCache, left-padded so every row's next token
    sits in the same column. Each step decodes the running rows, prefills the requests that take free
    slots (so a request added now gets its first token in this step), writes the joiners into the
    cache and drops the rows that finished: a finished row costs no more compute, a join or a finish
    copies no other row, and columns no row uses any more are not attended.
    Joiners with the same prompt (a group's n samples, added together) compute their common prefix once
    and each its own tokens after it (docs/prefix-sharing.md); `share_prefill=False` computes each in full.

    Logprobs are those of the sampled token under softmax(logits / temperature), the distribution the
    trainer recomputes (top-p only restricts which tokens can be drawn).
    """

    def __init__(
        self,
        model_path: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: str = "float32",
        seed: int = 0,
        stop_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        device: str = "cpu",
        max_num_seqs: int = 256,
        weight_bits: int = 0,
        share_prefill: bool = True,
    ):
        if top_p < 1:  # the recorded logprobs are those of the full distribution, which is what is sampled
            raise ValueError(f"top_p={top_p} is not supported: behaviour logprobs are of the full distribution")
        super().__init__(max_num_seqs, temperature, top_p)
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype).to(self.device).eval()
        self.weight_bits = weight_bits  # > 0: every load is rounded (rollout.weight_bits)
        self.share_prefill = share_prefill  # False: each joiner's prompt computed in full (benchmarks compare)
        if weight_bits:
            self.model.load_state_dict(fake_quantize(self.model.state_dict(), weight_bits))
        cfg = self.model.config
        # None: every EOS the model folder declares (generation_config.json, config.json, tokenizer)
        self.stop_ids = set(stop_token_ids if stop_token_ids is not None else model_stop_ids(model_path))
        if pad_token_id is None:
            pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else min(self.stop_ids)
        self.pad_token_id = pad_token_id
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.waiting: deque[InFlight] = deque()
        self.rows: list[InFlight] = []  # the running batch, in cache row order
        self._cache: SlotCache | None = None  # keys and values of self.rows, in the same order
        self._pos: torch.Tensor | None = None  # [rows] position id of the next token fed
        self._next: torch.Tensor | None = None  # [rows] sampled token, fed at the next step

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, keep_kv: bool = False) -> None:
        # keep_kv: the batch's cache stays as it is; waiting requests are prefilled under the new weights
        if (self.rows or self.waiting) and not keep_kv:
            raise RuntimeError("update_weights with requests in flight; interrupt them or let them finish first")
        # a subset is a load too (LoRA's merged layers); a name the model lacks is a mistake
        unknown = sorted(set(state_dict) - set(self.model.state_dict()))
        if unknown:
            raise RuntimeError(f"update_weights: unexpected weight names {unknown[:3]}")
        if self.weight_bits:
            state_dict = fake_quantize(state_dict, self.weight_bits)
        self.model.load_state_dict(state_dict, strict=False)
        self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def close(self) -> None:
        pass  # nothing outside this process's memory

    # -- requests --------------------------------------------------------------------------------
    def add(self, requests: list[GenRequest]) -> None:
        for r in requests:
            seq = self._admit(r)
            if seq is not None:
                self.waiting.append(seq)

    def interrupt(self, ids: list[Hashable] | None = None) -> list[GenOutput]:
        hit = None if ids is None else set(ids)
        out = [s.output("abort") for s in self.waiting if hit is None or s.request.request_id in hit]
        self.waiting = deque(s for s in self.waiting if hit is not None and s.request.request_id not in hit)
        gone = [i for i, s in enumerate(self.rows) if hit is None or s.request.request_id in hit]
        out += [self.rows[i].output("abort") for i in gone]
        self._drop_rows(set(gone))
        return out

    # -- stepping --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[GenOutput]:
        done = self._take_ready()
        if self.paused or not (self.rows or self.waiting):
            return done
        self._reasons: dict[int, str] = {}  # row -> finish reason, for rows that finished in this step
        if self.rows:
            done += self._retire(self._decode())
        joiners = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.capacity - len(self.rows)))]
        if joiners:  # slots freed by this step's finished rows are taken at once
            done += self._retire(self._prefill(joiners))
        return done

    def _retire(self, finished: set[int]) -> list[GenOutput]:
        out = [self.rows[i].output(self._reasons[i]) for i in sorted(finished)]
        self._drop_rows(finished)
        return out

    def _decode(self) -> set[int]:
        """One token for every running row; returns the rows that finished."""
        self._cache.reserve_column()
        out = self.model(
            input_ids=self._next[:, None],
            attention_mask=self._cache.attention_mask(extra=1),
            position_ids=self._pos[:, None],
            past_key_values=self._cache.model_cache,
            use_cache=True,
        )
        self._cache.advance()
        self._pos = self._pos + 1
        return self._record(0, self.rows, out.logits[:, -1, :])

    def _prefill(self, joiners: list[InFlight]) -> set[int]:
        """Prefill the joiners, merge them into the batch, sample their first token. Joiners with the same
        prompt (a group's n samples) compute their common prefix once; the rest are left-padded together."""
        prefixes = [list(s.request.prompt_ids) + s.ids for s in joiners]
        shares = plan([s.request.prompt_ids for s in joiners], prefixes) if self.share_prefill else None
        if shares is None:
            keys, values, logits = self._forward_rows(prefixes)
            self.prefill_tokens += sum(len(p) for p in prefixes)
        else:
            keys, values, logits = self._forward_shared(prefixes, shares)
            self.prefill_tokens += shares.computed(prefixes)
            self.prefill_shared_tokens += shares.served()
        lens = torch.tensor([len(p) for p in prefixes], device=self.device)
        width = keys[0].shape[2]
        mask = (torch.arange(width, device=self.device)[None, :] >= width - lens[:, None]).long()  # left-packed
        first = len(self.rows)
        self._merge(joiners, keys, values, mask, lens)
        return self._record(first, joiners, logits)

    def _forward(self, ids, mask, pos, past=None):
        # the last position's logits only: a long prompt's full [rows, width, vocab] would dwarf its KV
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True, logits_to_keep=1
        )
        if any(getattr(layer, "is_sliding", False) for layer in out.past_key_values.layers):
            raise RuntimeError(
                "the torch generation engine does not support sliding-window attention; use rollout.engine=vllm"
            )
        return out

    def _forward_rows(self, prefixes: list[list[int]]):
        """Every prefix computed in full, left-padded among the others: its keys, values and last logits."""
        ids, mask = left_pad(prefixes, *self._pad)
        out = self._forward(ids, mask, positions(mask))
        cache = out.past_key_values.layers
        return [c.keys for c in cache], [c.values for c in cache], out.logits[:, -1, :]

    def _forward_shared(self, prefixes: list[list[int]], shares: SharePlan):
        """Part A: each group's shared prefix once. Part B: every joiner's own tokens after it, over a copy of
        its group's keys and values (padding between the two is masked). Then each row is left-packed."""
        ids_a, mask_a = left_pad([prefixes[m[0]][:s] for m, s in zip(shares.groups, shares.shared)], *self._pad)
        out_a = self._forward(ids_a, mask_a, positions(mask_a))
        parts = []  # (joiners, their keys and values per layer, their last logits)
        whole = [j for j in range(len(prefixes)) if j not in shares.own]  # all of it shared: part A's row
        if whole:
            g = torch.tensor([shares.group_of[j] for j in whole], device=self.device)
            parts.append((whole, *self._packed(out_a, g, mask_a[g], prefixes), out_a.logits[g, -1]))
        if shares.own:
            own = shares.own
            ids_b, mask_b = left_pad([prefixes[j][shares.start(j) :] for j in own], *self._pad)
            g = torch.tensor([shares.group_of.get(j, 0) for j in own], device=self.device)
            in_group = torch.tensor([j in shares.group_of for j in own], device=self.device)
            full = torch.cat([mask_a[g] * in_group[:, None], mask_b], dim=1)  # a joiner in no group: no prefix
            past = out_a.past_key_values
            past.batch_select_indices(g)  # new tensors: the rows of part A taken above stay as they were
            out_b = self._forward(ids_b, full, positions(full)[:, mask_a.shape[1] :], past)
            rows = torch.arange(len(own), device=self.device)
            parts.append((own, *self._packed(out_b, rows, full, prefixes), out_b.logits[:, -1]))
        order = torch.tensor([j for p in parts for j in p[0]], device=self.device).argsort()
        keys = [torch.cat([p[1][i] for p in parts])[order] for i in range(len(parts[0][1]))]
        values = [torch.cat([p[2][i] for p in parts])[order] for i in range(len(parts[0][2]))]
        return keys, values, torch.cat([p[3] for p in parts])[order]

    @property
    def _pad(self):
        return self.pad_token_id, self.device

    @staticmethod
    def _packed(out, rows: torch.Tensor, mask: torch.Tensor, prefixes: list[list[int]]):
        """Rows `rows` of a forward's cache, their real columns (`mask`) left-packed to the widest prefix."""
        width = max(len(p) for p in prefixes)
        cache = out.past_key_values.layers
        return [pack_right(c.keys[rows], mask, width) for c in cache], [
            pack_right(c.values[rows], mask, width) for c in cache
        ]

    def _record(self, first_row: int, seqs: list[InFlight], logits: torch.Tensor) -> set[int]:
        """Sample one token per sequence (rows first_row...), append it, note which finished."""
        greedy = torch.tensor([s.request.greedy for s in seqs], device=self.device)
        tok, lp = self._sample(logits, greedy)
        toks, lps = tok.tolist(), lp.tolist()  # one device-to-host copy per step
        self._next = tok if first_row == 0 else torch.cat([self._next[:first_row], tok])
        finished = set()
        for j, s in enumerate(seqs):
            s.ids.append(toks[j])
            s.logprobs.append(lps[j])
            s.versions.append(self.version)
            reason = self._finish_reason(s, toks[j], self.stop_ids)
            if reason is not None:
                self._reasons[first_row + j] = reason
                finished.add(first_row + j)
        return finished

    def _sample(self, logits: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        tok = logp.argmax(dim=-1)
        if not bool(greedy.all()):
            probs = logp.exp()
            sampled = torch.multinomial(probs[~greedy], 1, generator=self.generator).squeeze(-1)
            tok = tok.masked_scatter(~greedy, sampled)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    # -- the batch's cache -------------------------------------------------------------------------
    def _merge(self, joiners: list[InFlight], keys, values, mask: torch.Tensor, pos: torch.Tensor) -> None:
        """Append the joiners' rows (left-packed keys and values per layer) to the running batch."""
        if self._cache is None:
            self._cache = SlotCache(len(keys))
        self._cache.join(keys, values, mask)
        self._pos = pos if not self.rows else torch.cat([self._pos, pos])
        self.rows += joiners

    def _drop_rows(self, gone: set[int]) -> None:
        """Remove finished or interrupted rows from the batch (the last rows take their slots)."""
        if not gone:
            return
        order = self._cache.drop(gone)
        self.rows = [self.rows[i] for i in order]
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        self._pos, self._next = self._pos[idx], self._next[idx]
