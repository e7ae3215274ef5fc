"""Rank 0's account of the run: its totals, progress.json and summary.json, and metrics.csv's rows (version_rows.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import time

from areal_hpc.config import Config
from areal_hpc.episode_counts import episode_metrics
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.comm.layout import Layout
from areal_hpc.runtime.rank0.scheduler_core import SchedulerCore
from areal_hpc.runtime.reporting.generated import GeneratedEpisodes
from areal_hpc.runtime.reporting.learning_signal import WARNING, UniformGroups
from areal_hpc.runtime.reporting.metrics import MetricsLogger
from areal_hpc.runtime.reporting.throughput import Throughput
from areal_hpc.runtime.reporting.version_rows import VersionRows, eval_columns, sync_columns, trainers_columns
from areal_hpc.utils import atomic_write_text

log = logging.getLogger("areal_hpc.scheduler")


class RunReport:
    """Collects what the ranks report and writes metrics.csv (with TensorBoard), progress.json and summary.json.

    The fields are the run's totals; the Scheduler changes them only through the methods below. A version's
    row is assembled apart (VersionRows) and written once every part it waits for is in.
    """

    def __init__(self, cfg: Config, run_dir: RunDir, layout: Layout, core: SchedulerCore):
        self.cfg, self.run_dir, self.layout, self.core = cfg, run_dir, layout, core
        self.metrics: MetricsLogger | None = None
        self.start_version = 0
        self.resumed = False
        self.t0 = time.time()
        self.t_rl: float | None = None  # when the starting weights were published
        self.tokens_consumed = 0  # the whole run's, from the checkpoint on a resume
        self.throughput = Throughput()  # tokens over running time, this start's and the run's, on the same span
        self.samples_consumed = 0
        self.tokens_generated = 0
        self.aborted_requests = 0  # requests generators interrupted for new weights (and resumed)
        # output tokens whose version the engine reported itself (vLLM's weight_versions), and those that differed
        self.engine_versions = [0, 0]
        self.prefill_tokens = 0  # tokens the generators' engines prefilled, resumed requests' second prefill included
        # version -> [prefilled, served from a prefix cache or a group's shared prefill] over its loads so far
        self.prefill_by_version: dict[int, list[int]] = {}
        self.dropped_on_resume = 0
        self.warning: str | None = None  # shown by `areal-hpc status` (progress.json) and logged once
        # groups whose samples all scored alike, by value: when a run cannot learn (the scheduler decides)
        self.uniform = UniformGroups.for_run(cfg.rollout.batch_prompts, cfg.trainer.max_uniform_batches)
        self.failure: str | None = None  # why a run that ended cleanly failed (one line; a non-zero exit)
        self.quarantined: list[str] = []  # corrupt shards this launch's resume moved out of the store
        self.raw_gbps = math.nan
        self.sync_gbps: list[float] = []
        self.sync_s: list[float] = []  # trainer 0's send of each version
        self.load_s: list[float] = []  # each generator's load of each version
        self.sync_bytes = 0
        self.evals: dict[str, float] = {}  # evaluation tag -> held-out accuracy (reward >= logging.eval_threshold)
        self.eval_rewards: dict[str, float] = {}  # evaluation tag -> held-out mean reward
        self.eval_versions: dict[str, int] = {}  # evaluation tag -> the weights version it measured
        # reward calls of held-out evaluations that timed out, raised; their episodes whose agent or workflow failed
        self.heldout_failures = [0, 0, 0]
        self.generated = GeneratedEpisodes()  # every training episode's counts, from GROUPS_DONE
        self.eval_tool_share: dict[str, float] = {}  # evaluation tag -> share of its episodes that called a tool
        self.eval_cut: dict[str, int] = {}  # evaluation tag -> episodes cut unfinished (eval_timeout_s, a stop)
        self.eval_running: dict | None = None  # the running evaluation's last EVAL_PROGRESS (the progress bar shows it)
        self.rows = VersionRows(layout.n_generators)

    def open(self, start_version: int, resumed: bool, state: dict | None = None) -> None:
        """Start writing; a resumed run continues the checkpoint's counters and keeps its earlier rows."""
        self.start_version, self.resumed = start_version, resumed
        if state is not None:
            self.tokens_consumed = state.get("tokens_consumed", 0)
            self.samples_consumed = state.get("samples_consumed", 0)
            self.throughput = Throughput(state.get("throughput"))  # absent in checkpoints of older runs
            self._restore_evals(start_version, state)
            self.dropped_on_resume = state.get("dropped_on_resume", 0)
            self.uniform.load(state.get("uniform_groups", {}))
            self.generated = GeneratedEpisodes(state.get("generated"))
        self.metrics = MetricsLogger(
            self.run_dir, self.cfg.logging.trackers, keep_upto=start_version if resumed else None, config=self.cfg
        )
        if resumed:
            self._adopt_final_eval(start_version)
        if resumed and state is not None:
            # rows the checkpointed launch had not written yet (it died waiting for a weight load or an
            # evaluation): written now with the parts they have, so no trained version lacks its row
            have = {int(float(r["version"])) for r in self.metrics.rows}
            for v, row in sorted((int(k), r) for k, r in state.get("rows", {}).items()):
                if v not in have:
                    self.metrics.log(v, row)

    def state_dict(self, upto: int) -> dict:
        """What a checkpoint of version `upto` keeps of the report (the rest is per launch)."""
        return {
            "tokens_consumed": self.tokens_consumed,
            "samples_consumed": self.samples_consumed,
            "evals": self.evals,
            "eval_rewards": self.eval_rewards,
            "eval_versions": self.eval_versions,
            "throughput": self.throughput.state(upto, self.t_rl or self.t0),
            "dropped_on_resume": self.dropped_on_resume,
            "generated": self.generated.total,
            "uniform_groups": self.uniform.summary(),
            "rows": self.rows.trained_rows(upto),
        }

    def _restore_evals(self, n: int, state: dict) -> None:
        """The checkpoint's held-out figures, less those of weights past version n (an evaluation that ended
        while the checkpoint was being written): a resume shows the figures of the weights it has."""
        versions = dict(state.get("eval_versions", {}))  # absent in checkpoints of older runs
        for tag in state.get("evals", {}):
            if tag not in versions and tag.startswith("v"):
                versions[tag] = int(tag[1:])
        keep = [t for t in state.get("evals", {}) if versions.get(t, -1) <= n]
        self.evals = {t: state["evals"][t] for t in keep}
        self.eval_rewards = {t: v for t, v in state.get("eval_rewards", {}).items() if t in keep}
        self.eval_versions = {t: v for t, v in versions.items() if t in keep}

    def _adopt_final_eval(self, n: int) -> None:
        """The checkpoint's own held-out figure: the previous start's final evaluation, when it measured the
        weights of checkpoint n (a stop for the time limit checkpoints, then evaluates): kept as v<n>'s."""
        try:
            prev = json.loads(self.run_dir.summary.read_text())
        except (OSError, ValueError):
            return
        if prev.get("acc_final") is not None and prev.get("heldout_version_final") == n:
            self.evals.setdefault(f"v{n}", prev["acc_final"])
            self.eval_rewards.setdefault(f"v{n}", prev.get("heldout_reward_mean_final"))
            self.eval_versions.setdefault(f"v{n}", n)

    # -- what the Scheduler tells it ---------------------------------------------------------------
    def resumed_with(self, dropped: int, quarantined: list[str]) -> None:
        """A resume dropped these stored groups as stale and moved these corrupt shards out (one line each)."""
        self.dropped_on_resume += dropped
        self.quarantined += quarantined

    def rl_started(self, v: int, raw_gbps: float | None) -> None:
        """Trainer 0 published the starting weights v (READY): RL time starts now."""
        self.raw_gbps = math.nan if raw_gbps is None else raw_gbps
        self.got(v, "train")  # the starting weights: nothing trained, the row only waits for the sync
        self.t_rl = time.time()

    def rl_elapsed(self, now: float) -> float:
        """Seconds of RL time (trainer.max_wall_s counts these)."""
        return now - (self.t_rl or self.t0)

    def group_generated(self, group: dict) -> None:
        """A GROUPS_DONE group: its generated tokens and its episodes' counts, taken out of the entry."""
        self.tokens_generated += group.pop("gen_tokens")
        self.generated.add(group)

    def learning_signal(self, uniform: float | None, can_fail: bool) -> bool:
        """A group's common reward (None: its rewards differ). Groups that all score alike teach nothing: a long
        streak is a warning on the terminal; a longer one with no version trained makes the run fail with one
        line and a non-zero exit (trainer.max_uniform_batches), when `can_fail`. True then: the run must stop."""
        verdict = self.uniform.group(uniform)
        if self.cfg.distill.teacher and not self.cfg.ppo.drop_uniform_groups:
            return False  # every group trains on the teacher's per-token term: groups that score alike still teach
        if verdict == "stop" and can_fail:
            self.failure = self.uniform.stop_line(self.cfg.trainer.max_uniform_batches)
            log.error("%s", self.failure)
            return True
        if verdict in ("warn", "clear"):
            self.signal_warning(self.uniform.warning_line() if verdict == "warn" else None)
        return False

    def take_warning(self, line: str) -> bool:
        """progress.json's one warning becomes `line`, unless a warning other than no-learning-signal holds it
        (that one is logged anyway); True when it did."""
        if self.warning and not self.warning.startswith(WARNING):
            return False
        self.warning = line
        return True

    def rank_stopped(self, body: dict) -> None:
        """A rank's BYE: the requests it interrupted for new weights (and resumed), the tokens whose versions its
        engine reported and how many of those differed from the versions expected."""
        self.aborted_requests += body["interrupted"]
        self.engine_versions[0] += body["versions_checked"]
        self.engine_versions[1] += body["versions_mismatched"]

    # -- the parts of a row -----------------------------------------------------------------------
    def expect(self, v: int, parts: set) -> None:
        """The metrics row of version v waits for these parts (sync, weight acks, eval)."""
        self.rows.expect(v, parts)

    def got(self, v: int, part: str, values: dict | None = None) -> None:
        self.rows.part_arrived(v, part, values)
        self.flush_rows()

    def published(self, v: int, starting: bool = False) -> None:
        """Trainer 0 is sending weights v: the row waits for the sync and every generator's load."""
        self.rows.add(v, {"wall_s": time.time() - self.t0} if starting else {})
        self.expect(v, {"sync"} | {f"load{g}" for g in self.layout.generator_ranks})

    def sync_done(self, body: dict) -> None:
        row = sync_columns(body)
        self.sync_gbps.append(row["sync_gbps"])
        self.sync_s.append(body["sync_s"])
        self.sync_bytes = body["bytes"]
        self.got(body["version"], "sync", row)

    def weights_loaded(self, src: int, body: dict) -> None:
        g = self.layout.index(src)
        row = {f"prefill_tokens_gen{g}": body["prefill_tokens"]}
        self.prefill_tokens += body["prefill_tokens"]
        c = self.prefill_by_version.setdefault(body["version"], [0, 0])
        c[0], c[1] = c[0] + body["prefill_tokens"], c[1] + body["prefill_shared"]
        if sum(c):  # of the prompt tokens prefilled since the previous load, the share served rather than computed
            row["prefix_cache_hit_rate"] = c[1] / sum(c)
        if body["checksum"] is not None:
            row[f"checksum_gen{g}"] = body["checksum"]
        if body["skipped"]:  # a newer version arrived first; the checksum is of what was received
            row[f"skipped_gen{g}"] = 1
        else:
            row[f"load_s_gen{g}"] = body["load_s"]
            self.load_s.append(body["load_s"])
        self.got(body["version"], f"load{src}", row)

    def eval_progress(self, body: dict) -> None:
        """How far the running held-out evaluation got: into progress.json at once."""
        self.eval_running = body
        self.write_progress()

    def eval_result(self, body: dict) -> None:
        tag, acc = body["tag"], body["acc"]
        if self.eval_running is not None and self.eval_running["tag"] == tag:
            self.eval_running = None
            self.write_progress()
        if acc is not None and body["cut"]:  # never scored as wrong answers: counted, and left out of acc
            self.eval_cut[tag] = body["cut"]
            log.warning("held-out %s: %d episodes cut unfinished, left out of its figures", tag, body["cut"])
        if acc is not None:  # None: superseded by a later evaluation before it started
            self.evals[tag] = acc
            self.eval_rewards[tag] = body["reward_mean"]
            self.eval_versions[tag] = body["version"]
            self.eval_tool_share[tag] = body["tool_share"]
            # a held-out score of 0 from a hung or failing reward function must not pass for a wrong answer
            self.heldout_failures[0] += body["reward_timeouts"]
            self.heldout_failures[1] += body["reward_errors"]
            self.heldout_failures[2] += body["agent_failures"]
            log.info(
                "held-out %s (weights v%s): accuracy %.3f, mean reward %.3f",
                *(tag, body["version"], acc, body["reward_mean"]),
            )
        if tag.startswith("v"):
            self.got(int(tag[1:]), "eval", eval_columns(body))

    def trained(self, v: int, parts: list[dict]) -> None:
        """Every trainer's TRAIN_DONE of version v is in."""
        s = [p["stats"] for p in parts]
        cols = trainers_columns(s)
        self.tokens_consumed += cols["tokens"]
        self.samples_consumed += cols["samples"]
        now = time.time()
        self.throughput.trained(v, cols["tokens"], now)
        self.uniform.version_trained()
        elapsed = now - (self.t_rl or self.t0)
        row = {
            "wall_s": now - self.t0,
            **cols,
            "dropped_stale": self.core.dropped_stale,
            "rejected_uniform": self.core.rejected,
            "consumed_tokens_per_s": self.throughput.start_rate(now - elapsed, now),  # this start's tokens and time
            "gen_tokens_per_s": self.tokens_generated / max(elapsed, 1e-9),
        }
        # reward time-outs and errors, and the numbers episodes logged: over every episode generated since the
        # previous row (a group rejected as uniform because its reward failed counts too)
        self.got(v, "train", row | episode_metrics(s, cols["samples"]) | self.generated.row())

    def flush_rows(self, force: bool = False) -> None:
        """Write complete rows in version order (every row with `force`)."""
        for v, row in self.rows.take_complete(force):
            if self.resumed and v == self.start_version:
                continue  # the checkpoint's version republished: its row is already in metrics.csv
            self.metrics.log(v, row)

    # -- progress and summary ---------------------------------------------------------------------
    def last_eval_tag(self) -> str | None:
        if "final" in self.evals:
            return "final"
        tags = [t for t in self.evals if t.startswith("v")]
        if tags:
            return max(tags, key=lambda t: int(t[1:]))
        return "start" if "start" in self.evals else None

    def write_progress(self, state: str = "running") -> None:
        now = time.time()
        last = self.metrics.rows[-1] if self.metrics and self.metrics.rows else {}
        since, tag = self.t_rl or self.t0, self.last_eval_tag()
        doc = {
            "state": state,
            "version": self.core.version,
            "versions": self.cfg.trainer.versions,
            "start_version": self.start_version,
            "reward_mean": last.get("reward_mean"),
            "heldout_acc": self.evals.get(tag),
            "heldout_reward_mean": self.eval_rewards.get(tag),
            "heldout_version": self.eval_versions.get(tag),  # the weights version the held-out figures measured
            "consumed_tokens_per_s": self.throughput.start_rate(since, now),  # this start's tokens over its time
            "run_consumed_tokens_per_s": self.throughput.run_rate(since, now),  # every start's (gaps left out)
            "elapsed_s": now - self.t0,
            "dropped_stale": self.core.dropped_stale,
            "rejected_uniform": self.core.rejected,
            **self.generated.totals(),  # training episodes: the schema's "generated" counts (count_schema)
            "heldout_reward_timeouts": self.heldout_failures[0],
            "heldout_reward_errors": self.heldout_failures[1],
            "heldout_agent_failures": self.heldout_failures[2],
            "warning": self.warning,
            "eval": self.eval_running,  # {"tag", "done", "total", "reward_timeouts"} while an evaluation runs
            "time": now,
        }
        atomic_write_text(self.run_dir.progress, json.dumps(doc))

    def signal_warning(self, line: str | None) -> None:
        """A streak of groups without a learning signal began (its warning line) or ended (None): in the log,
        and progress.json's warning (the launcher prints it) unless another warning holds it."""
        if line is not None:
            log.warning("%s", line)
            if not self.warning:
                self.warning = line
                self.write_progress()
        elif self.warning and self.warning.startswith(WARNING):
            log.info("groups with a learning signal again")
            self.warning = None

    def finish(self, stop_reason: str) -> dict:
        """Every rank has said BYE: write the last rows, summary.json, then the final progress."""
        self.flush_rows(force=True)
        now = time.time()
        rl = now - (self.t_rl or self.t0)
        summary = {
            "versions": self.core.version,
            "start_version": self.start_version,
            "stop_reason": stop_reason,
            "acc_init": self.evals.get("init"),
            "acc_start": self.evals.get("start"),
            "acc_final": self.evals.get("final"),
            "heldout_version_final": self.eval_versions.get("final"),  # the weights version it measured
            # held-out episodes cut unfinished (logging.eval_timeout_s, a stop), in all evaluations and in the final
            "heldout_cut": sum(self.eval_cut.values()),
            "heldout_cut_final": self.eval_cut.get("final", 0),
            # the mean rewards of the same evaluations (acc_*: the share of episodes with reward >= eval_threshold)
            "heldout_reward_mean_init": self.eval_rewards.get("init"),
            "heldout_reward_mean_start": self.eval_rewards.get("start"),
            "heldout_reward_mean_final": self.eval_rewards.get("final"),
            "eval_threshold": self.cfg.logging.eval_threshold,
            "tool_share_start": self.eval_tool_share.get("start"),
            "tool_share_final": self.eval_tool_share.get("final"),
            "heldout_reward_timeouts": self.heldout_failures[0],
            "heldout_reward_errors": self.heldout_failures[1],
            "heldout_agent_failures": self.heldout_failures[2],
            **self.generated.summary(),  # training episodes: reward time-outs and errors, turns, tool calls
            "wall_s": now - self.t0,
            "t0": self.t0,  # epoch seconds of metrics.csv's wall_s = 0 (the timeline's times are epoch seconds)
            "rl_wall_s": rl,
            "tokens_consumed": self.tokens_consumed,
            "samples_consumed": self.samples_consumed,
            # consumed tokens/s over the whole run (every start's tokens over their running time, the gaps
            # between starts left out: gap_s), and this start's (start_*): docs/run-dir.md
            **self.throughput.summary(self.t_rl or self.t0, now),
            "dropped_stale": self.core.dropped_stale,
            "rejected_uniform": self.core.rejected,
            "uniform_groups": self.uniform.summary(),  # every group whose samples all scored alike, by that reward
            "failure": self.failure,
            "dropped_on_resume": self.dropped_on_resume,
            "quarantined_shards": self.quarantined,
            "sync_gbps_mean": sum(self.sync_gbps) / len(self.sync_gbps) if self.sync_gbps else None,
            "sync_s_mean": sum(self.sync_s) / len(self.sync_s) if self.sync_s else None,
            "load_s_mean": sum(self.load_s) / len(self.load_s) if self.load_s else None,
            "sync_bytes": self.sync_bytes,
            "raw_broadcast_gbps": None if math.isnan(self.raw_gbps) else self.raw_gbps,
            "eta": self.cfg.rollout.eta,
            "weight_update": self.cfg.rollout.weight_update,
            "prefill_tokens": self.prefill_tokens,
            "prefill_shared_tokens": sum(c[1] for c in self.prefill_by_version.values()),
            "aborted_requests": self.aborted_requests,
            "engine_versions_checked": self.engine_versions[0],
            "engine_versions_mismatched": self.engine_versions[1],
            # the cores rank 0 may run on (the job's share of the host): the simulator's calibration needs it
            "host_cpus": len(os.sched_getaffinity(0)),
        }
        atomic_write_text(self.run_dir.summary, json.dumps(summary, indent=1))
        self.metrics.close(summary)  # the summary to each tracker, which then ends its run
        self.write_progress("finished")
        return summary
