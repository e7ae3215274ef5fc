"""The trainer's distillation: the teacher's logprobs for the sampled estimator, or its exact KL in the head (full)."""

from __future__ import annotations

import time

import numpy as np
import torch

from areal_hpc.algo.distill import baseline_sums, full_kl_grad_
from areal_hpc.engines import forward
from areal_hpc.engines.teacher import load_teacher


class FullKL:
    """forward.Dense: coef x w_t x KL(p_student || p_teacher) at each loss token t, over the whole vocabulary, both
    under softmax(logits / T). The teacher's body runs once per micro-batch (no grad) for its last hidden states at
    the student's head rows; per chunk its head gives the teacher's log-softmax, one chunk-sized buffer that then
    holds the term's gradient. `weight` (per token of the laid-out sequences) is coef x aggregation weight x loss
    mask; a head row standing for several loss tokens (prefix tree) takes the sum of their weights. `acc` adds up
    (sum of KL over loss tokens, their count) for distill_kl."""

    def __init__(self, teacher: torch.nn.Module, temperature: float, weight: torch.Tensor, mask, acc: torch.Tensor):
        self.teacher, self.temperature, self.weight, self.mask, self.acc = teacher, temperature, weight, mask, acc
        self.head = teacher.get_output_embeddings().weight

    def begin(self, mb: forward.MicroBatch, rows: forward.Rows) -> None:
        with torch.no_grad():
            self.hidden, _ = forward._hidden_rows(self.teacher, mb, body_only=True)  # the same layout and head rows
        w, m = self.weight[rows.index].float(), self.mask[rows.index].float()
        if rows.inverse is not None:
            n = len(self.hidden)
            w, m = w.new_zeros(n).index_add_(0, rows.inverse, w), m.new_zeros(n).index_add_(0, rows.inverse, m)
        self.row_weight, self.row_tokens = w, m

    @torch.no_grad()
    def chunk(self, a: int, logsm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = a + len(logsm)
        h = self.hidden[a:b]
        logits = (h @ self.head.to(h.dtype).T).float()
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        lse = torch.cat([torch.logsumexp(r, dim=-1) for r in logits.split(64)])
        teacher = logits.sub_(lse[:, None])
        vocab = logsm.shape[-1]
        if teacher.shape[-1] < vocab:  # the student could put mass where the teacher has none: an infinite KL
            raise ValueError(f"distill.estimator=full needs a teacher output layer of >= {vocab} tokens, the student's")
        # a padded teacher: the student has no mass past its own rows, so the KL's sum stops there
        kl, grad = full_kl_grad_(logsm, teacher[:, :vocab], self.row_weight[a:b])
        self.acc += torch.stack([(kl * self.row_tokens[a:b]).sum(), self.row_tokens[a:b].sum()]).to(self.acc.dtype)
        return (kl * self.row_weight[a:b]).sum(), grad


class Distilling:
    """TorchTrainEngine's distillation steps (`self.distill`: engines/teacher.DistillSpec). estimator=sample: each
    version, the teacher's logprobs and the batch's baseline for PolicyStep's advantage term; estimator=full: a FullKL
    per micro-batch of the loss, and distill_kl from the training forwards."""

    _full_acc: torch.Tensor | None = None  # estimator full: this version's (sum of KL over loss tokens, their count)

    def _load_teacher(self) -> None:
        if self.teacher is None:
            dtype = "bfloat16" if self.bf16 else "float32"
            self.teacher = load_teacher(self.distill, dtype, self.device, self.packing, self.batching.trees)

    def _distill_version(self, batch, seqs: list[np.ndarray], prox_all: list, totals: dict) -> None:
        """Before the steps: the teacher's logprobs and baseline (sample), or a zeroed distill_kl sum (full)."""
        self._full_acc = None
        if self.distill.estimator == "full":
            self._load_teacher()
            self._full_acc = torch.zeros(2, dtype=torch.float64, device=self.device)
            return
        self._teacher_all = self._teacher_logprobs(seqs, totals)
        # the student's logprobs: the recomputed ones where there are, else the sampler's (as in PolicyStep's term)
        student = [p if p is not None else b for p, b in zip(prox_all, batch.split("behav_logprobs"), strict=True)]
        mine = baseline_sums(self._teacher_all, student, batch.split("loss_mask"))
        gap, n = self._allreduce_sum(list(mine))
        self._distill_baseline = gap / max(n, 1.0)  # the whole batch's, on every trainer
        if mine[1]:  # this share's mean reverse KL; rank 0 weighs the shares by their loss tokens
            totals["distill_kl"] = -mine[0] / mine[1]

    def _teacher_logprobs(self, seqs: list[np.ndarray], totals: dict) -> list:
        """Each sequence's logprobs under the distillation teacher (loaded the first time, before its span starts:
        the timeline's "teacher" span is the forward alone). No collective: a plain module on every trainer."""
        self._load_teacher()
        totals["teacher_t_start"] = time.time()
        out = self._frozen_logprobs(self.teacher, seqs)
        totals["teacher_t_end"] = time.time()
        return out

    def _dense(self, step) -> FullKL | None:
        """The micro-batch's full-vocabulary term (estimator full), from its PolicyStep's per-token columns."""
        if self._full_acc is None:
            return None
        c = step.cat
        weight = self.distill.coef * c["weight"] * c["mask"]  # the aggregation weight of the policy term
        return FullKL(self.teacher.model, self.temperature, weight, c["mask"], self._full_acc)

    def _distill_stats(self) -> dict:
        """estimator full: this share's mean KL over the loss tokens its steps trained on."""
        acc = self._full_acc
        if acc is None or not float(acc[1]):
            return {}
        return {"distill_kl": float(acc[0] / acc[1])}
