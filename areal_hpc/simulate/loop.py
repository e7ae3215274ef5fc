"""A discrete-event model of the asynchronous loop (SimPy): generators, rank 0's own scheduler core, trainers.

Rank 0's bookkeeping is the real `SchedulerCore` (staleness gate, ready queue, dynamic sampling, batch
split); generators and trainers are modelled: a generator is a continuous-batching engine whose steps
take the cost model's time, a training version takes the cost model's time for the largest share.
"""

from __future__ import annotations

import collections
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import simpy

from areal_hpc.costmodel import CostModel, train_tokens
from areal_hpc.runtime.generation.admission import Admission
from areal_hpc.runtime.rank0.scheduler_core import ReadyGroup, SchedulerCore, fair_shares
from areal_hpc.simulate.result import SimResult


class Lengths(Protocol):
    def quantile(self, u: float) -> int: ...


TRAIN_SLICES = 8  # a training version is simulated in this many slices, for the cores' sharing to follow


@dataclass(frozen=True)
class SimConfig:
    """The loop's shape (the run config's numbers) and what the model needs beyond them."""

    n_generators: int
    n_trainers: int
    batch_prompts: int  # B
    n_samples: int  # n
    eta: int
    capacity: int  # sequences one generator's step holds (max_num_seqs)
    max_groups: int  # groups a generator keeps in flight
    weight_update: str  # keep_kv | recompute | drain (rollout.weight_update)
    versions: int
    cost: CostModel
    lengths: Lengths
    prompt_len: int = 64
    # trainer.share_prefixes, share_min_tokens, max_tokens_per_mb: a group's first shared_prefix_len tokens
    # (None: its whole prompt) computed once per micro-batch part, not per sample (costmodel.train_tokens)
    share_prefixes: bool = True
    share_min_tokens: int = 32
    shared_prefix_len: int | None = None
    max_tokens_per_mb: int = 4096
    p_uniform: float = 0.0  # chance a finished group's rewards are all equal
    reject_uniform: bool = True
    reward_s: float = 0.0  # a reward worker's time to score one group (off the generator's critical path)
    reward_workers: int = 1  # per generator; groups queue for them
    batch_latency_s: float = 0.0  # a batch the trainers wait for: its last shard written to their start on it
    ask_latency_s: float = 0.0  # a batch already waiting: trainer 0 free to its start on it (a request and reply)
    publish_latency_s: float = 0.0  # a trained version to the generators through rank 0
    publish_s: float = 0.0  # trainer 0's own time to post a version's weights (on the trainers' critical path)
    train_overhead_s: float = 0.0  # per version and trainer: loading the shards, optimizer step
    eval_every: int = 0
    eval_prompts: int = 0  # held-out requests on generator 0 at the start and every eval_every versions
    # roles sharing a host's cores (CPU runs; 0 on GPUs): how much longer a generator step takes while the
    # trainers train, and a training version while every generator steps (in proportion to those stepping)
    gen_slowdown: float = 0.0
    train_slowdown: float = 0.0
    seed: int = 0
    devices_per_generator: int = 1  # counted in the GPUs; `cost` is already a whole generator's (tensor_parallel)

    @property
    def gpus(self) -> int:
        """The run's GPUs: each generator's devices and one per trainer (rank 0, the scheduler, holds none)."""
        return self.n_generators * self.devices_per_generator + self.n_trainers

    def train_tokens(self, answers: list[int]) -> int:
        """Token positions the trainer computes for a group with these answer lengths."""
        p = self.prompt_len if self.shared_prefix_len is None else self.shared_prefix_len
        rest = [self.prompt_len - p + a for a in answers]
        return train_tokens(p, rest, self.share_prefixes, self.share_min_tokens, self.max_tokens_per_mb)


@dataclass
class _Seq:
    group: int  # -1: a held-out evaluation request
    target: int  # tokens it generates before it stops
    done: int = 0
    v_start: int | None = None
    needs_prefill: bool = True  # new, or resumed after an interruption: prompt + partial is processed again


