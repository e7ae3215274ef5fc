"""Training engine in plain torch: padding-free micro-batches, proximal recompute, decoupled PPO, checkpoints."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from areal_hpc.algo.mismatch import version_sums
from areal_hpc.algo.packing import balance_across_ranks
from areal_hpc.algo.ppo import Objective, sequence_weights
from areal_hpc.engines import forward
from areal_hpc.engines import lora as lora_lib
from areal_hpc.engines.base import TrainEngine
from areal_hpc.engines.batching import Batching
from areal_hpc.engines.distill_full import Distilling
from areal_hpc.engines.policy_step import PPO_STATS, PolicyStep, merge_stats
from areal_hpc.engines.reference import FrozenPolicy, ReferencePolicy
from areal_hpc.engines.teacher import DistillSpec
from areal_hpc.engines.torch_files import TorchEngineFiles
from areal_hpc.model import load_causal_lm
from areal_hpc.store.columns import Batch, TrajectoryColumns, as_columns


class TorchTrainEngine(Distilling, TorchEngineFiles, TrainEngine):
    """Data-parallel PPO trainer on plain torch.

    With a process group of T > 1 ranks, every optimizer step all-reduces the summed gradients in one
    flat buffer (the loss is already normalised by the global token count, so a SUM is exact). This is
    DDP's arithmetic without DDP's per-backward hooks, which would deadlock when trainers get different
    numbers of micro-batches.

    Subclasses (the DeepSpeed engine) override the hooks _backward, _optimizer_step and _fwd; with
    `lockstep` every rank runs the same number of micro-batches (ZeRO-3 gathers parameters in forward).

    The weights and the optimizer state are fp32 whatever the model folder holds: AdamW updates at small
    learning rates round away in bf16. `bf16` computes the forward and backward in bf16 (autocast) on
    top of them. Micro-batches are packed without padding (`packing`), each prefix several sequences share
    laid down once (`share_prefixes`, engines/batching.py), log-probabilities are computed
    `logprob_chunk_tokens` at a time, and `gradient_checkpointing` recomputes each layer in backward.

    `objective` is the policy loss (algo.ppo.Objective; by default decoupled PPO from `eps_clip` and
    `behav_imp_weight_cap`), `loss_agg` how its tokens add up (algo.ppo.sequence_weights, with `loss_norm_tokens`
    for Dr.GRPO's constant). With a KL coefficient the engine holds a ReferencePolicy, else none.

    With `lora` (engines/lora.py) every linear layer but the output one carries a PEFT adapter, only the
    adapter is trained and published (`weights()`), checkpoints hold the adapter and its optimizer state,
    and the KL term's reference is the model with the adapter switched off.
    """

    lockstep = False  # collective_weights and collective_checkpoint keep TrainEngine's False

    def __init__(
        self,
        model_path: str,
        lr: float = 2e-5,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.05,
        grad_clip: float = 1.0,
        max_tokens_per_mb: int = 4096,
        n_minibatches: int = 4,
        eps_clip: float = 0.2,
        behav_imp_weight_cap: float | None = None,
        prox: str = "recompute",
        decoupled: bool = True,
        temperature: float = 1.0,
        seed: int = 1,
        process_group: dist.ProcessGroup | None = None,
        optimizer: str = "adamw",  # adamw | sgd (sgd: linear in the gradient, for exact comparisons)
        device: str = "cpu",
        bf16: bool = False,
        packing: bool = True,
        share_prefixes: bool = True,
        share_min_tokens: int = 32,
        logprob_chunk_tokens: int = 256,
        gradient_checkpointing: bool = False,
        objective: Objective | None = None,
        loss_agg: str = "token_mean",
        loss_norm_tokens: int = 1,
        lora: lora_lib.LoraSpec | None = None,
        distill: DistillSpec | None = None,
    ):
        torch.manual_seed(seed)
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, "float32").to(self.device)
        if self.model.get_output_embeddings().bias is not None:
            raise ValueError(f"model {model_path}: an output layer with a bias is not supported (Llama, Qwen2: none)")
        self.lora = lora
        if lora is not None:
            lora_lib.attach(self.model, lora)
        if packing:
            forward.use_packed_attention(self.model, self.device, half=bf16, trees=share_prefixes)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.autocast = bf16  # the DeepSpeed engine runs bf16 itself and turns this off
        self.packing = packing
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.fixed_chunks: int | None = None  # set under ZeRO-3: the same number of head calls on every rank
        self.pad_token_id = self.model.config.pad_token_id or 0
        # micro-batches, and the token positions a version's forwards computed (of them padding; stood for)
        self.batching = Batching(
            max_tokens_per_mb, packing, share_prefixes, share_min_tokens, self.pad_token_id, self.device
        )
        trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter alone
        if optimizer == "sgd":
            self.optimizer = torch.optim.SGD(trained, lr=lr, weight_decay=weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(trained, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.grad_clip = grad_clip
        self.n_minibatches = n_minibatches
        self.objective = objective or Objective(eps_clip=eps_clip, behav_cap=behav_imp_weight_cap or None)
        self.loss_agg, self.loss_norm_tokens = loss_agg, loss_norm_tokens
        self.reference: ReferencePolicy | None = None  # built at the first update when there is a KL term
        self.distill, self.teacher = distill, None  # the teacher: loaded at the first update when distilling
        self._teacher_all: list | None = None  # this version's teacher logprobs, per trajectory
        self._distill_baseline = 0.0  # this version's mean teacher-student gap over the batch's loss tokens
        self.bf16 = bf16
        self.prox = prox
        self.decoupled = decoupled
        self.temperature = temperature
        self.pg = process_group
        self.world = dist.get_world_size(process_group) if (process_group is not None or dist.is_initialized()) else 1
        self.version = 0
        self._fwd = self.model  # what a forward pass calls

    # -- forward ---------------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def _token_logprobs(self, seqs: list[np.ndarray]) -> list[torch.Tensor]:
        """Per sequence: each token's logprob given its prefix under softmax(logits / T)."""
        with self._autocast():
            head = self.model.get_output_embeddings()
            mb = self.batching.build(seqs)
            return forward.token_logprobs(
                self._fwd, head, mb, self.temperature, self.logprob_chunk_tokens, self.fixed_chunks
            )[0]

    def _head_path(self) -> dict:
        """How chunked_loss reaches the output layer (n_chunks, head_weight): fused, or ZeRO-3's checkpointed calls."""
        return {"n_chunks": self.fixed_chunks}

    def _loss(self, seqs: list[np.ndarray], loss_fn: forward.LossFn, with_entropy=False, prepass=None, dense=None):
        """A summed per-token loss over these sequences; also their logprobs and entropies (detached).
        `with_entropy`, `prepass` and `dense`: as forward.chunked_loss takes them."""
        with self._autocast():
            head = self.model.get_output_embeddings()
            mb = self.batching.build(seqs)
            return forward.chunked_loss(
                self._fwd,
                head,
                mb,
                loss_fn,
                self.temperature,
                self.logprob_chunk_tokens,
                with_entropy=with_entropy,
                prepass=prepass,
                dense=dense,
                **self._head_path(),
            )

    @torch.no_grad()
    def compute_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        # eval mode: the proximal logprobs must be the weights' own, not those of a random dropout mask
        was_training = self.model.training
        self.model.eval()
        try:
            return self._logprobs_no_grad(sequences)
        finally:
            self.model.train(was_training)

    def _logprobs_no_grad(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(sequences)
        mbs: list = self.batching.plan(sequences)
        if self.lockstep:  # every rank runs as many forwards as the busiest one (agreed before any forward)
            mbs += [None] * (self._allreduce_max(len(mbs)) - len(mbs))
        for mb in mbs:
            if mb is None:
                self._zero_loss()
                continue
            for i, lp in zip(mb, self._token_logprobs([sequences[i] for i in mb])):
                out[i] = lp.float().cpu().numpy()
        return out  # type: ignore[return-value]

    # -- distributed helpers ---------------------------------------------------------------------
    def _allreduce_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL groups take device tensors
        dist.all_reduce(t, group=self.pg)
        return t.tolist()

    def sum_across_trainers(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(self._allreduce_sum(np.asarray(values, dtype=np.float64).tolist()))

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def _allreduce_max(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return int(t)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate gradients; `last` marks the minibatch's final micro-batch on this rank."""
        loss.backward()

    def _zero_loss(self) -> torch.Tensor:
        """A forward that contributes nothing, for a rank with fewer micro-batches under lockstep."""
        loss = self._loss([np.array([self.pad_token_id, self.pad_token_id])], lambda lp, index: lp.sum() * 0.0)[0]
        self.batching.count(0, 2, 0)  # all of it is waste
        return loss

    def _allreduce_grads(self) -> None:
        if self.world == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.pg)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def _optimizer_step(self) -> float:
        self._allreduce_grads()
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(gnorm)

    # -- PPO -------------------------------------------------------------------------------------
    def ppo_update(
        self, trajectories: Batch, advantages: np.ndarray, minibatches: list[list[int]] | None = None
    ) -> dict[str, float]:
        """One policy version: recompute pi_prox (and, with a KL, the reference's logprobs) once, then one step
        of the objective per minibatch.

        `minibatches` (indices into `trajectories`, the same count on every rank) is how the batch was
        split before it was shared out; by default this rank's share is split n_minibatches ways.
        Every rank must call this (possibly with an empty share) so the collectives line up.
        The stats carry this share's training-inference gap sums (algo.mismatch.version_sums): the behaviour
        logprobs against the recomputed proximal ones, or without a recompute against the first minibatch's
        forward; rank 0 merges them over trainers into the mismatch_* and offpolicy_* columns.
        """
        batch = as_columns(trajectories)
        seqs = batch.split()  # views into the batch's ids
        self.batching.reset()
        totals: dict[str, float] = {}
        if self.decoupled and self.prox == "recompute" and (seqs or self.lockstep):
            totals["prox_t_start"] = time.time()  # the trainer's timeline shows the recompute as its own span
            prox_np = self.compute_logprobs(seqs)
            totals["prox_t_end"] = time.time()
            gaps = version_sums(batch, prox_np, self.version)  # the recompute measures the gap for free
            prox_all = [torch.as_tensor(x, device=self.device) for x in prox_np]
        else:
            prox_all, gaps = [None] * len(seqs), None  # measured on the first minibatch's forward below
        ref_all = [None] * len(seqs)
        if self.objective.kl_coef:
            totals["ref_t_start"] = time.time()  # the reference forward: a span of its own on the timeline
            ref_all = self._reference_logprobs(seqs)
            totals["ref_t_end"] = time.time()
        if self.distill is not None:  # the teacher's logprobs and baseline, or (full) a fresh distill_kl sum
            self._distill_version(batch, seqs, prox_all, totals)

        if minibatches is None:
            if seqs:  # whole groups, as the scheduler splits a batch: a group's prompt is shared in every step
                groups = batch.seqs["group_id"].tolist()
                minibatches = balance_across_ranks(batch.lengths.tolist(), self.n_minibatches, groups)
            else:
                minibatches = [[] for _ in range(self.n_minibatches)]
        micro_stats: list[dict] = []
        first: dict[int, torch.Tensor] = {}  # trajectory -> its logprobs in the first minibatch's forward
        loss_all = batch.token_sums("loss_mask").tolist()
        for mb_idx in minibatches:
            loss_tokens = [loss_all[i] for i in mb_idx]
            total_tokens, total_seqs = self._allreduce_sum([sum(loss_tokens), sum(n > 0 for n in loss_tokens)])
            if total_tokens == 0:
                continue  # nothing to learn from on any rank; all ranks skip together
            weights = sequence_weights(loss_tokens, self.loss_agg, total_tokens, total_seqs, self.loss_norm_tokens)
            seq_weight = dict(zip(mb_idx, weights))
            micros: list = self.batching.plan([seqs[i] for i in mb_idx])
            if self.lockstep:
                micros += [None] * (self._allreduce_max(len(micros)) - len(micros))
            for k, micro in enumerate(micros):
                last = k == len(micros) - 1
                if micro is None:
                    self._backward(self._zero_loss(), last)
                    continue
                idx = [mb_idx[j] for j in micro]
                loss, stats, lps = self._ppo_micro(batch, advantages, prox_all, ref_all, idx, seq_weight)
                if gaps is None:  # no recompute: the version's first forward, before its first optimizer step
                    first.update(zip(idx, lps))
                self._backward(loss, last)
                totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
                micro_stats.append(stats)
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + self._optimizer_step() / len(minibatches)
            if gaps is None:
                gaps = self._first_forward_gaps(batch, first)
        totals.update(gaps if gaps is not None else version_sums([], [], self.version))
        totals.update(self._distill_stats())  # estimator full: the KL its steps trained
        self.version += 1
        if "loss" in totals:
            totals["loss"] /= len(minibatches)  # mean minibatch loss
        if micro_stats:
            totals.update({k: v for k, v in merge_stats(micro_stats).items() if k in PPO_STATS})
        totals.update(self.batching.counts())  # every forward of the version: recompute, reference, teacher, steps
        return totals

    def _ppo_micro(self, batch, advantages, prox_all, ref_all, idx, seq_weight):
        """The policy loss of one micro-batch (a sum over its tokens, weighted to the minibatch's aggregate)."""
        step = PolicyStep(
            self.objective,
            self.decoupled,
            batch,
            advantages,
            idx,
            prox_all,
            ref_all,
            seq_weight,
            self.version,
            self.device,
            teacher_all=self._teacher_all,
            distill_coef=self.distill.coef if self.distill is not None else 0.0,
            distill_baseline=self._distill_baseline,
        )
        dense = self._dense(step)  # distill.estimator=full: the teacher's exact KL, in the loss
        loss, logprobs, entropies = self._loss(step.seqs, step.loss_fn, step.with_entropy, step.prepass, dense)
        return loss, step.stats(entropies), logprobs

    def _first_forward_gaps(self, batch: TrajectoryColumns, first: dict[int, torch.Tensor]) -> dict:
        """The mismatch sums of the sequences of the version's first minibatch (no proximal recompute: the
        ratio's own forward is the trainer's logprobs under the weights it holds before any step)."""
        order = sorted(first)
        lps = [first[i].float().cpu().numpy() for i in order]
        return version_sums(batch.take(order), lps, self.version)

    def _reference_logprobs(self, seqs: list[np.ndarray]) -> list:
        """Each sequence's logprobs under the reference policy (made from these weights the first time;
        with LoRA, the base model: the adapter switched off)."""
        if self.lora is not None:
            with lora_lib.adapters_off(self.model):
                return [torch.as_tensor(lp) for lp in self.compute_logprobs(seqs)]
        if self.reference is None:
            dtype = "bfloat16" if self.bf16 else "float32"
            self.reference = ReferencePolicy(
                self.model_path, self.weights(), dtype, self.device, self.packing, self.batching.trees
            )
        return self._frozen_logprobs(self.reference, seqs)

    def _frozen_logprobs(self, policy: FrozenPolicy, seqs: list[np.ndarray]) -> list:
        """Each sequence's logprobs under a frozen model (the reference, the teacher): chunked, no grad."""
        groups = self.batching.plan(seqs)
        mbs = [self.batching.build([seqs[i] for i in g]) for g in groups]
        out: list = [None] * len(seqs)
        order = [i for g in groups for i in g]
        for i, lp in zip(order, policy.logprobs(mbs, self.temperature, self.logprob_chunk_tokens)):
            out[i] = torch.as_tensor(lp)
        return out

    def supervised_step(self, sequences: list[np.ndarray], loss_masks: list[np.ndarray], lr: float) -> float:
        """Cross-entropy on the masked tokens (the warm start); does not change the policy version."""
        for g in self.optimizer.param_groups:
            saved_lr, g["lr"] = g["lr"], lr
        mask = torch.cat([torch.as_tensor(m, dtype=torch.float32, device=self.device) for m in loss_masks])
        total = max(self._allreduce_sum([float(mask.sum())])[0], 1.0)
        loss = self._loss(sequences, lambda lp, index: -(lp * mask[index]).sum() / total)[0]
        self._backward(loss, True)
        self._optimizer_step()
        for g in self.optimizer.param_groups:
            g["lr"] = saved_lr
        return float(loss.detach())
