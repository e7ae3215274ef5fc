"""One training forward over a micro-batch: padding-free packing (or right padding), chunked log-probabilities.

Packed: the sequences are laid end to end in one row and position ids restart at 0 at each sequence.
Attention never crosses a boundary: with `trainer.share_prefixes=false` on GPUs with flash-attn, its varlen
kernel reads the boundaries from the position ids; otherwise `PACKED_SDPA` runs causal sdpa once per sequence
(no mask, no cross-sequence work; on a GPU sdpa picks its flash or memory-efficient kernel itself).
Prefix tree (engines/micro_batch.py `shared`): a prefix several sequences share is laid down once and their
continuations attend to it; only `PACKED_SDPA` knows the tree (engines/prefix_attention.py), and the head
computes a shared (position, next token) row once, its value and gradient standing for every sequence.

The vocabulary projection never runs on the whole micro-batch. With a loss (`chunked_loss`), each chunk of
`chunk_tokens` positions is projected once: its log-probabilities go through the loss, and the gradients
of the hidden states and of the head are taken then and there, so at most one chunk of full-vocabulary
logits ever exists and nothing is recomputed in backward. This needs a loss that is a sum over tokens,
which the PPO and cross-entropy losses are. Without a loss (`token_logprobs`), chunks are checkpointed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from areal_hpc.engines.micro_batch import MicroBatch, Rows, packed, padded, shared  # noqa: F401 (the layouts)
from areal_hpc.engines.prefix_attention import tree_sdpa

PACKED_SDPA = "areal_packed_sdpa"


# -- attention over packed rows --------------------------------------------------------------------------
def _packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal sdpa per sequence of a packed row ([1, heads, N, d]); the boundaries are where positions restart.

    transformers passes no mask to an attention it does not know, so a padded batch (right padding, where
    causal attention alone keeps real tokens off the padding) takes the plain causal path."""
    if kwargs.get("prefix_tree") is not None:  # shared prefixes laid down once (engines/prefix_attention.py)
        return tree_sdpa(query, key, value, kwargs["prefix_tree"], dropout if module.training else 0.0, scaling), None
    pos = kwargs.get("position_ids")
    gqa = query.shape[1] != key.shape[1]
    if pos is None or query.shape[0] != 1:
        starts = [0]
    else:
        starts = torch.nonzero(pos[0] == 0).flatten().tolist() or [0]
    bounds = [*starts, query.shape[2]]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            is_causal=True,
            dropout_p=dropout if module.training else 0.0,
            scale=scaling,
            enable_gqa=gqa,
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def use_packed_attention(model: torch.nn.Module, device: torch.device, half: bool = False, trees: bool = False) -> str:
    """Switch `model` to an attention that keeps packed sequences apart; returns its name.

    `half`: the model computes in bf16 (flash attention takes no fp32). `trees`: micro-batches may be prefix
    trees, which only PACKED_SDPA reads (on a GPU its sdpa calls take the flash or memory-efficient kernels)."""
    from transformers import AttentionInterface

    if getattr(model.config, "use_sliding_window", False):
        raise ValueError("a model with sliding-window attention cannot be packed here; set trainer.packing=false")
    name = PACKED_SDPA
    if device.type == "cuda" and half and not trees:
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            name = "flash_attention_2"  # varlen from the position ids
    if name == PACKED_SDPA:
        AttentionInterface.register(PACKED_SDPA, _packed_sdpa)
    model.set_attn_implementation(name)
    return name


