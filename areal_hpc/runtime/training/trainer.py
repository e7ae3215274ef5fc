"""A trainer rank: read its share of each batch from the store, take one decoupled-PPO version, publish weights."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from areal_hpc.config import Config
from areal_hpc.data import load_run_dataset
from areal_hpc.episode_counts import episode_stats
from areal_hpc.model import DTYPES, load_tokenizer
from areal_hpc.runtime.build import (
    adapt_after_warm_start,
    adapter_base,
    build_train_engine,
    warm_start,
    write_lora_contract,
)
from areal_hpc.runtime.comm.layout import Layout
from areal_hpc.runtime.comm.protocol import Tag
from areal_hpc.runtime.comm.role_loop import Handler, RoleLoop
from areal_hpc.runtime.comm.transfer_groups import (
    NcclTransferGroups,
    TransferGroups,
    direct_transfer,
    transfer_backend,
)
from areal_hpc.runtime.comm.weight_sync import WeightSender
from areal_hpc.runtime.failures import FAULT_ENV
from areal_hpc.runtime.training.train_step import train_version
from areal_hpc.store.cache import ShardCache
from areal_hpc.store.columns import TrajectoryColumns, gather
from areal_hpc.store.ledger import version_entries

log = logging.getLogger("areal_hpc.trainer")


def share_stats(batch: TrajectoryColumns, version: int) -> dict:
    """What rank 0 logs about the data a trainer consumed (staleness = version - oldest token version)."""
    s = batch.seqs
    stale = version - s["version_start"].astype(np.int64)
    return {
        "samples": len(batch),
        "tokens": int(batch.offsets[-1]),
        "gen_tokens": int(s["gen_len"].sum()),
        "reward_sum": float(s["reward"].astype(np.float64).sum()),
        "staleness_sum": float(stale.sum()),
        "staleness_max": int(stale.max()) if len(stale) else 0,
        "interrupted": int((s["version_start"] != s["version_end"]).sum()),
        **episode_stats(batch),
    }


def load_share(shards: ShardCache, share: list) -> tuple[TrajectoryColumns, list[int]]:
    """A trainer's share as one set of columns, and the minibatch each sequence was dealt to."""
    parts, mb_of = [], []
    for j, minibatch in enumerate(share):
        for shard, indices in minibatch:
            parts.append((shards.get(shard), indices))
            mb_of += [j] * len(indices)
    return gather(parts), mb_of


def train_share(engine, cfg: Config, batch: TrajectoryColumns, mb_of: list[int], n_minibatches: int, version: int):
    """One version on a trainer's share; its stats as TRAIN_DONE carries them (the forwards' spans included)."""
    stats, keep = train_version(engine, batch, cfg, mb_of, n_minibatches)
    stats.update(share_stats(batch, version))
    stats["groups_kept"] = len(np.unique(batch.seqs["group_id"][keep]))
    stats["loss_tokens"] = int(batch.token_sums("loss_mask")[keep].sum())
    return stats


