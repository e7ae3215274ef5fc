"""Generation engine in plain torch/transformers: batched KV-cache sampling with per-token logprobs."""

from __future__ import annotations

import torch

from areal_hpc.model import load_causal_lm
from areal_hpc.engines.base import GenerationBase
from areal_hpc.types import GenOutput, GenRequest


class TorchGenerationEngine(GenerationBase):
    """Static-batch sampler for machines without vLLM.

    Logprobs are those of the sampled token under softmax(logits / temperature), the distribution the
    trainer recomputes (top-p only restricts which tokens can be drawn). abort() may be called from
    another thread; generate() then returns at the next token with finish_reason 'abort' and the
    partial tokens, which a later request can resume from (prompt + partial).
    """

    def __init__(
        self,
        model_path: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: str = "float32",
        seed: int = 0,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        device: str = "cpu",
    ):
        super().__init__()
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype).to(self.device).eval()
        self.temperature = temperature
        self.top_p = top_p
        cfg = self.model.config
        self.eos_token_id = cfg.eos_token_id if eos_token_id is None else eos_token_id
        self.pad_token_id = (cfg.pad_token_id if cfg.pad_token_id is not None else self.eos_token_id) if pad_token_id is None else pad_token_id
        self.generator = torch.Generator(self.device).manual_seed(seed)

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.model.load_state_dict(state_dict, strict=True)
            self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def close(self) -> None:
        pass  # nothing outside this process's memory

    # -- sampling --------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        if greedy:
            tok = logp.argmax(dim=-1)
        else:
            probs = logp.exp()
            if self.top_p < 1.0:
                sorted_p, idx = probs.sort(dim=-1, descending=True)
                # keep the smallest prefix whose mass reaches top_p (always at least one token)
                drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
            tok = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    @torch.no_grad()
    def _generate(self, requests: list[GenRequest], greedy: bool) -> list[GenOutput]:
        if not requests:
            return []
        n = len(requests)
        prefixes = [list(r.prompt_ids) + list(r.partial_ids) for r in requests]
        budget = [max(0, r.max_new_tokens - len(r.partial_ids)) for r in requests]
        out_ids = [list(r.partial_ids) for r in requests]
        out_lp = [list(r.partial_logprobs) for r in requests]
        out_ver = [list(r.partial_versions) for r in requests]
        reason = ["length" if b == 0 else None for b in budget]

        # Left-pad the prefixes so every row's next token is at the same column.
        width = max(len(p) for p in prefixes)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prefixes):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)

        past = None
        step_ids, step_pos = ids, pos
        for step in range(max(budget) if budget else 0):
            if all(r is not None for r in reason):
                break
            if self._abort.is_set():
                break
            with self._lock:
                version = self.version
                out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                 past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok, lp = self._sample(out.logits[:, -1, :], greedy)
            toks, lps = tok.tolist(), lp.tolist()  # one device-to-host copy per step
            for i in range(n):
                if reason[i] is not None:
                    continue
                t = toks[i]
                out_ids[i].append(t)
                out_lp[i].append(lps[i])
                out_ver[i].append(version)
                if t == self.eos_token_id and not self.ignore_eos:
                    reason[i] = "stop"
                elif len(out_ids[i]) >= requests[i].max_new_tokens:
                    reason[i] = "length"
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)

        return self._outputs(requests, out_ids, out_lp, out_ver, reason)