# -- log-probabilities without a loss: checkpointed chunks -------------------------------------------------
def _hidden_rows(model: torch.nn.Module, mb: MicroBatch, body_only: bool = False) -> tuple[torch.Tensor, Rows]:
    """The last hidden state of each row the head computes, and those rows. `body_only`: call the model's body
    (a plain transformers model, no wrapper), which keeps no other layer's hidden states: a frozen teacher's
    forward beside a training one holds only its last layer's."""
    if body_only:
        out = model.get_decoder()(input_ids=mb.input_ids, use_cache=False, **mb.model_kwargs())
        last = out.last_hidden_state
    else:
        out = model(
            input_ids=mb.input_ids,
            output_hidden_states=True,
            logits_to_keep=1,  # the head is applied here, in chunks
            use_cache=False,
            **mb.model_kwargs(),
        )
        last = out.hidden_states[-1]
    rows = mb.head_rows()
    return last.reshape(-1, last.shape[-1])[rows.src], rows


def _entropy(logsm: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """-sum(p * log p) per row, a few rows at a time: no second chunk-sized buffer."""
    return torch.cat([-(r.exp() * r).sum(-1) for r in logsm.split(rows)]) if len(logsm) else logsm.new_zeros(0)


def _chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float, entropy_grad: bool = False
):
    logits = head(hidden).float()  # a copy only when the model computes in a lower precision
    if temperature != 1.0:
        logits.div_(temperature)  # in place: no second full-size copy
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # differentiated for an entropy bonus
        entropy = _entropy(logits - lse[:, None])
    return logp, entropy


