"""A generator rank: runs the episodes of granted groups on its engine, writes them as shards, loads weights."""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_hpc.config import Config, concurrent_groups
from areal_hpc.data import load_run_dataset
from areal_hpc.evaluation.heldout import HeldoutEvals
from areal_hpc.model import load_tokenizer
from areal_hpc.model.weights import weights_checksum
from areal_hpc.reward import reward_pool_for
from areal_hpc.runtime.build import build_generation_engine
from areal_hpc.runtime.comm.layout import Layout
from areal_hpc.runtime.comm.protocol import Tag
from areal_hpc.runtime.comm.role_loop import Handler, RoleLoop
from areal_hpc.runtime.comm.timeline import EngineMeter, Timeline
from areal_hpc.runtime.comm.weight_sync import sync_limit_s
from areal_hpc.runtime.failures import FAULT_ENV
from areal_hpc.runtime.generation.generator_core import Admission, GeneratorCore, GroupBook, ShardBuffer
from areal_hpc.runtime.generation.weight_intake import WeightIntake
from areal_hpc.store import next_seq, write_shard
from areal_hpc.types import EvalId, GenRequest, SampleId
from areal_hpc.workflow import EpisodeRunner, FinishedEpisode, load_workflow, runner_settings

log = logging.getLogger("areal_hpc.generator")


@dataclass
class _Spans:
    """The generator's own timeline spans: runs of engine steps ("generate"), the idle time between them, and
    each step's fill (EngineMeter)."""

    timeline: Timeline
    meter: EngineMeter
    gen_since: float | None = None  # start of the current run of engine steps
    idle_since: float = 0.0

    def step_starts(self) -> None:
        if self.gen_since is None:
            self.gen_since = time.time()
            if self.gen_since - self.idle_since > 1e-3:
                self.timeline.add("idle", self.idle_since, self.gen_since)

    def end_generate(self) -> None:
        """Close the run of engine steps, before work that is not generation (sync, load, write) is logged."""
        if self.gen_since is not None:
            now = time.time()
            self.timeline.add("generate", self.gen_since, now)
            self.gen_since, self.idle_since = None, now


