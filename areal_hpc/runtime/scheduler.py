"""Rank 0: grants prompts under the staleness bound, assembles batches, records the ledger, runs the run."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from areal_hpc.config import Config
from areal_hpc.data import load_dataset
from areal_hpc.metrics import MetricsLogger
from areal_hpc.runtime.layout import Layout
from areal_hpc.runtime.protocol import Mailbox, Tag
from areal_hpc.runtime.resume import (
    clean_temporaries,
    latest_checkpoint,
    load_scheduler_state,
    save_scheduler_state,
    unconsumed_groups,
)
from areal_hpc.runtime.scheduler_core import BatchPlan, ReadyGroup, SchedulerCore, fair_shares
from areal_hpc.runtime.timeline import Timeline
from areal_hpc.store import Ledger
from areal_hpc.utils import atomic_write_text

log = logging.getLogger("areal_hpc.scheduler")

STOP_FILE = "STOP"  # touching RUN_DIR/STOP asks a run to checkpoint and stop (the launcher does it on Ctrl-C)


class Scheduler:
    """Drives SchedulerCore from MPI messages; see runtime/protocol.py for the messages."""

    def __init__(self, cfg: Config, run_dir: Path, comm, layout: Layout, resume: bool, stop_flag):
        self.cfg, self.run_dir, self.layout, self.resume = cfg, Path(run_dir), layout, resume
        self.mail = Mailbox(comm)
        self.stop_flag = stop_flag  # set by a signal handler (SIGTERM/SIGUSR1 from Slurm, Ctrl-C)
        rc = cfg.rollout
        n_prompts = len(load_dataset(cfg.data).train)
        self.core = SchedulerCore(n_prompts=n_prompts, batch_prompts=rc.batch_prompts, eta=rc.eta,
                                  n_trainers=layout.n_trainers, n_minibatches=cfg.ppo.n_minibatches,
                                  max_running=rc.max_running or None,
                                  seed=cfg.data.seed, reject_uniform=cfg.ppo.drop_uniform_groups)
        self.ledger = Ledger(self.run_dir)
        self.timeline = Timeline(self.run_dir, 0, "scheduler")
        self.want = {g: 0 for g in layout.generator_ranks}
        self.next_group_id = 0
        self.dropped_on_resume = 0
        self.start_version = 0
        self.metrics: MetricsLogger | None = None

        self.batch: BatchPlan | None = None  # in flight on the trainers
        self.train_done: dict[int, dict] = {}  # trainer rank -> its TRAIN_DONE body for the batch in flight
        self.ckpt_pending: int | None = None
        self.ckpt_acks = 0
        self.last_ckpt = -1
        self.evals: dict[str, float] = {}
        self.eval_waiting: set[str] = set()
        self.rows: dict[int, dict] = {}  # version -> metrics row being assembled
        self.row_wait: dict[int, set] = {}  # version -> parts the row still waits for
        self.row_got: dict[int, set] = {}  # version -> parts that arrived
        self.stopping = False
        self.stop_reason = ""
        self.byes = 0
        self.aborted_requests = 0  # requests generators aborted for new weights (and resumed)
        self.t0 = time.time()
        self.t_rl: float | None = None
        self.tokens_consumed = 0
        self.samples_consumed = 0
        self.tokens_generated = 0
        self.raw_gbps = math.nan
        self.sync_gbps: list[float] = []
        self._stop_file_checked = 0.0

    # -- start-up -------------------------------------------------------------------------------
    def _restore(self) -> int:
        """Back to the newest complete checkpoint; returns its version."""
        n = latest_checkpoint(self.run_dir)
        if n is None:
            raise RuntimeError(f"no complete checkpoint under {self.run_dir}/checkpoints; nothing to resume")
        clean_temporaries(self.run_dir)
        state = load_scheduler_state(self.run_dir, n)
        removed = self.ledger.truncate_after(n - 1)  # batches recorded after the checkpoint were not kept
        self.core.load_state_dict(state["core"])
        found, max_gid = unconsumed_groups(self.run_dir, self.ledger.consumed(), skip_uniform=self.core.reject_uniform)
        already = set(self.core.dropped_ids)
        ready = [(g, end) for g, end in found if g.group_id not in already]
        # reusable: fresh enough for version n, and sampled only by versions that still exist (<= n)
        fresh = [g for g, end in ready if n - g.version_start <= self.cfg.rollout.eta and end <= n]
        stale = [g for g, end in ready if not (n - g.version_start <= self.cfg.rollout.eta and end <= n)]
        self.core.dropped_ids += [g.group_id for g in stale]
        self.dropped_on_resume = state.get("dropped_on_resume", 0) + len(stale)
        self.core.ready = sorted(fresh, key=lambda g: g.version_start)
        self.core.gate.version = n
        self.core.gate.accepted = n * self.cfg.rollout.batch_prompts + len(fresh)
        self.next_group_id = max(state["next_group_id"], max_gid + 1)
        self.tokens_consumed = state.get("tokens_consumed", 0)
        self.samples_consumed = state.get("samples_consumed", 0)
        self.evals = dict(state.get("evals", {}))
        log.info("resumed from checkpoint v%d: ledger versions %s dropped, %d stored groups reused, %d dropped",
                 n, removed, len(fresh), len(stale))
        return n

    # -- messages -------------------------------------------------------------------------------
    def _handle(self, src: int, tag: Tag, body: dict) -> None:
        if tag == Tag.WANT:
            self.want[src] += body["k"]
        elif tag == Tag.GROUPS_DONE:
            for g in body["groups"]:
                self.tokens_generated += g.pop("gen_tokens")
                uniform = g.pop("uniform", False)
                self.core.group_done(ReadyGroup(shard=body["shard"], **g), uniform)
        elif tag == Tag.READY:
            self._on_ready(src, body)
        elif tag == Tag.TRAIN_DONE:
            self._on_train_done(src, body)
        elif tag == Tag.SYNC_DONE:
            v = body["version"]
            row = self.rows.setdefault(v, {})
            row.update(sync_s=body["sync_s"], sync_bytes=body["bytes"],
                       sync_gbps=body["bytes"] / max(body["sync_s"], 1e-9) / 1e9)
            if body["checksum"] is not None:
                row["checksum_trainer"] = body["checksum"]
            self.sync_gbps.append(row["sync_gbps"])
            self._row_got(v, "sync")
        elif tag == Tag.WEIGHTS_OK:
            v = body["version"]
            row = self.rows.setdefault(v, {})
            g = self.layout.index(src)
            if body["checksum"] is not None:
                row[f"checksum_gen{g}"] = body["checksum"]
            if body.get("skipped"):  # a newer version arrived first; the checksum is of what was received
                row[f"skipped_gen{g}"] = 1
            else:
                row[f"load_s_gen{g}"] = body["load_s"]
            self._row_got(v, f"weights{src}")
        elif tag == Tag.EVAL_RESULT:
            self.eval_waiting.discard(body["tag"])
            if body["acc"] is not None:  # None: superseded by a later evaluation before it started
                self.evals[body["tag"]] = body["acc"]
                log.info("held-out accuracy %s (weights v%s): %.3f", body["tag"], body["version"], body["acc"])
            if body["tag"].startswith("v"):
                v = int(body["tag"][1:])
                if body["acc"] is not None:
                    # the weights its tokens came from: an evaluation that spans a weight load ends on the newer
                    self.rows.setdefault(v, {}).update(heldout_acc=body["acc"], heldout_version=body["version"],
                                                       heldout_version_end=body["version_end"])
                self._row_got(v, "eval")
        elif tag == Tag.CKPT_DONE:
            self.ckpt_acks += 1
            if self.ckpt_acks == self.layout.n_trainers:
                self._finish_checkpoint()
        elif tag == Tag.BYE:
            self.byes += 1
            self.aborted_requests += body.get("interrupted", 0)
        else:
            raise RuntimeError(f"scheduler got unexpected message {tag.name} from rank {src}")

    def _expect(self, v: int, parts: set) -> None:
        """The metrics row of version v waits for these parts (sync, weight acks, eval)."""
        self.row_wait.setdefault(v, set()).update(parts - self.row_got.setdefault(v, set()))

    def _row_got(self, v: int, part: str) -> None:
        self.row_got.setdefault(v, set()).add(part)
        self.row_wait.setdefault(v, set()).discard(part)
        self._flush_rows()

    def _flush_rows(self, force: bool = False) -> None:
        """Write finished rows in version order: a row is complete once trained and every awaited part arrived."""
        for v in sorted(self.rows):
            done = "train" in self.row_got.get(v, set()) and not self.row_wait.get(v)
            if not (done or force):
                break
            row = self.rows.pop(v)
            self.row_wait.pop(v, None)
            self.row_got.pop(v, None)
            if self.resume and v == self.start_version:
                continue  # the checkpoint's version republished: its row is already in metrics.csv
            gens = [row.get(f"checksum_gen{i}") for i in range(self.layout.n_generators)]
            if "checksum_trainer" in row and all(g is not None for g in gens):
                row["weights_match"] = int(all(g == row["checksum_trainer"] for g in gens))
            self.metrics.log(v, row)

    def _on_ready(self, src: int, body: dict) -> None:
        if src != self.layout.trainer0:
            return
        v = body["version"]
        if v != self.core.version:
            raise RuntimeError(f"trainer 0 is at version {v} but the scheduler restored version {self.core.version}")
        self.raw_gbps = body.get("raw_gbps", math.nan)
        self._publish(v, {"wall_s": time.time() - self.t0})
        self._row_got(v, "train")  # the starting weights: nothing trained, the row only waits for the sync
        self.t_rl = time.time()
        if v >= self.cfg.trainer.versions:
            self._begin_stop(f"already at version {v} (trainer.versions={self.cfg.trainer.versions})")
        if not self.resume:
            self._request_eval("start")
            self._start_checkpoint(v)
        self._write_progress()

    def _publish(self, v: int, row: dict) -> None:
        """Trainer 0 is sending weights v now: tell generators to take them."""
        self.core.version_trained(v)
        for g in self.layout.generator_ranks:
            self.mail.send(g, Tag.NEW_VERSION, {"version": v})
        self.rows.setdefault(v, {}).update(row)
        self._expect(v, {"sync"} | {f"weights{g}" for g in self.layout.generator_ranks})

    def _on_train_done(self, src: int, body: dict) -> None:
        self.train_done[src] = body
        if src == self.layout.trainer0:
            v = body["version"]
            self._publish(v, {})
            every = self.cfg.logging.eval_every
            if every and v % every == 0:
                self._request_eval(f"v{v}")
                self._expect(v, {"eval"})
        if len(self.train_done) < self.layout.n_trainers:
            return
        parts = list(self.train_done.values())
        v = parts[0]["version"]
        self.train_done = {}
        self.batch = None
        self.rows.setdefault(v, {}).update(self._train_row(parts))
        self._row_got(v, "train")
        ck = self.cfg.trainer.checkpoint_every
        if ck and v % ck == 0:
            self._start_checkpoint(v)
        if v >= self.cfg.trainer.versions:
            self._begin_stop(f"trained {v} versions")
        self._write_progress()

    def _train_row(self, parts: list[dict]) -> dict:
        s = [p["stats"] for p in parts]
        n = sum(x["samples"] for x in s)
        tokens = sum(x["tokens"] for x in s)
        self.tokens_consumed += tokens
        self.samples_consumed += n
        elapsed = time.time() - (self.t_rl or self.t0)
        w = sum(x.get("loss_tokens", 0) for x in s) or 1
        row = {
            "wall_s": time.time() - self.t0,
            "reward_mean": sum(x["reward_sum"] for x in s) / max(n, 1),
            "samples": n,
            "tokens": tokens,
            "gen_tokens": sum(x["gen_tokens"] for x in s),
            "staleness_mean": sum(x["staleness_sum"] for x in s) / max(n, 1),
            "staleness_max": max(x["staleness_max"] for x in s),
            "interrupted": sum(x["interrupted"] for x in s),
            "groups_kept": sum(x["groups_kept"] for x in s),
            "dropped_stale": self.core.dropped_stale,
            "rejected_uniform": self.core.rejected,
            "t_train": max(x["t_train"] for x in s),
            "loss": sum(x.get("loss", 0.0) for x in s),
            "grad_norm": s[0].get("grad_norm", math.nan),
            "consumed_tokens_per_s": self.tokens_consumed / max(elapsed, 1e-9),
            "gen_tokens_per_s": self.tokens_generated / max(elapsed, 1e-9),
        }
        for k in ("clip_frac", "ratio_mean", "behav_w_mean", "capped_frac"):
            row[k] = sum(x.get(k, 0.0) * x.get("loss_tokens", 0) for x in s) / w
        return row

    def _request_eval(self, tag: str) -> None:
        if self.cfg.logging.eval_prompts and self.layout.n_generators:
            self.eval_waiting.add(tag)
            self.mail.send(self.layout.generator_ranks[0], Tag.EVAL, {"tag": tag})

    # -- checkpoints ----------------------------------------------------------------------------
    def _start_checkpoint(self, v: int) -> None:
        if self.last_ckpt == v or self.ckpt_pending is not None:
            return
        self.ckpt_pending, self.ckpt_acks = v, 0
        for t in self.layout.trainer_ranks:
            self.mail.send(t, Tag.CHECKPOINT, {"version": v})

    def _finish_checkpoint(self) -> None:
        v = self.ckpt_pending
        state = {
            "version": v,
            "core": self.core.state_dict(),
            "next_group_id": self.next_group_id,
            "dropped_on_resume": self.dropped_on_resume,
            "tokens_consumed": self.tokens_consumed,
            "samples_consumed": self.samples_consumed,
            "evals": self.evals,
        }
        save_scheduler_state(self.run_dir, v, state)
        self.last_ckpt, self.ckpt_pending = v, None
        log.info("checkpoint v%d complete", v)

    # -- granting and batches -------------------------------------------------------------------
    def _grant(self) -> None:
        if self.stopping or self.t_rl is None:
            return
        room = self.core.gate.capacity()
        if room <= 0:
            return
        for g, k in fair_shares(self.want, room).items():  # by free capacity when there is not enough for all
            idx = self.core.grant(k)
            if not idx:
                continue
            prompts = [(i, self.next_group_id + j) for j, i in enumerate(idx)]
            self.next_group_id += len(idx)
            self.want[g] -= len(idx)
            self.mail.send(g, Tag.GRANT, {"prompts": prompts})

    def _dispatch(self) -> None:
        if self.batch is not None or self.ckpt_pending is not None or self.stopping or self.t_rl is None:
            return
        plan = self.core.next_batch()
        if plan is None:
            return
        self.ledger.record(plan.version, plan.entries())  # durable before any trainer sees the batch
        self.batch = plan
        for t, share in zip(self.layout.trainer_ranks, plan.shares):
            body = {"version": plan.version,
                    "share": [[(plan.groups[i].shard, plan.groups[i].indices) for i in mb] for mb in share]}
            self.mail.send(t, Tag.BATCH, body)

    # -- stopping -------------------------------------------------------------------------------
    def _begin_stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopping, self.stop_reason = True, reason
            log.info("stopping: %s", reason)

    def _check_stop(self) -> None:
        if self.stopping:
            return
        now = time.time()
        stop_file = False
        if now - self._stop_file_checked >= 0.25:  # a stat per loop would cost rank 0 a few % of a core
            self._stop_file_checked = now
            stop_file = (self.run_dir / STOP_FILE).exists()
        if self.stop_flag() or stop_file:
            self._begin_stop("stop requested")
        elif self.t_rl and self.cfg.trainer.max_wall_s and time.time() - self.t_rl >= self.cfg.trainer.max_wall_s:
            self._begin_stop(f"wall-time limit of {self.cfg.trainer.max_wall_s:g} s")

    def _pump(self) -> bool:
        """Handle every waiting message; True if there was any."""
        got = False
        while (msg := self.mail.poll()) is not None:
            self._handle(*msg)
            got = True
        return got

    def _write_progress(self, state: str = "running") -> None:
        elapsed = time.time() - (self.t_rl or self.t0)
        last = self.metrics.rows[-1] if self.metrics and self.metrics.rows else {}
        doc = {
            "state": state, "version": self.core.version, "versions": self.cfg.trainer.versions,
            "start_version": self.start_version,
            "reward_mean": last.get("reward_mean"), "heldout_acc": self.evals.get(self._last_eval_tag()),
            "consumed_tokens_per_s": self.tokens_consumed / max(elapsed, 1e-9),
            "elapsed_s": time.time() - self.t0, "dropped_stale": self.core.dropped_stale,
            "rejected_uniform": self.core.rejected, "time": time.time(),
        }
        atomic_write_text(self.run_dir / "progress.json", json.dumps(doc))

    def _last_eval_tag(self) -> str | None:
        if "final" in self.evals:
            return "final"
        tags = [t for t in self.evals if t.startswith("v")]
        if tags:
            return max(tags, key=lambda t: int(t[1:]))
        return "start" if "start" in self.evals else None

    def run(self) -> dict:
        self.start_version = self._restore() if self.resume else 0
        if self.resume:
            self.last_ckpt = self.start_version  # never rewrite the checkpoint we resumed from
        self.core.version_trained(self.start_version)
        self.metrics = MetricsLogger(self.run_dir, self.cfg.logging.tensorboard,
                                     keep_upto=self.start_version if self.resume else None)
        mail = self.mail
        while True:
            busy = self._pump()
            self._grant()
            self._dispatch()
            self._check_stop()
            if self.stopping and self.batch is None and not self.train_done:
                if self.ckpt_pending is None and self.last_ckpt != self.core.version:
                    self._start_checkpoint(self.core.version)
                if self.ckpt_pending is None and self.last_ckpt == self.core.version:
                    break
            if not busy:
                time.sleep(mail.idle_sleep_s)
        # final evaluation at the last weights, then drain: STOP to all, keep receiving until every BYE
        self._request_eval("final")
        for r in range(1, self.layout.world_size):
            mail.send(r, Tag.STOP)
        while self.byes < self.layout.world_size - 1:
            if not self._pump():
                time.sleep(mail.idle_sleep_s)
        mail.flush()
        self._flush_rows(force=True)
        self.metrics.close()
        summary = self._summary()
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        self._write_progress("finished")
        self.timeline.close()
        return summary

    def _summary(self) -> dict:
        rl = time.time() - (self.t_rl or self.t0)
        return {
            "versions": self.core.version,
            "start_version": self.start_version,
            "stop_reason": self.stop_reason,
            "acc_init": self.evals.get("init"),
            "acc_start": self.evals.get("start"),
            "acc_final": self.evals.get("final"),
            "wall_s": time.time() - self.t0,
            "rl_wall_s": rl,
            "tokens_consumed": self.tokens_consumed,
            "samples_consumed": self.samples_consumed,
            "consumed_tokens_per_s": self.tokens_consumed / max(rl, 1e-9),
            "dropped_stale": self.core.dropped_stale,
            "rejected_uniform": self.core.rejected,
            "dropped_on_resume": self.dropped_on_resume,
            "sync_gbps_mean": sum(self.sync_gbps) / len(self.sync_gbps) if self.sync_gbps else None,
            "raw_broadcast_gbps": None if math.isnan(self.raw_gbps) else self.raw_gbps,
            "eta": self.cfg.rollout.eta,
            "interrupt": self.cfg.rollout.interrupt,
            "aborted_requests": self.aborted_requests,
        }
