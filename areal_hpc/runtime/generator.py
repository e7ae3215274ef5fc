"""A generator rank: runs the episodes of granted groups on its engine, writes them as shards, loads weights."""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import torch

from areal_hpc.config import Config, concurrent_groups
from areal_hpc.data import load_run_dataset
from areal_hpc.model import load_tokenizer
from areal_hpc.reward import reward_pool_for
from areal_hpc.runtime.adapters import AdapterLoader
from areal_hpc.runtime.build import build_generation_engine, lora_spec
from areal_hpc.runtime.groups import Group, group_records, group_spans
from areal_hpc.runtime.heldout import HeldoutEvals
from areal_hpc.runtime.layout import Layout
from areal_hpc.runtime.protocol import Tag
from areal_hpc.runtime.role_loop import Handler, RoleLoop
from areal_hpc.runtime.timeline import EngineMeter
from areal_hpc.runtime.weight_sync import WeightReceiver, weights_checksum
from areal_hpc.store import next_seq, write_shard
from areal_hpc.types import EvalId, GenRequest, SampleId, Trajectory, parse_request_id
from areal_hpc.workflow import EpisodeRunner, FinishedEpisode, load_workflow, runner_settings
from areal_hpc.workflow.batch import MAX_REJECTED, rejected_too_often
from areal_hpc.workflow.runner import episode_of

log = logging.getLogger("areal_hpc.generator")