class Generator(RoleLoop):
    """Streams groups through a step-driven engine on this rank's main thread, which polls MPI between steps
    (at most every `busy_poll_s` while the engine is busy). It asks rank 0 for prompts whenever the engine has
    a free slot, up to `rollout.max_concurrent_groups` groups in the engine; a group is n episodes of the
    workflow, whose requests join at the next step; a finished group is written as a shard and announced. New
    weights are received at once and loaded as `rollout.weight_update` says (docs/architecture.md). A held-out
    evaluation runs as greedy episodes in the same stream, so it never holds up a weight load or the trainers.

    What to ask for, which group an episode completes and when a shard is due is GeneratorCore's (pure, in
    runtime/generation/generator_core.py); this class is the loop around it, the weight loads and the timeline's spans.
    """

    role = "generator"
    listen_to = 0
    # An Iprobe runs Open MPI's progress engine: polling before every 4 ms step of the tiny CPU model put
    # 4% of the vLLM generator's py-spy samples in it. 10 ms delays a grant by under 3 steps.
    busy_poll_s = 0.01

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        comm,
        layout: Layout,
        sync_group,
        model_dir: Path,
        resume: bool,
        reward_cores: frozenset[int] | None = None,
    ):
        super().__init__(cfg, run_dir, comm, layout, resume)
        # first: data.kind=code refuses here, in one line, if reward.sandbox cannot run (before minutes of engine load)
        self.pool = reward_pool_for(cfg, cpus=reward_cores)
        self.engine = build_generation_engine(cfg, model_dir, seed=cfg.trainer.seed + 1000 * self.rank)
        tokenizer = load_tokenizer(model_dir)
        self.runner = EpisodeRunner(
            load_workflow(cfg.workflow.fn),
            tokenizer,
            self.pool,
            self._submit,
            runner_settings(cfg, tokenizer, model_dir),
            withdraw=self._leave_engine,  # an agent's call cancelled mid-flight holds no slot
        )
        dataset = load_run_dataset(cfg, tokenizer)
        self.train_problems = dataset.train
        self.weights = WeightIntake.open(cfg, self.engine, self.run_dir, model_dir, sync_group)
        # the chaos suite's hook: AREAL_HPC_FAULT="stall-update@V" stalls a vLLM worker inside the update of version V,
        # in the run's first world only (a restarted world resumes, and must get past it)
        fault = os.environ.get(FAULT_ENV, "")
        stall = fault.startswith("stall-update@") and not resume and self.index == 0
        self.fault_stall_version = int(fault.split("@")[1]) if stall else None
        meter = EngineMeter(self.run_dir, self.rank, self.engine.capacity)
        self.spans = _Spans(self.timeline, meter, idle_since=time.time())
        rc, st = cfg.rollout, cfg.store
        self.core = GeneratorCore(
            Admission(rc.n_samples, self.engine.capacity, concurrent_groups(rc)),
            GroupBook(rc.n_samples, self.rank),
            ShardBuffer(st.shard_max_groups, st.shard_max_wait_s, next_seq(self.run_dir.rollouts, self.rank)),
        )
        logging_cfg = cfg.logging
        self.evals = HeldoutEvals(
            dataset.heldout[: logging_cfg.eval_prompts],
            self.runner,
            logging_cfg.eval_n_samples,
            logging_cfg.eval_temperature == 0,  # else avg@k at the engine's temperature
            lambda body: self.mail.send(0, Tag.EVAL_RESULT, body),
            lambda t0, t1: self.timeline.add("eval", t0, t1),
            logging_cfg.eval_threshold,
        )
        self.evals.bound(
            logging_cfg.eval_timeout_s, self._drop, lambda body: self.mail.send(0, Tag.EVAL_PROGRESS, body)
        )
        # start-up's objects live as long as the rank: frozen, full collections skip them (their 200-400 ms pauses
        # stalled every request in flight: an agent endpoint's p99 latency, benchmarks/agent_endpoint.py)
        gc.freeze()

    # -- weights --------------------------------------------------------------------------------
    def _receive(self, version: int) -> None:
        w = self.weights
        if w.direct:  # vLLM's workers receive at the load itself
            if (skipped := w.stage_direct(version, self.cfg.sync.method)) is not None:
                self._weights_ok(skipped, None, None)
            return
        self.spans.end_generate()
        crc = None
        if w.staged is not None:
            # computed before the receive overwrites the shared buffers
            crc = weights_checksum(w.staged[1]) if self.cfg.sync.checksum else None
        self.mail.flush()  # pending messages leave before this rank blocks outside MPI
        with self.timeline.span("sync"):
            try:
                sd = w.receiver.receive(version)
            except FileNotFoundError:
                # disk path: pruned because newer versions exist, whose NEW_VERSION messages follow
                self._weights_ok(version, None, None)
                return
        if w.staged is not None:  # never loaded: a newer version is here first
            self._weights_ok(w.staged[0], crc, None)
        w.staged = (version, sd)

    def _weights_ok(self, version: int, checksum: int | None, load_s: float | None) -> None:
        """Tell rank 0 weights `version` arrived: loaded in load_s seconds, or (None) skipped for newer ones;
        with the tokens the engine prefilled since its last load."""
        w, e = self.weights, self.engine
        prefilled, w.prefilled = e.prefill_tokens - w.prefilled, e.prefill_tokens
        shared, w.prefill_shared = e.prefill_shared_tokens - w.prefill_shared, e.prefill_shared_tokens
        body = {"version": version, "checksum": checksum, "load_s": load_s, "skipped": load_s is None}
        self.mail.send(0, Tag.WEIGHTS_OK, body | {"prefill_tokens": prefilled, "prefill_shared": shared})

    def _admitting(self) -> bool:
        """New requests may join the engine now (with drain, not while a weight load waits)."""
        return self.cfg.rollout.weight_update != "drain" or self.weights.staged is None

    def _load_staged(self) -> None:
        """Load received weights as soon as the engine allows: at once (keep_kv: between two steps, the running
        requests go on; recompute: they are interrupted and resumed), or with drain once they are done."""
        w = self.weights
        if w.staged is None or self.evals.measuring_init:
            return
        mode = self.cfg.rollout.weight_update
        if mode == "drain" and (self.engine.num_running or self.engine.num_waiting):
            return
        if w.direct and self.cfg.sync.method == "broadcast" and not w.posted(w.staged[0]):
            return  # trainer 0 posts it once the previous version reached every generator
        partials = self.engine.interrupt() if mode == "recompute" else []
        w.interrupted += sum(1 for o in partials if o.output_ids)  # queued ones had not started
        self.spans.end_generate()
        (version, sd), w.staged = w.staged, None
        t0 = time.time()
        with self.timeline.span("load"):
            self.engine.pause()
            published = sd  # the adapter, with LoRA: its checksum is compared with trainer 0's
            if w.direct:
                loaded = self._load_direct(version, keep_kv=mode == "keep_kv")
            else:
                if w.adapters is not None:
                    sd = w.adapters.merged(self.engine, published)
                self.engine.update_weights(sd, version, keep_kv=mode == "keep_kv")
                loaded = True
            self.engine.resume()
        load_s = time.time() - t0
        # resumed as prompt + partial: their next tokens carry the new version
        self.engine.add([o.request.resumed(o) for o in partials] + self.core.release())
        if not loaded:  # its file was pruned: newer versions are announced
            self._weights_ok(version, None, None)
            return
        crc = None
        if self.cfg.sync.checksum:
            # what arrived, where the engine holds something else: the merged adapter, or rounded weights
            rounded = w.adapters is not None or self.cfg.rollout.weight_bits
            crc = weights_checksum(published) if rounded and not w.direct else self.engine.weights_checksum()
        w.loaded = True
        self._weights_ok(version, crc, load_s)

    def _load_direct(self, version: int, keep_kv: bool) -> bool:
        """The engine receives `version` itself, through vLLM's weight-transfer API: over trainer 0's group (the next
        version sent) or from the published file. False when that file is gone (pruned: newer ones exist)."""
        w, sc = self.weights, self.cfg.sync
        update = {"rank": self.rank, "checksum": sc.checksum}
        if sc.method == "broadcast":
            w.queued.pop(0)
            if w.queued:
                w.staged = (w.queued[0], {})
            update |= w.wire | {"limit_s": sync_limit_s(sc.limit_s, w.nbytes, first=not w.loaded)}
            if self.fault_stall_version == version:
                update["stall_s"] = 3600.0  # the chaos suite's stalled update: trainer 0's send limit must end it
            w.receiving(version)
        else:
            path = self.run_dir.weights_file(version)
            if not path.exists():
                return False
            update["path"] = str(path)
        self.engine.load(update, version, keep_kv=keep_kv)
        return True

    # -- prompts in, groups out -----------------------------------------------------------------
    def _ask(self) -> None:
        """Ask rank 0 for as many prompts as GeneratorCore.want says (none before the first weights)."""
        ready = self.weights.loaded and self._admitting()
        if k := self.core.want(self.engine.num_running + self.engine.num_waiting, ready):
            self.mail.send(0, Tag.WANT, {"k": k})

    def _grant(self, prompts: list) -> None:
        """n episodes per granted prompt; their first requests reach the engine at the next poll."""
        for key, p in self.core.grant([(gid, self.train_problems[idx]) for idx, gid in prompts], time.time()):
            self.runner.start(key, p.row, p.prompt_ids)

    def _submit(self, reqs: list[GenRequest]) -> None:
        """Into the engine now, or held back while admission waits for a weight load."""
        if now := self.core.submit(reqs, self._admitting()):
            self.engine.add(now)

    def _step(self) -> None:
        self.spans.step_starts()
        t0, c0 = time.time(), time.thread_time()
        outs = self.engine.step()
        t1 = time.time()
        running = min(self.engine.capacity, self.engine.num_running + len(outs))
        self.spans.meter.step(t0, t1, running, time.thread_time() - c0)
        for o in outs:
            self.core.returned(o.request_id)
            self.runner.deliver(o)

    def _poll_episodes(self) -> bool:
        """Run the episodes that can go on (their next requests reach the engine); file the ones that ended."""
        done = self.runner.poll(engine_idle=not (self.engine.num_running or self.engine.num_waiting))
        for ep in done:
            if isinstance(ep.key, EvalId):
                self.evals.episode_done(ep.key.index, ep)
            else:
                self._episode_done(ep.key, ep)
        return bool(done)

    def _episode_done(self, key: SampleId, ep: FinishedEpisode) -> None:
        book = self.core.book
        if ep.reward is None:  # rejected, or failed: the same sample runs again
            if (p := book.rejected(key, ep)) is not None:
                self.runner.start(key, p.row, p.prompt_ids)
        elif (ended := book.ended(key, ep)) is not None:
            spans, records = ended
            for span in spans:
                self.timeline.add(*span)
            self.core.shards.add(records, time.time())

    def _write_scored(self) -> None:
        """One shard of the scored groups when GeneratorCore.flush says one is due."""
        if (shard := self.core.flush(time.time())) is None:
            return
        trajs, episodes, summaries, seq = shard
        self.spans.end_generate()
        with self.timeline.span("write"):
            path = write_shard(
                self.run_dir.rollouts,
                trajs,
                gen_rank=self.rank,
                seq=seq,
                run_id=self.cfg.run_name,
                compression=self.cfg.store.compression,
                episodes=episodes,
            )
        self.mail.send(0, Tag.GROUPS_DONE, {"shard": path.name, "groups": summaries})

    # -- the loop -------------------------------------------------------------------------------
    def handlers(self) -> dict[Tag, Handler]:
        return {
            Tag.GRANT: lambda src, body: self._grant(body["prompts"]),
            Tag.NEW_VERSION: lambda src, body: self._receive(body["version"]),
            Tag.EVAL: lambda src, body: self.evals.asked.append(body["tag"]),
            Tag.STOP: self._on_stop,
        }

    def _on_stop(self, src: int, body: dict) -> None:
        """Groups still generating are dropped (a resume grants their prompts again); groups already scored
        are written; evaluations run as HeldoutEvals.stop says (on a stop request only the final, bounded)."""
        self.evals.stop(body["stop_eval_s"])
        self._drop([k for k in self.runner.tasks if not isinstance(k, EvalId)])
        self.core.stop()

    def _drop(self, keys: list) -> None:
        """Cancel these episodes: their requests leave the engine and what is held for it."""
        self._leave_engine(self.runner.cancel(keys))

    def _leave_engine(self, request_ids: list) -> None:
        """These requests leave the engine and what is held for it (their episodes, or their calls, were cancelled)."""
        self.engine.interrupt(request_ids)
        self.core.left(request_ids)

    def tick(self) -> bool:
        """Load weights if due, one engine step, then everything around it that does not wait."""
        self._load_staged()
        self.evals.start_next(self.engine.version)
        busy = self._poll_episodes()  # granted episodes put their first requests in before the step
        if self.engine.num_running or self.engine.num_waiting:
            self._step()
            busy = True
        else:
            self.spans.end_generate()
        busy = self._poll_episodes() or busy
        self.evals.tick(time.time())  # right after a poll: no finished episode of an evaluation it cuts waits
        self._write_scored()
        self._ask()
        return busy

    def finished(self) -> bool:
        return self.core.done and not self.evals.busy

    def run(self) -> None:
        torch.set_num_threads(self.cfg.cluster.threads_per_rank)
        if self.index == 0 and not self.resume and self.cfg.logging.eval_prompts:
            self.evals.asked.append("init")  # the model folder as it is, before any training
        self.loop()
        self.spans.end_generate()
        e = self.engine
        body = {"versions_checked": e.versions_checked, "versions_mismatched": e.versions_mismatched}
        self.mail.send(0, Tag.BYE, {"interrupted": self.weights.interrupted} | body)
        self.mail.flush()

    def close(self) -> None:
        try:
            self.engine.interrupt()  # on an error path requests may still be in the engine
            self.engine.close()
        finally:
            self.runner.close()
            self.pool.close(finish_queued=False)  # no episode waits for it: a slow reward must not hold the exit
        self.spans.meter.close()
        self.timeline.close()