class Trainer(RoleLoop):
    """Data parallel over the trainers' own gloo group; trainer rank 0 also publishes weights.

    Its work comes only as messages from rank 0 (a batch to train, a checkpoint to write); between them
    it reports a weight publish that has finished.
    """

    role = "trainer"
    listen_to = 0

    def __init__(self, cfg: Config, run_dir: Path, comm, layout: Layout, sync_group, model_dir: Path, resume: bool):
        super().__init__(cfg, run_dir, comm, layout, resume)
        trainer_cfg = cfg.trainer
        # LoRA with a warm start: every weight is warm-started first, then the adapter trains on the result
        self.adapt_later = bool(trainer_cfg.lora_rank and trainer_cfg.warm_start_steps and not resume)
        self.base_dir = adapter_base(cfg, self.run_dir, model_dir) if trainer_cfg.lora_rank else model_dir
        # the default torch group = the trainers
        self.engine = build_train_engine(cfg, model_dir if self.adapt_later else self.base_dir, full=self.adapt_later)
        self.model_dir = model_dir
        self.sync_group = sync_group
        sync_cfg = cfg.sync
        self.sender = (
            WeightSender(
                sync_cfg.method,
                sync_group,
                self.run_dir,
                sync_cfg.bucket_mb,
                sync_cfg.checksum,
                sync_cfg.keep_versions,
                cfg.cluster.device,
                DTYPES[cfg.model.dtype],  # the trainer's weights are fp32 masters; generators hold model.dtype
                sync_cfg.limit_s,
            )
            if self.index == 0
            else None
        )
        fault = os.environ.get(FAULT_ENV, "")
        self.fault_version = int(fault.split("@")[1]) if fault.startswith("trainer@") and self.index == 0 else None
        self.stopping = False
        self.wait_since = time.time()  # start of the current wait for rank 0's next message
        self.shards = ShardCache(self.run_dir.rollouts)  # read once, kept across versions

    def handlers(self) -> dict[Tag, Handler]:
        return {Tag.BATCH: self._on_batch, Tag.CHECKPOINT: self._on_checkpoint, Tag.STOP: self._on_stop}

    def _start(self) -> None:
        if self.resume:
            v = self.run_dir.latest_checkpoint()
            with self.timeline.span("load"):
                self.engine.load_checkpoint(self.run_dir.trainer_checkpoint(v))
        elif self.cfg.trainer.warm_start_steps:
            with self.timeline.span("train"):
                tok = load_tokenizer(self.model_dir)
                warm_start(self.engine, tok, load_run_dataset(self.cfg, tok), self.cfg, progress=False)
            if self.adapt_later:
                with self.timeline.span("checkpoint"):
                    self.engine = adapt_after_warm_start(self.cfg, self.run_dir, self.engine, self.index == 0)
        if self.engine.lora is not None:  # before any weights are announced: generators read it at their first load
            write_lora_contract(self.cfg, self.run_dir, self.engine, self.base_dir, self.index == 0)
        body = {"version": self.engine.version, "raw_gbps": None}
        # gathered once per publish (collective under ZeRO-3: every trainer calls weights() once here)
        state = self.engine.weights() if (self.sender is not None or self.engine.collective_weights) else None
        if self.sender is not None and self.sync_group is not None:
            # both ends run these once, right after start-up: the generators check that what will be sent
            # fits their buffers, then the ceiling the bucketed sync is measured against
            plan = self.sender.plan_for(state)
            self.sync_group.check_layout(plan.layout, self.cfg.cluster.device)
            body["raw_gbps"] = self.sync_group.raw_bandwidth(plan.nbytes, self.cfg.cluster.device)
            if direct_transfer(self.cfg):  # vLLM's workers receive themselves: gloo on CPU, NCCL on GPUs
                nccl = transfer_backend(self.cfg.cluster.device) == "nccl"
                groups = (NcclTransferGroups if nccl else TransferGroups)(
                    self.sync_group, self.cfg.cluster.devices_per_generator, self.sync_group.timeout_s
                )
                self.sender.use_transfer_groups(groups)
        self._announce_and_publish(Tag.READY, body, state)

    def _announce_and_publish(self, tag: Tag, body: dict, state: dict | None = None) -> None:
        """Tell rank 0 (which tells the generators), and trainer 0 publishes the weights.

        A broadcast needs the generators to join, so the message goes first, and the broadcast is only
        posted: training goes on while the generators join. Files must exist before anyone is told to
        read them, so the disk path publishes first.
        """
        if self.sender is None:
            self.mail.send(0, tag, body)
            if self.engine.collective_weights and state is None:
                self.engine.weights()  # ZeRO-3: every trainer takes part in gathering what trainer 0 sends
            return
        disk = self.sender.method == "disk"
        if not disk:
            self.mail.send(0, tag, body)
            # MPI moves a message between nodes only while the sender is inside MPI: make sure the
            # announcement has left before the weights are posted
            self.mail.flush()
        previous = self.sender.publish(state if state is not None else self.engine.weights(), self.engine.version)
        if previous is not None:
            self._sync_done(previous)
        if disk:
            self.mail.send(0, tag, body)
        self._poll_sync()

    def _sync_done(self, info: dict) -> None:
        self.timeline.add("sync", info.pop("t_start"), info.pop("t_end"))
        self.mail.send(0, Tag.SYNC_DONE, info)

    def _poll_sync(self) -> bool:
        if self.sender is not None and (info := self.sender.poll()) is not None:
            self._sync_done(info)
            return True
        return False

    def _end_wait(self) -> None:
        self.timeline.add("wait", self.wait_since, time.time())

    def _train(self, version: int, share: list) -> None:
        if version != self.engine.version:
            raise RuntimeError(f"trainer at version {self.engine.version} was sent the batch of version {version}")
        if self.fault_version is not None and version >= self.fault_version:
            raise RuntimeError(f"injected fault before training version {version} ({FAULT_ENV})")
        t0 = time.time()
        with self.timeline.span("load"):
            batch, mb_of = load_share(self.shards, share)
        with self.timeline.span("train"):
            stats = train_share(self.engine, self.cfg, batch, mb_of, len(share), version)
        self.shards.consumed(version_entries(self.run_dir, version))  # rank 0 recorded it before dealing
        for span in ("prox", "ref", "teacher"):  # the recompute, the reference's and the teacher's forwards
            if f"{span}_t_start" in stats:
                self.timeline.add(span, stats.pop(f"{span}_t_start"), stats.pop(f"{span}_t_end"))
        stats["t_train"] = time.time() - t0
        self._announce_and_publish(Tag.TRAIN_DONE, {"version": self.engine.version, "stats": stats})

    def _checkpoint(self, version: int) -> None:
        path = self.run_dir.trainer_checkpoint(version)
        # torch: data-parallel replicas are identical, one copy is the checkpoint; DeepSpeed: every
        # trainer writes its shard
        if self.index == 0 or self.engine.collective_checkpoint:
            with self.timeline.span("checkpoint"):
                if self.index == 0 and path.exists():  # left by a run that crashed before the checkpoint was complete
                    shutil.rmtree(path)
                self.engine.save_checkpoint(path)
        self.mail.send(0, Tag.CKPT_DONE, {"version": version, "path": str(path)})

    # -- the loop -------------------------------------------------------------------------------
    def _on_batch(self, src: int, body: dict) -> None:
        self._end_wait()
        self._train(body["version"], body["share"])
        self.wait_since = time.time()

    def _on_checkpoint(self, src: int, body: dict) -> None:
        self._end_wait()
        self._checkpoint(body["version"])
        self.wait_since = time.time()

    def _on_stop(self, src: int, body: dict) -> None:
        self._end_wait()
        self.stopping = True

    def tick(self) -> bool:
        return self._poll_sync()

    def finished(self) -> bool:
        return self.stopping

    def run(self) -> None:
        torch.set_num_threads(self.cfg.cluster.threads_per_rank)
        self._start()
        self.wait_since = time.time()
        self.loop()
        if self.sender is not None and (info := self.sender.wait()) is not None:
            self._sync_done(info)
        self.mail.send(0, Tag.BYE, {"interrupted": 0, "versions_checked": 0, "versions_mismatched": 0})
        self.mail.flush()

    def close(self) -> None:
        if self.sender is not None and isinstance(self.sender.group, TransferGroups):
            self.sender.group.close()
        self.timeline.close()
