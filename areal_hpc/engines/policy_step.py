"""One micro-batch's policy loss: its per-token inputs laid out, and the loss function the chunked forward calls."""

from __future__ import annotations

import numpy as np
import torch

from areal_hpc.algo.distill import distill_term
from areal_hpc.algo.ppo import Objective, loglinear_prox_logp, policy_loss, segment_mean
from areal_hpc.store.columns import Batch, as_columns

# per-token stats -> the token count each is a mean over: kept loss tokens, or loss tokens before the cap
PPO_STATS = {
    "clip_frac": "loss_tokens",
    "ratio_mean": "loss_tokens",
    "behav_w_mean": "loss_tokens",
    "seq_ratio_mean": "loss_tokens",
    "capped_frac": "in_tokens",
    "truncated_frac": "in_tokens",
    "seq_rejected_frac": "in_tokens",
    "kl": "in_tokens",
    "entropy_bonus": "in_tokens",
    "entropy": "in_tokens",
}


def merge_stats(parts: list[dict]) -> dict:
    """Stats of several pieces (chunks, micro-batches) as one: each mean weighted by its own token count."""
    out = {w: sum(p[w] for p in parts) for w in ("loss_tokens", "in_tokens")}
    for k, w in PPO_STATS.items():
        if any(k in p for p in parts):
            out[k] = sum(p.get(k, 0.0) * p[w] for p in parts) / max(out[w], 1.0)
    return out


class PolicyStep:
    """The loss of the sequences `idx` of a minibatch: what `forward.chunked_loss` needs, and their stats.

    Each per-token input is a slice of `batch`'s columns (or of the per-sequence logprobs) laid end to end.
    `prox_all` / `ref_all` hold each trajectory's recomputed proximal / reference logprobs (None: loglinear or
    plain PPO; no KL). `seq_weight[i]` is trajectory i's per-token aggregation weight. `version` is the policy
    version being trained (its proximal policy, for loglinear). With importance=sequence, or sequence rejection
    without recomputed proximal logprobs, the forward runs a prepass (`prepass`) that fills in each sequence's
    mean log-ratios before any loss is taken; with them recomputed, rejection's weights are known beforehand.
    `teacher_all` (distillation) holds each trajectory's teacher logprobs: every loss token's advantage gains
    `distill_coef` x (teacher - student - `distill_baseline`) (algo/distill.py), the student's logprobs being the
    recomputed proximal ones where there are, else the behaviour ones.
    """

    def __init__(
        self,
        obj: Objective,
        decoupled: bool,
        batch: Batch,
        advantages: np.ndarray,
        idx: list[int],
        prox_all: list,
        ref_all: list,
        seq_weight: dict[int, float],
        version: int,
        device: torch.device,
        teacher_all: list | None = None,
        distill_coef: float = 0.0,
        distill_baseline: float = 0.0,
    ):
        self.obj, self.decoupled, self.version = obj, decoupled, version
        self.recompute = prox_all[idx[0]] is not None
        batch = as_columns(batch)
        lens = batch.lengths[idx]
        # slices of the batch's columns, laid end to end; a sequence's values repeated over its tokens
        cols = {
            "behav": torch.from_numpy(batch.laid_out("behav_logprobs", idx)),
            "mask": torch.from_numpy(batch.laid_out("loss_mask", idx).astype(np.float32)),
            "versions": torch.from_numpy(batch.laid_out("versions", idx)),
            "adv": torch.from_numpy(np.repeat(np.asarray(advantages, np.float32)[idx], lens)),
            "weight": torch.from_numpy(np.repeat(np.array([seq_weight[i] for i in idx], np.float32), lens)),
            "seq": torch.from_numpy(np.repeat(np.arange(len(idx)), lens)),
        }
        if self.recompute:
            cols["prox"] = torch.cat([torch.as_tensor(prox_all[i], dtype=torch.float32).cpu() for i in idx])
        if teacher_all is not None:  # distillation: the teacher's per-token term joins the sequence's advantage
            # against the student being trained (its recomputed logprobs) where there are: with stale data
            # the sampler's would keep pushing a token the student has already moved
            teacher = torch.cat([torch.as_tensor(teacher_all[i]).cpu() for i in idx])
            student = cols["prox"] if self.recompute else cols["behav"]
            cols["adv"] = cols["adv"] + distill_term(teacher, student, cols["mask"], distill_coef, distill_baseline)
        if ref_all[idx[0]] is not None:
            cols["ref"] = torch.cat([torch.as_tensor(ref_all[i], dtype=torch.float32).cpu() for i in idx])
        self.cat = {k: v.to(device) for k, v in cols.items()}
        self.n_seqs = len(idx)
        self.seqs = [batch.token("input_ids", i) for i in idx]  # the forward's ids: views into the batch's
        self.seq_log_ratio = self.seq_log_behav_w = None  # per token of the laid-out sequences, from the prepass
        if obj.rejects and self.recompute:  # pi_prox is fixed: no second pass of the head for the weights
            c = self.cat
            self.seq_log_behav_w = segment_mean(c["prox"] - c["behav"], c["mask"], c["seq"], self.n_seqs)
        self.parts: list[dict] = []

    @property
    def with_entropy(self) -> bool:
        return self.obj.entropy_coef != 0

    @property
    def prepass(self):
        needed = self.obj.importance == "sequence" or (self.obj.rejects and not self.recompute)
        return self._prepass if needed else None

    def _prox(self, lp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        behav = self.cat["behav"][index]
        if self.recompute:
            return self.cat["prox"][index]
        if not self.decoupled:  # plain PPO: the ratio to the behaviour policy, no behaviour weight (w = 1)
            return behav
        # the weights being trained become version+1; pi_prox is the current version
        return loglinear_prox_logp(lp, behav, self.cat["versions"][index], self.version + 1)

    def _prepass(self, lp: torch.Tensor, index: torch.Tensor) -> None:
        """Each sequence's mean log(pi / pi_prox) and log(pi_prox / pi_behav) over its loss tokens."""
        mask, seq = self.cat["mask"][index], self.cat["seq"][index]
        prox = self._prox(lp, index)
        n = len(self.cat["mask"])
        self.seq_log_ratio, self.seq_log_behav_w = torch.zeros(n, device=lp.device), torch.zeros(n, device=lp.device)
        self.seq_log_ratio[index] = segment_mean(lp - prox, mask, seq, self.n_seqs)
        self.seq_log_behav_w[index] = segment_mean(prox - self.cat["behav"][index], mask, seq, self.n_seqs)

    def loss_fn(self, lp: torch.Tensor, index: torch.Tensor, entropy: torch.Tensor | None = None) -> torch.Tensor:
        c = self.cat
        loss, stats = policy_loss(
            self.obj,
            lp,
            self._prox(lp, index),
            c["behav"][index],
            c["adv"][index],
            c["mask"][index],
            c["weight"][index],
            ref_logp=c["ref"][index] if "ref" in c else None,
            entropy=entropy,
            seq_log_ratio=None if self.seq_log_ratio is None else self.seq_log_ratio[index],
            seq_log_behav_w=None if self.seq_log_behav_w is None else self.seq_log_behav_w[index],
        )
        self.parts.append(stats)
        return loss

    def stats(self, entropies: list[torch.Tensor]) -> dict:
        """The micro-batch's stats, its mean entropy over the loss tokens included."""
        mask = self.cat["mask"]
        entropy = float((torch.cat(entropies).to(mask.device) * mask).sum()) / max(float(mask.sum()), 1.0)
        return {**merge_stats(self.parts), "entropy": entropy}
