"""The generator's loop over one engine and one episode runner, without MPI or a trainer (agent_endpoint.py)."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_hpc.types import SampleId


class GcPauses:
    """Python's garbage collections while it is installed: count and milliseconds per generation. A collection
    holds the GIL, so it stops the engine's loop and the endpoint alike."""

    def __init__(self):
        self.n, self.ms, self._t = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.n[info["generation"]] += 1
            self.ms[info["generation"]] += 1e3 * (time.perf_counter() - self._t)

    def start(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self)

    def figures(self, wall: float) -> dict:
        return {
            "gc_collections": self.n,
            "gc_ms": [round(x, 1) for x in self.ms],
            "gc_share": sum(self.ms) / 1e3 / wall,
        }


def _process_cpu(pid: int) -> float:
    """A process's CPU seconds, user and system, all its threads (psutil; its children not counted)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


class Drive:
    """One engine and one episode runner, driven as a generator rank drives them (Generator.tick, RoleLoop's
    back-off); episodes are admitted as groups (`n` samples of a prompt, at most `max_groups` groups with a
    request in the engine, one group queued beyond the slots) or, with `sessions`, `sessions` at a time."""

    def __init__(self, cfg, model_dir: Path, workflow, sessions: int = 0, row_extra: dict | None = None):
        from areal_hpc.config import concurrent_groups
        from areal_hpc.data import load_run_dataset
        from areal_hpc.model import load_tokenizer
        from areal_hpc.reward import reward_pool_for
        from areal_hpc.runtime.build import build_generation_engine
        from areal_hpc.workflow import EpisodeRunner, load_workflow, runner_settings

        self.cfg, self.sessions, self.row_extra = cfg, sessions, row_extra or {}
        self.engine = build_generation_engine(cfg, model_dir, seed=cfg.trainer.seed)
        tok = load_tokenizer(model_dir)
        self.pool = reward_pool_for(cfg)
        self.runner = EpisodeRunner(
            load_workflow(workflow), tok, self.pool, self._submit, runner_settings(cfg, tok, model_dir)
        )
        self.problems = load_run_dataset(cfg, tok).train
        self.n = 1 if sessions else cfg.rollout.n_samples
        self.max_groups = concurrent_groups(cfg.rollout)
        self.next_group = 0
        self.on_engine: dict[int, int] = {}  # group -> its requests in the engine

    def _submit(self, reqs) -> None:
        for r in reqs:
            g = r.request_id.episode.group_id
            self.on_engine[g] = self.on_engine.get(g, 0) + 1
        self.engine.add(reqs)

    def _delivered(self, out) -> None:
        g = out.request_id.episode.group_id
        self.on_engine[g] -= 1
        if not self.on_engine[g]:
            del self.on_engine[g]
        self.runner.deliver(out)

    def _problem(self, key: SampleId):
        return self.problems[key.group_id % len(self.problems)]

    def _start(self, key: SampleId) -> None:
        p = self._problem(key)
        self.runner.start(key, {**p.row, **self.row_extra}, p.prompt_ids)

    def _start_group(self) -> None:
        from areal_hpc.types import SampleId

        for s in range(self.n):
            self._start(SampleId(self.next_group, s))
        self.next_group += 1

    def _admit(self, left: int) -> int:
        """Start what the admission rule allows (at most `left` episodes); the number started."""
        if self.sessions:
            k = min(self.sessions - len(self.runner.tasks), left)
        else:
            load = self.engine.num_running + self.engine.num_waiting
            want = -(-(self.engine.capacity + self.n - load) // self.n)
            # rank 0's staleness bound stands in as a cap on groups in flight: episodes between two calls hold
            # no engine request, so the generator's rule alone would admit groups without end here
            free = self.max_groups - max(len(self.on_engine), -(-len(self.runner.tasks) // self.n))
            k = self.n * min(want, free, -(-left // self.n))
        for _ in range(max(k, 0) // self.n):
            self._start_group()
        return max(k, 0) // self.n * self.n

    def round(self, episodes: int) -> dict:
        from areal_hpc.runtime.comm.protocol import Backoff

        ep = self.endpoint()
        lat0 = len(ep.latencies_ms) if ep else 0
        backoff, steps, done = Backoff(), [], []
        self.rerun, in_flight, napped, step_cpu = 0, [], 0.0, 0.0
        me = os.getpid()
        cpu0 = (time.thread_time(), _process_cpu(ep.process.pid) if ep else 0.0, _process_cpu(me))
        started, t0 = 0, time.time()
        t_last_start, t_turnover = t0, None
        gcp = GcPauses().start()
        while len(done) < episodes:
            if started < episodes:
                k = self._admit(episodes - started)
                started += k
                if k and started >= episodes:
                    t_last_start = time.time()
            busy = self._poll(done)
            if self.engine.num_running or self.engine.num_waiting:
                a, c = time.time(), time.thread_time()
                outs = self.engine.step()
                b, step_cpu = time.time(), step_cpu + time.thread_time() - c
                steps.append((a, b, min(self.engine.capacity, self.engine.num_running + len(outs))))
                for o in outs:
                    self._delivered(o)
                busy = True
            busy = self._poll(done) or busy
            if t_turnover is None and len(done) >= max(self.sessions, 1):
                t_turnover = time.time()
            in_flight.append(len(self.runner.tasks))
            if busy:
                backoff.reset()
            else:
                napped -= time.time()
                backoff.sleep()
                napped += time.time()
        wall = time.time() - t0
        gcp.stop()
        cpu = (
            time.thread_time() - cpu0[0],
            _process_cpu(ep.process.pid) - cpu0[1] if ep else 0.0,
            _process_cpu(me) - cpu0[2],
        )
        lat = list(ep.latencies_ms)[lat0:] if ep else []
        out = self._figures(done, steps, wall, (t_turnover or t0, t_last_start), lat)
        turns = sum(e.stats.turns for e in done)  # model calls: an agent's requests, a built-in's turns
        out |= {
            "loop_cpu_ms_per_turn": 1e3 * cpu[0] / turns,
            # the loop's CPU less the engine's steps' (torch on this thread): the runner, the episodes' Python
            # and, for agents, the sessions' Python and the pipe to the endpoint's process
            "loop_cpu_outside_steps_ms_per_turn": 1e3 * (cpu[0] - step_cpu) / turns,
            "step_cpu_ms_mean": 1e3 * step_cpu / max(len(steps), 1),
            "in_flight_mean": sum(in_flight) / len(in_flight),
            "in_flight_max": max(in_flight),
            "loop_idle_share": napped / wall,  # the generator's loop asleep: nothing to step, nothing came back
            "loop_cpu_s": cpu[0],
            "endpoint_process_cpu_s": cpu[1],  # the HTTP server, the request checks and the agents' clients
            "endpoint_process_cpu_ms_per_call": 1e3 * cpu[1] / len(lat) if lat else 0.0,
            # this process's other threads: the endpoint's pipe reader, the reward pool's supervising threads
            "other_threads_cpu_s": cpu[2] - cpu[0],
            "other_threads_cpu_ms_per_turn": 1e3 * (cpu[2] - cpu[0]) / turns,
            **gcp.figures(wall),
        }
        return out

    def _poll(self, done: list) -> bool:
        idle = not (self.engine.num_running or self.engine.num_waiting)
        got = self.runner.poll(engine_idle=idle)
        for e in got:
            if e.reward is None:  # rejected (an agent that failed): the same sample runs again, as in a run
                self.rerun += 1
                self._start(e.key)
            else:
                done.append(e)
        return bool(got)

    def endpoint(self):
        shared = self.runner._shared.get("agent-endpoint")  # noqa: SLF001 (the endpoint the agent workflow made)
        return shared.endpoint if shared else None

    def _figures(self, done, steps, wall, window, lat) -> dict:
        import numpy as np

        sampled = sum(len(s.ids) for e in done for s in e.sampled)
        transcript = sum(len(s.ids) for e in done for t in e.transcripts for s in t)
        st = np.array(steps) if steps else np.zeros((0, 3))
        lo, hi = window
        dur = np.clip(np.minimum(st[:, 1], hi) - np.maximum(st[:, 0], lo), 0, None)
        cap = self.engine.capacity
        out = {
            "episodes": len(done),
            "rejected_and_rerun": self.rerun,
            "wall_s": wall,
            "sampled_tokens": sampled,
            "sampled_tokens_per_s": sampled / wall,
            "transcript_tokens_per_s": transcript / wall,
            "episodes_per_s": len(done) / wall,
            "turns_per_episode": sum(e.stats.turns for e in done) / len(done),
            "tool_calls_per_episode": sum(e.stats.tool_calls for e in done) / len(done),
            "reward_mean": float(np.mean([e.reward for e in done])),
            "step_share": float((st[:, 1] - st[:, 0]).sum() / wall),
            "steps": len(st),
            "step_ms_mean": float(1e3 * (st[:, 1] - st[:, 0]).mean()) if len(st) else 0.0,
            "rows_per_step_mean": float(st[:, 2].mean()) if len(st) else 0.0,
            "occupancy_window_s": max(hi - lo, 0.0),
            "occupancy": float((st[:, 2] * dur).sum() / (cap * (hi - lo))) if hi > lo else float("nan"),
            "stepping_share_window": float(dur.sum() / (hi - lo)) if hi > lo else float("nan"),
        }
        if lat:
            out |= {
                "latency_calls": len(lat),
                "latency_p50_ms": float(np.percentile(lat, 50)),
                "latency_p90_ms": float(np.percentile(lat, 90)),
                "latency_p95_ms": float(np.percentile(lat, 95)),
                "latency_p99_ms": float(np.percentile(lat, 99)),
                "latency_max_ms": float(np.max(lat)),
            }
        return out

    def close(self) -> None:
        self.runner.close()
        self.pool.close(finish_queued=False)
        self.engine.close()