@dataclass
class _Group:
    left: int
    v_start: int
    tokens: int = 0
    answers: list[int] = field(default_factory=list)


class _Generator:
    def __init__(self, sim: Simulation, index: int):
        self.sim, self.index = sim, index
        self.version = -1
        self.staged: int | None = None
        self.loading = False
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.groups: dict[int, _Group] = {}
        c = sim.cfg
        self.admission = Admission(c.n_samples, c.capacity, c.max_groups)  # the runtime generator's own rule
        self.busy_s = 0.0
        self.wake = sim.env.event()
        self.reward_pool = simpy.Resource(sim.env, capacity=sim.cfg.reward_workers)

    def notify(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    def admitting(self) -> bool:
        """Has weights and may take new work (with drain, not between a new version and its load)."""
        drain = self.sim.cfg.weight_update == "drain"
        return self.version >= 0 and (not drain or (self.staged is None and not self.loading))

    def _ask(self) -> None:
        """Ask rank 0 for groups as the runtime's generator does: enough to fill the slots with one group
        queued beyond them, up to max_groups in flight; what is not granted now stays asked for."""
        if not self.admitting():
            return
        if self.admission.ask(len(self.running) + len(self.waiting), len(self.groups)) > 0:
            self.sim.grant()

    def take(self, n: int) -> None:
        """`n` granted groups: their samples join the engine at the next step."""
        c, sim = self.sim.cfg, self.sim
        for _ in range(n):
            gid = sim.next_group
            sim.next_group += 1
            self.groups[gid] = _Group(c.n_samples, 1 << 30)
            self.waiting.extend(_Seq(gid, sim.draw_length()) for _ in range(c.n_samples))
        self.notify()

    def _load(self):
        c = self.sim.cfg
        # keep_kv: the running sequences stay and go on over their cache after the load (no prefill again)
        if c.weight_update == "recompute":
            for s in self.running:
                self.sim.interrupted += s.done > 0
                s.needs_prefill = True
            self.waiting.extendleft(reversed(self.running))
            self.running = []
        v, self.staged = self.staged, None
        self.loading = True
        yield self.sim.env.timeout(c.cost.sync_s)
        self.loading = False
        self.busy_s += c.cost.sync_s
        self.version = v
        self.sim.grant()  # what it asked for before the load (and was held back from) may go now

    def _step_times(self, k: int, prefill: int) -> np.ndarray:
        cost, b = self.sim.cfg.cost, len(self.running)
        ctx0 = sum(self.sim.cfg.prompt_len + s.done for s in self.running)
        t = cost.decode_step_s(b, ctx0 + b * np.arange(k))
        t[0] += cost.prefill_s(prefill)
        # the sharing when the chunk starts holds for all of it (chunks end at each finish)
        return t * (1.0 + self.sim.cfg.gen_slowdown * self.sim.training)

    def run(self):
        env, c = self.sim.env, self.sim.cfg
        while not self.sim.done:
            if self.staged is not None and (c.weight_update != "drain" or not (self.running or self.waiting)):
                yield from self._load()
            self._ask()
            prefill = 0
            # what is queued in the engine joins as slots free, even while a load waits for the engine to drain
            while self.waiting and len(self.running) < c.capacity:
                s = self.waiting.popleft()
                if s.needs_prefill:
                    prefill += c.prompt_len + s.done
                    self.sim.prefill_tokens += c.prompt_len + s.done
                    s.needs_prefill = False
                self.running.append(s)
            if not self.running:
                self.wake = env.event()
                yield self.wake
                continue
            k = min(s.target - s.done for s in self.running)
            ends = np.cumsum(self._step_times(k, prefill))
            start = env.now
            self.wake = env.event()
            yield env.timeout(ends[-1]) | self.wake
            steps = int(np.searchsorted(ends, env.now - start - 1e-12, side="right"))
            if steps < k:  # woken mid-chunk: the step under way completes first
                yield env.timeout(max(0.0, ends[steps] - (env.now - start)))
                steps += 1
            self.busy_s += float(ends[steps - 1])
            self._advance(steps)

    def _advance(self, steps: int) -> None:
        c, still = self.sim.cfg, []
        for s in self.running:
            if s.v_start is None:
                s.v_start = self.version
            s.done += steps
            if s.group >= 0:
                self.sim.gen_tokens += steps
            if s.done < s.target:
                still.append(s)
                continue
            if s.group < 0:
                continue
            g = self.groups[s.group]
            g.left -= 1
            g.v_start = min(g.v_start, s.v_start)
            g.tokens += c.prompt_len + s.done
            g.answers.append(s.done)
            if g.left == 0:
                del self.groups[s.group]
                self.sim.env.process(self.sim.score(s.group, g, self.reward_pool))
        self.running = still

    def add_eval(self) -> None:
        self.waiting.extend(_Seq(-1, self.sim.draw_length()) for _ in range(self.sim.cfg.eval_prompts))
        self.notify()


class Simulation:
    """One simulated run: `run()` returns a SimResult after `cfg.versions` versions."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(cfg.seed)
        self.core = SchedulerCore(
            n_prompts=4096,  # which prompts are drawn does not matter here; an epoch of them is shuffled
            batch_prompts=cfg.batch_prompts,
            eta=cfg.eta,
            n_trainers=cfg.n_trainers,
            reject_uniform=cfg.reject_uniform,
            seed=cfg.seed,
        )
        self.gens = [_Generator(self, i) for i in range(cfg.n_generators)]
        self._grant_due = False
        self.next_group = 0
        self.gen_tokens = 0
        self.interrupted = 0
        self.prefill_tokens = 0
        self.done = False
        self.batch_ready = self.env.event()
        self.staleness: collections.Counter = collections.Counter()
        self.tokens_consumed = 0
        self.train_busy_s = 0.0
        self.training = False
        self.version_wall_s: list[float] = []
        self.version_tokens: list[int] = []
        self.computed: dict[int, int] = {}  # group id -> token positions the trainer computes for it
        self.train_tokens = [0, 0]  # computed, unshared: over the versions trained
        self.version_train_s: list[float] = []

    def train_slowdown(self) -> float:
        """How much longer training takes now than with the cores to itself (1 without sharing)."""
        stepping = sum(bool(g.running) for g in self.gens) / max(1, len(self.gens))
        return 1.0 + self.cfg.train_slowdown * stepping

    def draw_length(self) -> int:
        return max(1, int(self.cfg.lengths.quantile(float(self.rng.random()))))

    def grant(self) -> None:
        """Ask for a grant round once everything else at this instant has happened: rank 0 handles all its
        waiting messages (wants, weights loaded, groups done), then grants once, so generators that load
        at the same moment share the room instead of the first one in event order taking it all."""
        if not self._grant_due:
            self._grant_due = True
            self.env.process(self._grant_round())

    def _grant_round(self):
        yield self.env.timeout(0)
        self._grant_due = False
        room = self.core.gate.capacity()
        if room <= 0:
            return
        wants = {i: g.admission.asked for i, g in enumerate(self.gens) if g.admission.asked > 0 and g.admitting()}
        for i, k in fair_shares(wants, room).items():
            granted = len(self.core.grant(k))
            if granted:
                self.gens[i].admission.granted(granted)
                self.gens[i].take(granted)

    def _notify_all(self) -> None:
        for g in self.gens:
            g.notify()

    def score(self, gid: int, g: _Group, pool: simpy.Resource):
        if self.cfg.reward_s:
            with pool.request() as turn:
                yield turn
                yield self.env.timeout(self.cfg.reward_s * (1.0 + self.cfg.gen_slowdown * self.training))
        uniform = bool(self.rng.random() < self.cfg.p_uniform)
        self.computed[gid] = self.cfg.train_tokens(g.answers)
        if not self.core.group_done(ReadyGroup("", [], 0, gid, g.tokens, g.v_start), uniform):
            self.grant()  # its slot is free again
        if not self.batch_ready.triggered:
            self.batch_ready.succeed()

    def _publish(self, version: int):
        if self.cfg.publish_latency_s:
            yield self.env.timeout(self.cfg.publish_latency_s)
        self.core.version_trained(version)
        for gen in self.gens:
            gen.staged = version
        self.grant()
        if self.cfg.eval_every and version % self.cfg.eval_every == 0 and self.cfg.eval_prompts:
            self.gens[0].add_eval()
        self._notify_all()

    def _trainers(self):
        c = self.cfg
        version, waited = 0, False
        while version < c.versions:
            dropped = self.core.dropped_stale
            plan = self.core.next_batch()
            if self.core.dropped_stale != dropped:
                self.grant()  # dropped groups returned their slots
            if plan is None:
                self.batch_ready = self.env.event()
                yield self.batch_ready
                waited = True
                continue
            # rank 0 relays a batch it has just seen complete more slowly than one it holds when asked
            latency = c.batch_latency_s if waited else c.ask_latency_s
            waited = False
            if latency:
                yield self.env.timeout(latency)
            # what each trainer computes: its groups' token positions, each shared prefix once
            shares = [
                sum(self.computed.pop(plan.groups[i].group_id) for mb in share for i in mb) for share in plan.shares
            ]
            self.train_tokens[0] += sum(shares)
            self.train_tokens[1] += sum(g.n_tokens for g in plan.groups)
            self.training = True
            t_start = self.env.now
            # in slices, each slowed by the generators stepping when it starts: calibration measures the
            # sharing over the whole span, and generators often stop (their work done) partway through it
            slow = 0.0
            for _ in range(TRAIN_SLICES):
                s = self.train_slowdown() / TRAIN_SLICES
                yield self.env.timeout(max(c.cost.train_s(n) for n in shares) * s)
                slow += s
            yield self.env.timeout(c.train_overhead_s)
            self.training = False
            self.version_train_s.append(self.env.now - t_start)
            self.train_busy_s += c.train_overhead_s * c.n_trainers + sum(c.cost.train_s(n) for n in shares) * slow
            for g in plan.groups:
                self.staleness[plan.version - g.version_start] += c.n_samples
            self.version_tokens.append(sum(g.n_tokens for g in plan.groups))
            self.tokens_consumed += self.version_tokens[-1]
            version += 1
            # the publish latency runs from the end of training (as calibration measures it): trainer 0's
            # own publish is part of it, not before it
            self.env.process(self._publish(version))
            yield self.env.timeout(c.publish_s)
            self.version_wall_s.append(self.env.now)
        self.done = True
        self._notify_all()

    def run(self) -> SimResult:
        c = self.cfg
        for g in self.gens:
            self.env.process(g.run())
        self.env.process(self._publish(0))
        if c.eval_prompts and not c.eval_every:
            self.gens[0].add_eval()  # the start's evaluation (periodic ones include version 0)
        trainers = self.env.process(self._trainers())
        self.env.run(until=trainers)
        wall = self.env.now
        return SimResult(
            wall_s=wall,
            versions=c.versions,
            tokens_consumed=self.tokens_consumed,
            gen_tokens=self.gen_tokens,
            staleness=dict(sorted(self.staleness.items())),
            gen_busy=sum(g.busy_s for g in self.gens) / (c.n_generators * wall) if wall else math.nan,
            train_busy=self.train_busy_s / (c.n_trainers * wall) if wall else math.nan,
            dropped_stale=self.core.dropped_stale,
            rejected_uniform=self.core.rejected,
            interrupted=self.interrupted,
            prefill_tokens=self.prefill_tokens,
            version_wall_s=self.version_wall_s,
            version_tokens=self.version_tokens,
            train_tokens_computed=self.train_tokens[0],
            train_tokens_unshared=self.train_tokens[1],
            version_train_s=self.version_train_s,
            gpus=c.gpus,
        )


def simulate(cfg: SimConfig) -> SimResult:
    return Simulation(cfg).run()