class Generator(RoleLoop):
    """Streams groups through a step-driven engine on this rank's main thread, which polls MPI between steps
    (at most every `busy_poll_s` while the engine is busy). It asks rank 0 for prompts whenever the engine has
    a free slot, up to `rollout.max_concurrent_groups` groups in the engine; a group is n episodes of the
    workflow, whose requests join at the next step; a finished group is written as a shard and announced. New
    weights are received at once and loaded as `rollout.weight_update` says (docs/architecture.md). A held-out
    evaluation runs as greedy episodes in the same stream, so it never holds up a weight load or the trainers.
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
        self.meter = EngineMeter(self.run_dir, self.rank, self.engine.capacity)
        self.tokenizer = load_tokenizer(model_dir)
        self.runner = EpisodeRunner(
            load_workflow(cfg.rollout.workflow),
            self.tokenizer,
            self.pool,
            self._submit,
            runner_settings(cfg, self.tokenizer, model_dir),
        )
        dataset = load_run_dataset(cfg, self.tokenizer)
        self.train, self.heldout = dataset.train, dataset.heldout[: cfg.logging.eval_prompts]
        sc = cfg.sync
        spec = lora_spec(cfg)  # with LoRA an adapter arrives each version, merged here into the base weights
        self.adapters = AdapterLoader(spec, self.run_dir, model_dir, cfg.model.dtype) if spec else None
        template = self.adapters.template() if self.adapters else self.engine.state_dict()
        self.receiver = WeightReceiver(sc.method, sync_group, self.run_dir, template, sc.bucket_mb, cfg.cluster.device)
        if sync_group is not None:  # paired with trainer 0's layout check and measurement at start-up
            sync_group.check_layout(self.receiver.plan.layout, cfg.cluster.device)
            sync_group.raw_bandwidth(self.receiver.plan.nbytes, cfg.cluster.device)
        self.rollout_dir = self.run_dir.rollouts
        self.seq = next_seq(self.rollout_dir, self.rank)
        self.max_groups = concurrent_groups(cfg.rollout)

        self.groups: dict[int, Group] = {}  # granted, some episode not ended
        self.engine_groups: dict[int, int] = {}  # group -> its requests in the engine or held for it
        self.requests: dict[str, GenRequest] = {}  # every request in the engine or held back, by id
        self.held: list[GenRequest] = []  # granted while admission is stopped for a weight load
        self.asked = 0  # prompts asked for and not granted yet
        self.staged: tuple[int, dict] | None = None  # received weights not loaded yet
        self.have_weights = False
        self.scored: list[tuple[list[Trajectory], dict]] = []  # scored groups waiting for a shard
        self.scored_since = 0.0
        lc = cfg.logging
        self.evals = HeldoutEvals(
            self.heldout,
            self.runner,
            lc.eval_n_samples,
            lc.eval_temperature == 0,  # else avg@k at the engine's temperature
            lambda body: self.mail.send(0, Tag.EVAL_RESULT, body),
            lambda t0, t1: self.timeline.add("eval", t0, t1),
            lc.eval_threshold,
        )
        self.evals.bound(lc.eval_timeout_s, self._drop, lambda body: self.mail.send(0, Tag.EVAL_PROGRESS, body))
        self.stopping = False
        self.interrupted = 0
        self.prefilled = 0  # engine.prefill_tokens at the last WEIGHTS_OK
        self.prefill_shared = 0  # engine.prefill_shared_tokens at the last WEIGHTS_OK
        self.gen_since: float | None = None  # start of the current run of engine steps (a "generate" span)
        self.idle_since = time.time()
        # start-up's objects live as long as the rank: frozen, full collections skip them (their 200-400 ms pauses
        # stalled every request in flight: an agent endpoint's p99 latency, benchmarks/agent_endpoint.py)
        gc.freeze()

    # -- the timeline ---------------------------------------------------------------------------
    def _end_generate_span(self) -> None:
        """Close the run of engine steps, before work that is not generation (sync, load, write) is logged."""
        if self.gen_since is not None:
            now = time.time()
            self.timeline.add("generate", self.gen_since, now)
            self.gen_since, self.idle_since = None, now

    # -- weights --------------------------------------------------------------------------------
    def _receive(self, version: int) -> None:
        self._end_generate_span()
        crc = None
        if self.staged is not None:
            # computed before the receive overwrites the shared buffers
            crc = weights_checksum(self.staged[1]) if self.cfg.sync.checksum else None
        self.mail.flush()  # pending messages leave before this rank blocks outside MPI
        with self.timeline.span("sync"):
            try:
                sd = self.receiver.receive(version)
            except FileNotFoundError:
                # disk path: pruned because newer versions exist, whose NEW_VERSION messages follow
                self._weights_ok(version, None, None)
                return
        if self.staged is not None:  # never loaded: a newer version is here first
            self._weights_ok(self.staged[0], crc, None)
        self.staged = (version, sd)

    def _weights_ok(self, version: int, checksum: int | None, load_s: float | None) -> None:
        """Tell rank 0 weights `version` arrived: loaded in load_s seconds, or (None) skipped for newer ones;
        with the tokens the engine prefilled since its last load."""
        prefilled, self.prefilled = self.engine.prefill_tokens - self.prefilled, self.engine.prefill_tokens
        shared, self.prefill_shared = (e := self.engine.prefill_shared_tokens) - self.prefill_shared, e
        body = {"version": version, "checksum": checksum, "load_s": load_s, "skipped": load_s is None}
        self.mail.send(0, Tag.WEIGHTS_OK, body | {"prefill_tokens": prefilled, "prefill_shared": shared})

    def _admitting(self) -> bool:
        """New requests may join the engine now (with drain, not while a weight load waits)."""
        return self.cfg.rollout.weight_update != "drain" or self.staged is None

    def _load_staged(self) -> None:
        """Load received weights as soon as the engine allows: at once (keep_kv: between two steps, the running
        requests go on; recompute: they are interrupted and resumed), or with drain once they are done."""
        if self.staged is None or self.evals.measuring_init:
            return
        mode = self.cfg.rollout.weight_update
        if mode == "drain" and (self.engine.num_running or self.engine.num_waiting):
            return
        partials = self.engine.interrupt() if mode == "recompute" else []
        self.interrupted += sum(1 for o in partials if o.output_ids)  # queued ones had not started
        self._end_generate_span()
        version, sd = self.staged
        self.staged = None
        t0 = time.time()
        with self.timeline.span("load"):
            self.engine.pause()
            published = sd  # the adapter, with LoRA: its checksum is compared with trainer 0's
            if self.adapters is not None:
                sd = self.adapters.merged(self.engine, published)
            self.engine.update_weights(sd, version, keep_kv=mode == "keep_kv")
            self.engine.resume()
        load_s = time.time() - t0
        # resumed as prompt + partial: their next tokens carry the new version
        self.engine.add([self.requests[o.request_id].resumed(o) for o in partials] + self.held)
        self.held = []
        # what arrived, where the engine holds something else: the merged adapter, or rounded weights
        held = published if (self.adapters is not None or self.cfg.rollout.weight_bits) else self.engine.state_dict()
        crc = weights_checksum(held) if self.cfg.sync.checksum else None
        self.have_weights = True
        self._weights_ok(version, crc, load_s)

    # -- prompts in, groups out -----------------------------------------------------------------
    def _ask(self) -> None:
        """Ask for as many groups as keep the engine full with one group queued beyond its slots, counting
        sequences (a group holds no slot for its finished samples); `max_groups` bounds what is in flight."""
        if not self.have_weights or self.stopping or not self._admitting():
            return
        n = self.cfg.rollout.n_samples
        load = self.engine.num_running + self.engine.num_waiting + len(self.held) + self.asked * n
        want = -(-(self.engine.capacity + n - load) // n)
        # groups with a request in the engine: one whose episodes wait only for rewards (or a tool) holds no slot
        k = min(want, self.max_groups - len(self.engine_groups) - self.asked)
        if k > 0:
            self.mail.send(0, Tag.WANT, {"k": k})
            self.asked += k

    def _grant(self, prompts: list) -> None:
        """n episodes per granted prompt; their first requests reach the engine at the next poll."""
        self.asked -= len(prompts)
        now = time.time()
        for idx, gid in prompts:
            p = self.train[idx]
            self.groups[gid] = Group(p, now)
            for s in range(self.cfg.rollout.n_samples):
                self.runner.start(str(SampleId(gid, s)), p.row, p.prompt_ids)

    def _submit(self, reqs: list[GenRequest]) -> None:
        """Into the engine now, or held back while admission waits for a weight load."""
        self.requests.update((r.request_id, r) for r in reqs)
        for r in reqs:
            self._count_on_engine(r.request_id, +1)
        if self._admitting():
            self.engine.add(reqs)
        else:
            self.held += reqs

    def _step(self) -> None:
        if self.gen_since is None:
            self.gen_since = time.time()
            if self.gen_since - self.idle_since > 1e-3:
                self.timeline.add("idle", self.idle_since, self.gen_since)
        t0, c0 = time.time(), time.thread_time()
        outs = self.engine.step()
        t1 = time.time()
        running = min(self.engine.capacity, self.engine.num_running + len(outs))
        self.meter.step(t0, t1, running, time.thread_time() - c0)
        for o in outs:
            self.requests.pop(o.request_id)
            self._count_on_engine(o.request_id, -1)
            self.runner.deliver(o)

    def _count_on_engine(self, request_id: str, delta: int) -> None:
        """Requests in the engine (or held for it) per training group."""
        key = parse_request_id(episode_of(request_id))
        if isinstance(key, SampleId):
            n = self.engine_groups.get(key.group_id, 0) + delta
            if n:
                self.engine_groups[key.group_id] = n
            else:
                del self.engine_groups[key.group_id]

    def _poll_episodes(self) -> bool:
        """Run the episodes that can go on (their next requests reach the engine); file the ones that ended."""
        done = self.runner.poll(engine_idle=not (self.engine.num_running or self.engine.num_waiting))
        if self.runner.abandoned:  # an agent's call cancelled mid-flight holds no slot
            self._leave_engine(self.runner.take_abandoned())
        for ep in done:
            key = parse_request_id(ep.key)
            if isinstance(key, EvalId):
                self.evals.episode_done(key.index, ep)
            else:
                self._episode_done(key, ep)
        return bool(done)

    def _episode_done(self, key: SampleId, ep: FinishedEpisode) -> None:
        g = self.groups.get(key.group_id)
        if g is None:
            return  # its group was dropped by a stop
        if ep.reward is None:  # rejected: the same sample runs again
            g.rejected[key.sample] = g.rejected.get(key.sample, 0) + 1
            g.rejected_stats.append(ep.stats)
            if g.rejected[key.sample] >= MAX_REJECTED:
                raise rejected_too_often(f"prompt {g.problem.prompt_id}", MAX_REJECTED)
            self.runner.start(ep.key, g.problem.row, g.problem.prompt_ids)
            return
        g.episodes[key.sample] = ep
        if len(g.episodes) < self.cfg.rollout.n_samples:
            return
        del self.groups[key.group_id]
        episodes = [g.episodes[s] for s in range(self.cfg.rollout.n_samples)]
        for span in group_spans(g, episodes):
            self.timeline.add(*span)
        if not self.scored:
            self.scored_since = time.time()
        self.scored.append(group_records(g, key.group_id, episodes, self.rank))

    def _write_scored(self) -> None:
        """One shard for the scored groups once enough wait, the oldest has waited long enough, or nothing
        else of this generator is coming soon (waiting would only delay the trainers)."""
        if not self.scored:
            return
        st = self.cfg.store
        due = (
            len(self.scored) >= st.shard_max_groups
            or time.time() - self.scored_since >= st.shard_max_wait_s
            or not self.groups
            or self.stopping
        )
        if not due:
            return
        self._end_generate_span()
        trajs, summaries = [], []
        for group, summary in self.scored:
            summary["indices"] = list(range(len(trajs), len(trajs) + len(group)))
            trajs += group
            summaries.append(summary)
        self.scored = []
        with self.timeline.span("write"):
            shard = write_shard(
                self.rollout_dir,
                trajs,
                gen_rank=self.rank,
                seq=self.seq,
                run_id=self.cfg.run_name,
                compression=self.cfg.store.compression,
            )
        self.seq += 1
        self.mail.send(0, Tag.GROUPS_DONE, {"shard": shard.name, "groups": summaries})

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
        self.stopping = True
        self.evals.stop(body["stop_eval_s"])
        self._drop([k for k in self.runner.tasks if not isinstance(parse_request_id(k), EvalId)])
        self.groups.clear()
        self.engine_groups.clear()

    def _drop(self, keys: list[str]) -> None:
        """Cancel these episodes: their requests leave the engine and what is held for it."""
        self._leave_engine(self.runner.cancel(keys))

    def _leave_engine(self, request_ids: list[str]) -> None:
        """These requests leave the engine and what is held for it (their episodes, or their calls, were cancelled)."""
        gone = set(request_ids)
        self.engine.interrupt(list(gone))
        for rid in gone:
            if self.requests.pop(rid, None) is not None:
                self._count_on_engine(rid, -1)
        self.held = [r for r in self.held if r.request_id not in gone]

    def tick(self) -> bool:
        """Load weights if due, one engine step, then everything around it that does not wait."""
        busy = False
        self._load_staged()
        self.evals.start_next(self.engine.version)
        busy = self._poll_episodes()  # granted episodes put their first requests in before the step
        if self.engine.num_running or self.engine.num_waiting:
            self._step()
            busy = True
        else:
            self._end_generate_span()
        busy = self._poll_episodes() or busy
        self.evals.tick(time.time())  # right after a poll: no finished episode of an evaluation it cuts waits
        self._write_scored()
        self._ask()
        return busy

    def finished(self) -> bool:
        return self.stopping and not (self.evals.busy or self.scored)

    def run(self) -> None:
        torch.set_num_threads(self.cfg.cluster.threads_per_rank)
        if self.index == 0 and not self.resume and self.cfg.logging.eval_prompts:
            self.evals.asked.append("init")  # the model folder as it is, before any training
        self.loop()
        self._end_generate_span()
        self.mail.send(0, Tag.BYE, {"interrupted": self.interrupted})
        self.mail.flush()

    def close(self) -> None:
        try:
            self.engine.interrupt()  # on an error path requests may still be in the engine
            self.engine.close()
        finally:
            self.runner.close()
            self.pool.close(finish_queued=False)  # no episode waits for it: a slow reward must not hold the exit
        self.meter.close()
        self.timeline.close()
