"""One training forward over a micro-batch: padding-free packing (or right padding), chunked log-probabilities.

Packed: the sequences are laid end to end in one row, position ids restart at 0 at each sequence, and no
attention mask is passed, so transformers derives a block-diagonal causal mask from the position ids (a
varlen kernel under flash attention on GPUs; an explicit mask with sdpa on CPU). No token attends across a
sequence boundary, and no position is padding.

The vocabulary projection never runs on the whole micro-batch: log-probabilities (and the entropy) are
computed `chunk_tokens` positions at a time under activation checkpointing, so at most one chunk of
full-vocabulary logits exists at once, in the forward and in the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class MicroBatch:
    """Model inputs for a list of sequences, and where each sequence's tokens sit in them."""

    input_ids: torch.Tensor  # [1, N] packed, [B, L] padded
    position_ids: torch.Tensor | None  # packed only
    attention_mask: torch.Tensor | None  # padded only
    lengths: list[int]
    positions: int  # token positions the forward computes (padding included)

    @property
    def padding(self) -> int:
        return self.positions - sum(self.lengths)


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


def _predicting_rows(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the positions that predict a next token of their own sequence, and of that token."""
    width = mb.input_ids.shape[1]
    src = []
    for i, n in enumerate(mb.lengths):
        start = i * width if mb.position_ids is None else sum(mb.lengths[:i])
        src.append(torch.arange(start, start + n - 1))
    src_t = torch.cat(src).to(mb.input_ids.device)
    return src_t, src_t + 1


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float):
    logits = head(hidden).float()  # a copy only when the model computes in a lower precision
    if temperature != 1.0:
        logits.div_(temperature)  # in place: no second full-size copy
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    with torch.no_grad():  # entropy is logged, never differentiated
        p = (logits - lse[:, None]).exp_()
        entropy = lse - p.mul_(logits).sum(-1)
    return logp, entropy


def token_logprobs(
    model: torch.nn.Module,
    head: torch.nn.Module,
    mb: MicroBatch,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    n_chunks: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: the log-probability of each token given its prefix under softmax(logits / T), and the
    entropy of that distribution; position 0 gets 0 for both.

    `model` is what a forward calls (a transformers causal LM, or DeepSpeed's engine around one); it is asked
    for the last hidden states and one position of logits, and `head` (its output embedding) is applied here.
    """
    out = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=False,
    )
    hidden = out.hidden_states[-1].reshape(-1, out.hidden_states[-1].shape[-1])
    src, tgt = _predicting_rows(mb)
    targets = mb.input_ids.reshape(-1)[tgt]
    logps, ents = [], []
    step = chunk_tokens if n_chunks is None else max(1, -(-len(src) // n_chunks))
    starts = range(0, len(src), step) if n_chunks is None else [i * step for i in range(n_chunks)]
    for a in starts:
        h = hidden[src[a : a + step]]
        t = targets[a : a + step]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, h, t, head, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, t, head, temperature)
        logps.append(lp)
        ents.append(ent)
    flat_lp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    flat_ent = torch.cat(ents) if ents else flat_lp.detach()
    per_lp, per_ent, k = [], [], 0
    for n in mb.lengths:
        zero = flat_lp.new_zeros(1)
        per_lp.append(torch.cat([zero, flat_lp[k : k + n - 1]]))
        per_ent.append(torch.cat([zero, flat_ent[k : k + n - 1]]))
        k += n - 1
    return per_lp, per_ent
