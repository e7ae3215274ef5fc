"""Rank 0: grants prompts under the staleness bound, dispatches batches through the ledger, coordinates checkpoints
and the stop (runtime/rank0/phases.py)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time

from areal_hpc.config import Config
from areal_hpc.data.record import record_dataset
from areal_hpc.rundir import RunDir
from areal_hpc.rundir.actions import prune_checkpoints
from areal_hpc.runtime.comm.layout import Layout
from areal_hpc.runtime.comm.protocol import Tag
from areal_hpc.runtime.comm.role_loop import Handler, RoleLoop
from areal_hpc.runtime.rank0.phases import CheckpointRound, Phase, StopSequence
from areal_hpc.runtime.rank0.prompt_count import count_train_prompts
from areal_hpc.runtime.rank0.resume import (
    clean_temporaries,
    load_scheduler_state,
    quarantine_corrupt_shards,
    save_scheduler_state,
    unconsumed_groups,
)
from areal_hpc.runtime.rank0.scheduler_core import BatchPlan, ReadyGroup, SchedulerCore, fair_shares
from areal_hpc.runtime.reporting.run_report import RunReport
from areal_hpc.store import Ledger
from areal_hpc.utils import atomic_write_text

log = logging.getLogger("areal_hpc.scheduler")


class Scheduler(RoleLoop):
    """Drives SchedulerCore from MPI messages (runtime/comm/protocol.py); what it learns goes to the RunReport."""

    role = "scheduler"

    def __init__(self, cfg: Config, run_dir: RunDir, comm, layout: Layout, resume: bool, stop_flag):
        super().__init__(cfg, run_dir, comm, layout, resume)
        self.stop_flag = stop_flag  # set by a signal handler (SIGTERM/SIGUSR1 from Slurm, Ctrl-C)
        rollout_cfg = cfg.rollout
        self.core = SchedulerCore(
            n_prompts=count_train_prompts(cfg),
            batch_prompts=rollout_cfg.batch_prompts,
            eta=rollout_cfg.eta,
            n_trainers=layout.n_trainers,
            n_minibatches=cfg.ppo.n_minibatches,
            max_running=rollout_cfg.max_running or None,
            seed=cfg.data.seed,
            reject_uniform=cfg.ppo.drop_uniform_groups,
        )
        self.report = RunReport(cfg, self.run_dir, layout, self.core)
        if changed := record_dataset(self.run_dir, cfg.data):  # the first start writes RUN_DIR/dataset.json
            log.warning(changed)
        self.ledger = Ledger(self.run_dir)
        self.want = {g: 0 for g in layout.generator_ranks}  # prompts each generator asked for, not granted yet
        # with weight_update=drain a generator admits nothing between a new version and its load: generator ->
        # the version it must load first. Room is not granted to it meanwhile (it would sit held back
        # through the drain while a generator that has loaded could run it)
        self.loading: dict[int, int] = {}
        self.next_group_id = 0
        self.phases = StopSequence(list(range(1, layout.world_size)), layout.generator_ranks)
        self.batch: BatchPlan | None = None  # in flight on the trainers
        self.train_done: dict[int, dict] = {}  # trainer rank -> its TRAIN_DONE body for the batch in flight
        self.checkpoints = CheckpointRound(layout.n_trainers)
        self.pruner: threading.Thread | None = None  # deleting checkpoints older than trainer.keep_checkpoints
        self._stop_file_checked = 0.0
        # the longest version (trained to trained) and checkpoint (asked to complete) seen: against slurm.signal_s
        self.version_s = self.ckpt_s = 0.0
        self._t_trained: float | None = None

    def handlers(self) -> dict[Tag, Handler]:
        return {
            Tag.WANT: self._on_want,
            Tag.GROUPS_DONE: self._on_groups_done,
            Tag.READY: self._on_ready,
            Tag.TRAIN_DONE: self._on_train_done,
            Tag.SYNC_DONE: lambda src, body: self.report.sync_done(body),
            Tag.WEIGHTS_OK: self._on_weights_ok,
            Tag.EVAL_RESULT: self._on_eval_result,
            Tag.EVAL_PROGRESS: lambda src, body: self.report.eval_progress(body),
            Tag.CKPT_DONE: self._on_ckpt_done,
            Tag.BYE: self._on_bye,
        }

    # -- start-up -------------------------------------------------------------------------------
    def _restore(self) -> int:
        """Back to the newest complete checkpoint; returns its version."""
        n = self.run_dir.latest_checkpoint()
        if n is None:
            raise RuntimeError(f"no complete checkpoint under {self.run_dir.checkpoints}; nothing to resume")
        clean_temporaries(self.run_dir)
        state = load_scheduler_state(self.run_dir, n)
        removed = self.ledger.truncate_after(n - 1)  # batches recorded after the checkpoint were not kept
        quarantined = quarantine_corrupt_shards(self.run_dir, self.ledger.consumed())
        for line in quarantined:
            log.warning("%s", line)
        stored, max_gid = unconsumed_groups(self.run_dir, self.ledger.consumed(), skip_uniform=self.core.reject_uniform)
        reused, stale = self.core.restore(n, state["core"], stored)
        self.next_group_id = max(state["next_group_id"], max_gid + 1)
        self.report.open(n, resumed=True, state=state)
        self.report.resumed_with(dropped=stale, quarantined=quarantined)
        log.info(
            "resumed from checkpoint v%d: ledger versions %s dropped, %d stored groups reused, %d dropped",
            n,
            removed,
            reused,
            stale,
        )
        return n

    # -- messages -------------------------------------------------------------------------------
    def _on_want(self, src: int, body: dict) -> None:
        self.want[src] += body["k"]

    def _on_weights_ok(self, src: int, body: dict) -> None:
        self.report.weights_loaded(src, body)
        if not body["skipped"] and body["version"] >= self.loading.get(src, body["version"]):
            self.loading.pop(src, None)

    def _on_groups_done(self, src: int, body: dict) -> None:
        for g in body["groups"]:
            g = dict(g)
            self.report.group_generated(g)  # takes out its episodes' counts, whether the group is kept or not
            uniform = g.pop("uniform")  # the reward all its samples got, or None
            self.core.group_done(ReadyGroup(shard=body["shard"], **g), uniform is not None)
            running = self.phases.phase in (Phase.STARTING, Phase.RUNNING)
            if self.report.learning_signal(uniform, can_fail=running):
                self._begin_stop("no learning signal (trainer.max_uniform_batches)")

    def _on_ready(self, src: int, body: dict) -> None:
        if src != self.layout.trainer0:
            return
        v = body["version"]
        if v != self.core.version:
            raise RuntimeError(f"trainer 0 is at version {v} but the scheduler restored version {self.core.version}")
        self._publish(v, starting=True)
        self.report.rl_started(v, body["raw_gbps"])
        self.phases.started()
        if v >= self.cfg.trainer.versions:
            self._begin_stop(f"already at version {v} (trainer.versions={self.cfg.trainer.versions})")
        if not self.resume:
            self._request_eval("start")
            self._start_checkpoint(v)
        self.report.write_progress()

    def _publish(self, v: int, starting: bool = False) -> None:
        """Trainer 0 is sending weights v now: tell generators to take them."""
        self.core.version_trained(v)
        for g in self.layout.generator_ranks:
            self.mail.send(g, Tag.NEW_VERSION, {"version": v})
            if self.cfg.rollout.weight_update == "drain":
                self.loading[g] = v
        self.report.published(v, starting)

    def _on_train_done(self, src: int, body: dict) -> None:
        self.train_done[src] = body
        if src == self.layout.trainer0:
            v = body["version"]
            self._publish(v)
            every = self.cfg.logging.eval_every
            if every and v % every == 0:
                self._request_eval(f"v{v}")
                self.report.expect(v, {"eval"})
        if len(self.train_done) < self.layout.n_trainers:
            return
        parts = list(self.train_done.values())
        v = parts[0]["version"]
        self.train_done = {}
        self.batch = None
        self.report.trained(v, parts)
        now = time.time()
        if self._t_trained is not None:
            self.version_s = max(self.version_s, now - self._t_trained)
        self._t_trained = now
        ck = self.cfg.trainer.checkpoint_every
        if ck and v % ck == 0:
            self._start_checkpoint(v)
        if v >= self.cfg.trainer.versions:
            self._begin_stop(f"trained {v} versions")
        self.report.write_progress()

    def _request_eval(self, tag: str) -> bool:
        """Ask generator 0 for a held-out evaluation; False when the run has none (no prompts or generators)."""
        if not (self.cfg.logging.eval_prompts and self.layout.n_generators):
            return False
        self.mail.send(self.layout.generator_ranks[0], Tag.EVAL, {"tag": tag})
        return True

    def _on_eval_result(self, src: int, body: dict) -> None:
        self.report.eval_result(body)
        if body["tag"] == "final":
            self.phases.final_eval_ended()

    def _on_bye(self, src: int, body: dict) -> None:
        self.report.rank_stopped(body)
        self.phases.said_bye(src)

    # -- checkpoints ----------------------------------------------------------------------------
    def _start_checkpoint(self, v: int) -> None:
        if self.checkpoints.begin(v, time.time()):
            for t in self.layout.trainer_ranks:
                self.mail.send(t, Tag.CHECKPOINT, {"version": v})

    def _on_ckpt_done(self, src: int, body: dict) -> None:
        v = self.checkpoints.trainer_done()
        if v is None:
            return
        state = {
            "version": v,
            "core": self.core.state_dict(),
            "next_group_id": self.next_group_id,
            **self.report.state_dict(v),
        }
        save_scheduler_state(self.run_dir, v, state)
        took = self.checkpoints.complete(time.time())
        log.info("checkpoint v%d complete", v)
        self.ckpt_s = max(self.ckpt_s, took)
        self._check_signal_budget()
        self._start_prune()

    def _check_signal_budget(self) -> None:
        """Once per start, under Slurm: a version plus a checkpoint took longer than slurm.signal_s, so the time
        limit's signal would come too late to save the version in flight."""
        sc, need = self.cfg.slurm, self.version_s + self.ckpt_s
        if not (os.environ.get("SLURM_JOB_ID") and sc.requeue) or need <= sc.signal_s:
            return
        line = (
            f"a version plus a checkpoint took {need:.0f} s ({self.version_s:.0f} + {self.ckpt_s:.0f}), more than "
            f"slurm.signal_s={sc.signal_s}: the time limit would lose the version in flight; areal-hpc resume with "
            f"slurm.signal_s={math.ceil(1.25 * need / 60) * 60}"
        )
        if self.report.take_warning(line):
            log.warning(line)

    def _start_prune(self) -> None:
        """Older checkpoints go in a thread: deleting tens of GB can take seconds on a shared filesystem,
        and rank 0 must keep answering meanwhile. Nothing else touches a checkpoint older than the newest."""
        keep = self.cfg.trainer.keep_checkpoints
        if not keep:
            return
        self._join_pruner()
        self.pruner = threading.Thread(target=self._prune, args=(keep,), name="checkpoint-prune", daemon=True)
        self.pruner.start()

    def _prune(self, keep: int) -> None:
        try:
            gone = prune_checkpoints(self.run_dir, keep)
        except OSError as err:  # the run goes on; the next checkpoint tries again
            log.warning("could not delete old checkpoints (trainer.keep_checkpoints=%d): %s", keep, err)
            return
        if gone:
            log.info("deleted checkpoints %s (trainer.keep_checkpoints=%d)", ", ".join(f"v{v}" for v in gone), keep)

    def _join_pruner(self) -> None:
        if self.pruner is not None:
            self.pruner.join()
            self.pruner = None

    # -- granting and batches -------------------------------------------------------------------
    def _grant(self) -> None:
        room = self.core.gate.capacity()
        if room <= 0:
            return
        ready = {g: w for g, w in self.want.items() if g not in self.loading}
        for g, k in fair_shares(ready, room).items():  # by free capacity when there is not enough for all
            idx = self.core.grant(k)
            if not idx:
                continue
            prompts = [(i, self.next_group_id + j) for j, i in enumerate(idx)]
            self.next_group_id += len(idx)
            self.want[g] -= len(idx)
            self.mail.send(g, Tag.GRANT, {"prompts": prompts})

    def _dispatch(self) -> None:
        if self.batch is not None or self.checkpoints.pending is not None:
            return
        plan = self.core.next_batch()
        if plan is None:
            return
        self.ledger.record(plan.version, plan.entries())  # durable before any trainer sees the batch
        self.batch = plan
        for t, share in zip(self.layout.trainer_ranks, plan.shares):
            body = {
                "version": plan.version,
                "share": [[(plan.groups[i].shard, plan.groups[i].indices) for i in mb] for mb in share],
            }
            self.mail.send(t, Tag.BATCH, body)

    # -- stopping -------------------------------------------------------------------------------
    def _begin_stop(self, reason: str, requested: bool = False) -> None:
        if self.phases.stop(reason, requested):
            log.info("stopping: %s", reason)

    def _asked_to_stop(self, now: float) -> bool:
        """A signal came, or the stop file is there (looked for every 0.25 s: a stat per loop would cost rank 0 a
        few % of a core)."""
        stop_file = False
        if now - self._stop_file_checked >= 0.25:
            self._stop_file_checked = now
            stop_file = self.run_dir.stop.exists()
        return self.stop_flag() or stop_file

    def _check_stop(self) -> None:
        now = time.time()
        limit = self.cfg.trainer.max_wall_s
        if self._asked_to_stop(now):
            self._begin_stop("stop requested", requested=True)  # the final evaluation gets logging.stop_eval_s
        elif self.phases.phase is Phase.RUNNING and limit and self.report.rl_elapsed(now) >= limit:
            self._begin_stop(f"wall-time limit of {limit:g} s")

    def _settle(self) -> None:
        """Stopping: once no batch is on the trainers, checkpoint the version rank 0 is at (a stop always leaves
        one); once that is complete, ask for the final evaluation and tell every rank to STOP."""
        if self.batch is not None or self.train_done or self.checkpoints.pending is not None:
            return
        if not self.checkpoints.holds(self.core.version):
            self._start_checkpoint(self.core.version)
            return
        self._join_pruner()  # the final checkpoint's pruning ends before the run reports it finished
        # on a stop request the final evaluation gets logging.stop_eval_s at most (0: none), and the one running is cut
        budget = self.phases.final_eval_budget(self.cfg.logging.stop_eval_s)
        eval_asked = budget != 0 and self._request_eval("final")
        for r in self.phases.other_ranks:
            self.mail.send(r, Tag.STOP, {"stop_eval_s": budget})
        self.phases.checkpointed(eval_asked)

    # -- the loop -------------------------------------------------------------------------------
    def tick(self) -> bool:
        """One turn of rank 0's phase (runtime/rank0/phases.py): grant and dispatch while running; a stop
        request ends the running phase, or cuts a final evaluation that is running."""
        phase = self.phases.phase
        if phase is Phase.RUNNING:
            self._grant()
            self._dispatch()
        if phase in (Phase.STARTING, Phase.RUNNING):
            self._check_stop()
        elif phase is Phase.FINAL_EVAL and not self.phases.requested and self._asked_to_stop(time.time()):
            for g in self.phases.cut_final_eval():  # a stop request during the final evaluation ends it now
                self.mail.send(g, Tag.STOP, {"stop_eval_s": 0.0})
        if self.phases.phase is Phase.STOPPING:
            self._settle()
        return False

    def finished(self) -> bool:
        """Every other rank has said BYE after its STOP."""
        return self.phases.done

    def run(self) -> dict:
        start = self._restore() if self.resume else 0
        if self.resume:
            self.checkpoints.resumed_from(start)
        else:
            self.report.open(0, resumed=False)
        self.core.version_trained(start)
        self.loop()
        self.mail.flush()
        summary = self.report.finish(self.phases.reason)
        if self.report.failure:  # a verdict, not a crash: the run ended cleanly, and the launcher names why it failed
            atomic_write_text(self.run_dir.rank_error(self.rank), self.report.failure + "\n")
        self.timeline.close()
        return summary
