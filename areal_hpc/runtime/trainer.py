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
from areal_hpc.model import DTYPES, load_tokenizer
from areal_hpc.rollout import episode_stats
from areal_hpc.runtime.build import (
    adapt_after_warm_start,
    adapter_base,
    build_train_engine,
    warm_start,
    write_lora_contract,
)
from areal_hpc.runtime.layout import Layout
from areal_hpc.runtime.protocol import Tag
from areal_hpc.runtime.role_loop import Handler, RoleLoop
from areal_hpc.runtime.train_step import train_version
from areal_hpc.runtime.weight_sync import WeightSender
from areal_hpc.store import read_shard
from areal_hpc.types import Trajectory

log = logging.getLogger("areal_hpc.trainer")

# Testing hook: AREAL_HPC_FAULT="trainer@3" makes trainer rank 0 raise before training version 3, so
# the shutdown-after-error path is exercised by a real run (kill -9 covers crashes without a message).
FAULT_ENV = "AREAL_HPC_FAULT"


def share_stats(trajs: list[Trajectory], version: int) -> dict:
    """What rank 0 logs about the data a trainer consumed (staleness = version - oldest token version)."""
    stale = [version - t.version_start for t in trajs]
    return {
        "samples": len(trajs),
        "tokens": int(sum(len(t.input_ids) for t in trajs)),
        "gen_tokens": int(sum(t.gen_len for t in trajs)),
        "reward_sum": float(sum(t.reward for t in trajs)),
        "staleness_sum": float(sum(stale)),
        "staleness_max": int(max(stale, default=0)),
        "interrupted": int(sum(t.version_start != t.version_end for t in trajs)),
        **episode_stats(trajs),
    }


class Trainer(RoleLoop):
    """Data parallel over the trainers' own gloo group; trainer rank 0 also publishes weights.

    Its work comes only as messages from rank 0 (a batch to train, a checkpoint to write); between them
    it reports a weight publish that has finished.
    """

    role = "trainer"
    listen_to = 0

    def __init__(self, cfg: Config, run_dir: Path, comm, layout: Layout, sync_group, model_dir: Path, resume: bool):
        super().__init__(cfg, run_dir, comm, layout, resume)
        tc = cfg.trainer
        # LoRA with a warm start: every weight is warm-started first, then the adapter trains on the result
        self.adapt_later = bool(tc.lora_rank and tc.warm_start_steps and not resume)
        self.base_dir = adapter_base(cfg, self.run_dir, model_dir) if tc.lora_rank else model_dir
        # the default torch group = the trainers
        self.engine = build_train_engine(cfg, model_dir if self.adapt_later else self.base_dir, full=self.adapt_later)
        self.model_dir = model_dir
        self.sync_group = sync_group
        sc = cfg.sync
        self.sender = (
            WeightSender(
                sc.method,
                sync_group,
                self.run_dir,
                sc.bucket_mb,
                sc.checksum,
                sc.keep_versions,
                cfg.cluster.device,
                DTYPES[cfg.model.dtype],  # the trainer's weights are fp32 masters; generators hold model.dtype
            )
            if self.index == 0
            else None
        )
        fault = os.environ.get(FAULT_ENV, "")
        self.fault_version = int(fault.split("@")[1]) if fault.startswith("trainer@") and self.index == 0 else None
        self.stopping = False
        self.wait_since = time.time()  # start of the current wait for rank 0's next message

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
            trajs: list[Trajectory] = []
            mb_of: list[int] = []  # minibatch of each trajectory
            cache: dict[str, list[Trajectory]] = {}
            for j, minibatch in enumerate(share):
                for shard, indices in minibatch:
                    if shard not in cache:
                        cache[shard] = read_shard(self.run_dir.rollouts / shard)
                    trajs += [cache[shard][i] for i in indices]
                    mb_of += [j] * len(indices)
        with self.timeline.span("train"):
            stats, keep = train_version(self.engine, trajs, self.cfg, mb_of, len(share))
            gids = np.array([t.group_id for t in trajs], dtype=np.int64)
        for span in ("prox", "ref", "teacher"):  # the recompute, the reference's and the teacher's forwards
            if f"{span}_t_start" in stats:
                self.timeline.add(span, stats.pop(f"{span}_t_start"), stats.pop(f"{span}_t_end"))
        stats.update(share_stats(trajs, version))
        stats["groups_kept"] = int(len(set(gids[keep].tolist()))) if trajs else 0
        stats["loss_tokens"] = int(sum(int(t.loss_mask.sum()) for t, k in zip(trajs, keep) if k))
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
        self.mail.send(0, Tag.BYE, {"interrupted": 0})
        self.mail.flush()

    def close(self) -> None:
        self.timeline.close()