def token_logprobs(
    model: torch.nn.Module,
    head: torch.nn.Module,
    mb: MicroBatch,
    temperature: float = 1.0,
    chunk_tokens: int = 256,
    n_chunks: int | None = None,
    entropy_grad: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: the log-probability of each token given its prefix under softmax(logits / T), and the
    entropy of that distribution; position 0 gets 0 for both.

    `model` is what a forward calls (a transformers causal LM, or DeepSpeed's engine around one); it is asked
    for the last hidden states and one position of logits, and `head` (its output embedding) is applied here.
    Under grad each chunk is checkpointed (recomputed in backward). `n_chunks` fixes how many times `head`
    is called (chunks of equal size, some possibly empty), whatever the micro-batch's length: under ZeRO-3
    each call gathers the head's parameters, so every trainer must make the same number of calls.
    `entropy_grad`: the entropies carry a gradient (an entropy bonus), else they are detached.
    """
    hidden, rows = _hidden_rows(model, mb)
    targets = rows.targets
    step = chunk_tokens if n_chunks is None else max(1, -(-len(hidden) // n_chunks))
    starts = range(0, len(hidden), step) if n_chunks is None else [i * step for i in range(n_chunks)]
    logps, ents = [], []
    for a in starts:
        h, t = hidden[a : a + step], targets[a : a + step]
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, h, t, head, temperature, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, t, head, temperature)
        logps.append(lp)
        ents.append(ent)
    flat_lp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    flat_ent = torch.cat(ents) if ents else flat_lp.detach()
    if rows.inverse is not None:  # a shared row's value goes to every sequence through it
        flat_lp, flat_ent = flat_lp[rows.inverse], flat_ent[rows.inverse]
    return mb.per_sequence(flat_lp, rows.index), mb.per_sequence(flat_ent, rows.index)


# -- a loss over tokens, its gradient taken chunk by chunk in the forward ----------------------------------
# loss_fn(logp, index) -> summed loss of these rows; `index` says which tokens of the laid-out sequences
# they are. It must be a sum over tokens: each chunk's part of the gradient is then its own. With
# `with_entropy`, loss_fn(logp, index, entropy) also gets each row's entropy, differentiable.
LossFn = Callable[..., torch.Tensor]
# prepass(logp, index): the log-probabilities of every row, detached, before any loss is taken: for a loss whose
# per-token terms need a whole sequence first (GSPO's sequence ratio). Costs a second pass of the head.
Prepass = Callable[[torch.Tensor, torch.Tensor], None]


class Dense(Protocol):
    """A loss term over the whole vocabulary of each head row (distillation's exact KL, engines/distill_full.py):
    `begin` once the micro-batch's head rows are known; then per chunk of head rows from `a`, given the chunk's
    log-softmax (under T, not to be changed), its summed loss and d loss / d (logits / T), or None for no gradient."""

    def begin(self, mb: MicroBatch, rows: Rows) -> None: ...

    def chunk(self, a: int, logsm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def _grad_logits(logsm: torch.Tensor, t, g: torch.Tensor, g_ent: torch.Tensor | None, entropy: torch.Tensor):
    """d loss / d logits of a chunk, written over `logsm` (its log-softmax), 64 rows at a time.

    d logp[t] / dz = onehot(t) - p, and d H / dz = -p * (log p + H), so with g = d loss / d logp and
    g_ent = d loss / d H: grad = g * onehot(t) - p * (g + g_ent * (log p + H)).
    """
    if g_ent is None:
        p = logsm.exp_()  # in place: one chunk-sized buffer all along
        grad_z = p.mul_(-g[:, None])
    else:
        for a in range(0, len(logsm), 64):  # p needs its own buffer here: 64 rows of it at a time
            s = logsm[a : a + 64]
            p = s.exp()
            s.add_(entropy[a : a + 64, None]).mul_(g_ent[a : a + 64, None]).add_(g[a : a + 64, None]).mul_(p).neg_()
        grad_z = logsm
    grad_z.scatter_add_(1, t[:, None], g[:, None].to(grad_z.dtype))
    return grad_z


class _HeadLoss(torch.autograd.Function):
    """loss(log_softmax(hidden @ W.T / T)[targets]) whose backward hands over gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, rows, temperature, chunk_tokens, loss_fn, record, with_entropy, prepass, dense):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        w = weight.detach().to(dtype)
        targets, index, inverse = rows.targets, rows.index, rows.inverse
        if prepass is not None:
            lp_all = _HeadLoss.logprobs(hidden, w, targets, temperature, chunk_tokens, dtype)
            prepass(lp_all if inverse is None else lp_all[inverse], index)
        if inverse is not None:  # the loss rows of each chunk of head rows: a contiguous run (inverse is sorted)
            starts = torch.arange(0, len(hidden) + chunk_tokens, chunk_tokens, device=inverse.device)
            bounds = torch.searchsorted(inverse, starts).tolist()
        grad_h = torch.empty_like(hidden)
        # a frozen head (LoRA) takes no gradient: no head-sized buffer, no second matmul per chunk
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for k, a in enumerate(range(0, len(hidden), chunk_tokens)):
            h = hidden[a : a + chunk_tokens].detach().to(dtype)
            t = targets[a : a + chunk_tokens]
            logits = (h @ w.T).float()
            if temperature != 1.0:
                logits.div_(temperature)
            lse = torch.cat([torch.logsumexp(r, dim=-1) for r in logits.split(64)])  # small temporaries
            logsm = logits.sub_(lse[:, None])  # in place: the chunk's log-softmax
            logp = logsm.gather(-1, t[:, None]).squeeze(-1)
            entropy = _entropy(logsm)
            if inverse is None:
                local, row_lp, row_ent, idx = None, logp, entropy, index[a : a + chunk_tokens]
            else:  # each head row once per sequence through it
                lo, hi = bounds[k], bounds[k + 1]
                local, idx = inverse[lo:hi] - a, index[lo:hi]
                row_lp, row_ent = logp[local], entropy[local]
            with torch.enable_grad():
                lp = row_lp.detach().requires_grad_()
                if with_entropy:
                    ent = row_ent.detach().requires_grad_()
                    loss = loss_fn(lp, idx, ent)
                    g, g_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True, materialize_grads=True)
                else:
                    loss = loss_fn(lp, idx)
                    (g,), g_ent = torch.autograd.grad(loss, lp, allow_unused=True, materialize_grads=True), None
            if local is not None:  # a head row's gradient: the sum over the loss rows it stands for
                g = g.new_zeros(len(logp)).index_add_(0, local, g)
                g_ent = None if g_ent is None else g_ent.new_zeros(len(logp)).index_add_(0, local, g_ent)
            total += loss.detach().float()
            record(row_lp, row_ent)
            del logits
            dense_grad = None
            if dense is not None:  # read logsm before _grad_logits overwrites it; its gradient joins below
                part, dense_grad = dense.chunk(a, logsm)
                total += part.detach().float()
            # through the log-softmax (and the entropy), then through the division by T
            grad_z = _grad_logits(logsm, t, g, g_ent, entropy)
            del logsm
            if dense_grad is not None:
                grad_z.add_(dense_grad)
                del dense_grad
            if temperature != 1.0:
                grad_z.div_(temperature)
            gz = grad_z.to(dtype)
            grad_h[a : a + chunk_tokens] = (gz @ w).to(hidden.dtype)
            if grad_w is not None and gz.dtype == grad_w.dtype:
                grad_w.addmm_(gz.T, h)  # in place: no head-sized temporary
            elif grad_w is not None:
                grad_w += (gz.T @ h).float()
            del grad_z, gz
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def logprobs(hidden, w, targets, temperature, chunk_tokens, dtype) -> torch.Tensor:
        """Every row's log-probability, chunk by chunk, nothing kept but the result (the prepass)."""
        out = []
        for a in range(0, len(hidden), chunk_tokens):
            logits = (hidden[a : a + chunk_tokens].detach().to(dtype) @ w.T).float()
            if temperature != 1.0:
                logits.div_(temperature)
            lse = torch.cat([torch.logsumexp(r, dim=-1) for r in logits.split(64)])
            out.append(logits.gather(-1, targets[a : a + chunk_tokens, None]).squeeze(-1) - lse)
            del logits
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        grad_weight = None if grad_w is None else grad_w * grad_out
        return (grad_h * grad_out, grad_weight) + (None,) * 8


def chunked_loss(
    model: torch.nn.Module,
    head: torch.nn.Module,
    mb: MicroBatch,
    loss_fn: LossFn,
    temperature: float = 1.0,
    chunk_tokens: int = 256,
    n_chunks: int | None = None,
    with_entropy: bool = False,
    prepass: Prepass | None = None,
    head_weight: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    dense: Dense | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The summed loss of a micro-batch (differentiable), and per sequence the log-probabilities and entropies
    (detached). `n_chunks` (ZeRO-3) takes the checkpointed path, where every head call is a module call.
    `with_entropy`: loss_fn also takes the entropies and may train them; `prepass`: see Prepass.
    `head_weight`: a context in which head.weight is whole, entered after the body's forward (ZeRO-3, frozen head).
    `dense`: a full-vocabulary term added to the loss, fused path only (see Dense)."""
    if n_chunks is not None:
        if dense is not None:  # the config check refuses this first (config/objective.py)
            raise ValueError("a full-vocabulary loss term (distill.estimator=full) needs the fused head, not n_chunks")
        logps, ents = token_logprobs(model, head, mb, temperature, chunk_tokens, n_chunks, with_entropy)
        _, _, index = mb.predicting_rows()
        flat = torch.cat([lp[1:] for lp in logps])
        if prepass is not None:
            prepass(flat.detach(), index)
        if with_entropy:
            loss = loss_fn(flat, index, torch.cat([e[1:] for e in ents]))
        else:
            loss = loss_fn(flat, index)
        return loss, [lp.detach() for lp in logps], [e.detach() for e in ents]
    hidden, rows = _hidden_rows(model, mb)
    if dense is not None:
        dense.begin(mb, rows)
    lps, ents = [], []

    def record(lp, ent):
        lps.append(lp)
        ents.append(ent)

    with head_weight():
        loss = _HeadLoss.apply(
            hidden, head.weight, rows, temperature, chunk_tokens, loss_fn, record, with_entropy, prepass, dense
        )
    flat_lp = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
    flat_ent = torch.cat(ents) if ents else flat_lp
    return loss, mb.per_sequence(flat_lp, rows.index), mb.per_sequence(flat_ent, rows.index)
