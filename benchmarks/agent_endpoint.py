"""The agent endpoint's cost: an agent on the `openai` client against the built-in `tool` workflow, the endpoint's
latency per call, and the engine's occupancy while agents wait on their tools.

Generation only (no trainer, no MPI): one process drives a torch generation engine and an episode runner the way a
generator rank does (poll the episodes, one engine step, poll again; the generator's back-off when idle), on one
torch thread; the endpoint and the agents run on the endpoint's thread, the rewards in the reward pool's worker.
The models are the demos' (jobs/demo_tool.yaml: arith_tool vocabulary, jobs/demo_agent.yaml: arith_agent), each
warm-started as its demo does but with workflow.warm_start_tool_share (default 1.0: nearly every episode calls
the calculator, as both demos' policies do after RL), built once into --out.

1. Throughput: rounds of --episodes episodes, `tool` (calculator) and `agent` (jobs/examples/calculator_agent.py)
   alternated (tool, agent, tool, agent, ...), admitted as a generator admits groups (the demos' 8 samples a
   prompt, 16 groups in the engine, 256 slots; at most 16 groups in flight, standing in for rank 0's staleness
   bound). Sampled tokens per second of a round's wall (the engine's tokens: both vocabularies spell a calculator
   call in 10 tokens, so the ratio is also one of work done), agent over tool per pair and overall; transcript
   tokens/s (prompt, tool results and samples) beside it.
2. Latency: --sessions agents in flight at once (calculator_agent, no tool wait) on as many slots; the endpoint's
   `latencies_ms` (request received by the HTTP handler -> request handed to the engine), p50 and p99.
3. Occupancy: --occupancy-sessions agents whose every tool call first awaits --tool-ms (asyncio.sleep), on
   --slots slots; the share of slot-time the engine held a sequence, sum(rows x step time) / (slots x wall), as
   benchmarks/workflows.py measures it, over the steady part (from the end of the first sessions' worth of
   episodes to the last episode's start).

    .venv/bin/python benchmarks/agent_endpoint.py              # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/agent_endpoint.py --pairs 2 --episodes 256
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
AGENT = ROOT / "jobs" / "examples" / "calculator_agent.py"


async def slow_tool_agent(client, row: dict) -> str:
    """calculator_agent with a tool that takes row["tool_s"] seconds (awaited: the engine's slot is free meanwhile)."""
    sys.path.insert(0, str(AGENT.parent))
    from calculator_agent import CALCULATOR, MAX_CALLS, MODEL, run_tool

    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            await asyncio.sleep(row["tool_s"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return ""


def demo_config(workflow: str, args, overrides: list[str] = ()):
    from areal_hpc.config import load_config

    job = {"tool": "demo_tool.yaml", "agent": "demo_agent.yaml"}[workflow]
    ov = [
        f"model.path={args.out / ('base-' + workflow)}",
        f"workflow.warm_start_tool_share={args.tool_share}",
        f"trainer.warm_start_steps={args.warm_steps}",
        "logging.progress=false",
        *([f"workflow.agent={AGENT}:agent"] if workflow == "agent" else []),
        *overrides,
    ]
    return load_config(ROOT / "jobs" / job, ov)


def warm_model(workflow: str, args) -> Path:
    """The demo's tiny model after its warm start (built once per settings into --out)."""
    from areal_hpc.data import load_run_dataset
    from areal_hpc.model import ensure_model, load_tokenizer
    from areal_hpc.runtime.build import build_train_engine, warm_start

    dest = args.out / f"warm-{workflow}"
    stamp = {"tool_share": args.tool_share, "steps": args.warm_steps}
    made = dest / "bench_warm_start.json"
    if made.exists() and json.loads(made.read_text()) == stamp:
        return dest
    cfg = demo_config(workflow, args)
    base = ensure_model(cfg.model)
    tok = load_tokenizer(base)
    print(f"[bench] warm start of the {workflow} model ({args.warm_steps} steps) ...", flush=True)
    trainer = build_train_engine(cfg, base)
    loss = warm_start(trainer, tok, load_run_dataset(cfg, tok), cfg, progress=False)
    trainer.export_hf(dest)
    made.write_text(json.dumps(stamp))
    print(f"[bench] warm start of the {workflow} model: loss {loss:.3f}", flush=True)
    return dest


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


async def _thread_time() -> float:
    """The CPU time of the thread this runs on (the endpoint's, submitted there)."""
    return time.thread_time()


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
        self.on_engine: dict[str, int] = {}  # group -> its requests in the engine

    def _submit(self, reqs) -> None:
        for r in reqs:
            g = r.request_id.split(":")[0]
            self.on_engine[g] = self.on_engine.get(g, 0) + 1
        self.engine.add(reqs)

    def _delivered(self, out) -> None:
        g = out.request_id.split(":")[0]
        self.on_engine[g] -= 1
        if not self.on_engine[g]:
            del self.on_engine[g]
        self.runner.deliver(out)

    def _problem(self, key: str):
        return self.problems[int(key.split(":")[0]) % len(self.problems)]

    def _start(self, key: str) -> None:
        p = self._problem(key)
        self.runner.start(key, {**p.row, **self.row_extra}, p.prompt_ids)

    def _start_group(self) -> None:
        for s in range(self.n):
            self._start(f"{self.next_group}:{s}")
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
        from areal_hpc.runtime.protocol import Backoff

        ep = self.endpoint()
        lat0 = len(ep.latencies_ms) if ep else 0
        backoff, steps, done = Backoff(), [], []
        self.rerun, in_flight, napped = 0, [], 0.0
        cpu0 = (time.thread_time(), ep.submit(_thread_time()).result() if ep else 0.0)
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
                a = time.time()
                outs = self.engine.step()
                b = time.time()
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
        cpu = (time.thread_time() - cpu0[0], ep.submit(_thread_time()).result() - cpu0[1] if ep else 0.0)
        lat = list(ep.latencies_ms)[lat0:] if ep else []
        out = self._figures(done, steps, wall, (t_turnover or t0, t_last_start), lat)
        out |= {
            "in_flight_mean": sum(in_flight) / len(in_flight),
            "in_flight_max": max(in_flight),
            "loop_idle_share": napped / wall,  # the generator's loop asleep: nothing to step, nothing came back
            "loop_cpu_s": cpu[0],
            "endpoint_thread_cpu_s": cpu[1],  # the HTTP server and the in-process agents' clients
            "endpoint_thread_cpu_ms_per_call": 1e3 * cpu[1] / len(lat) if lat else 0.0,
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
            "rows_per_step_mean": float(st[:, 2].mean()) if len(st) else 0.0,
            "occupancy_window_s": max(hi - lo, 0.0),
            "occupancy": float((st[:, 2] * dur).sum() / (cap * (hi - lo))) if hi > lo else float("nan"),
            "stepping_share_window": float(dur.sum() / (hi - lo)) if hi > lo else float("nan"),
        }
        if lat:
            out |= {
                "latency_calls": len(lat),
                "latency_p50_ms": float(np.percentile(lat, 50)),
                "latency_p99_ms": float(np.percentile(lat, 99)),
                "latency_max_ms": float(np.max(lat)),
            }
        return out

    def close(self) -> None:
        self.runner.close()
        self.pool.close(finish_queued=False)
        self.engine.close()


def freeze(args) -> None:
    """With --gc-freeze: what exists now (modules, the model, the engine) leaves the collector's view, so a full
    collection walks only what the episodes made since (gc.freeze)."""
    if args.gc_freeze:
        gc.collect()
        gc.freeze()


def throughput(args, models: dict) -> dict:
    drives = {w: Drive(demo_config(w, args), models[w], w) for w in ("tool", "agent")}
    runs: dict[str, list[dict]] = {"tool": [], "agent": []}
    try:
        for d in drives.values():  # a short round each first: imports, the endpoint, the first prefill shapes
            d.round(args.n_samples * 2)
        freeze(args)
        for i in range(args.pairs):
            for w, d in drives.items():
                print(f"[bench] throughput pair {i + 1}/{args.pairs}: {w} ...", flush=True)
                runs[w].append(d.round(args.episodes))
    finally:
        for d in drives.values():
            d.close()
    tps = {w: [r["sampled_tokens_per_s"] for r in rs] for w, rs in runs.items()}
    return {
        "runs": runs,
        "pair_ratios": [a / t for a, t in zip(tps["agent"], tps["tool"])],
        "agent_over_tool": sum(tps["agent"]) / sum(tps["tool"]),
    }


def sessions_run(args, model: Path, sessions: int, slots: int, tool_s: float) -> dict:
    """`sessions` agents in flight on `slots` slots; with tool_s, each tool call awaits that long first."""
    ov = [f"rollout.max_num_seqs={slots}"]
    if tool_s:
        ov.append(f"workflow.agent={Path(__file__).resolve()}:slow_tool_agent")
    d = Drive(demo_config("agent", args, ov), model, "agent", sessions, {"tool_s": tool_s} if tool_s else None)
    try:
        d.round(sessions)  # the first calls: imports, connections
        freeze(args)
        return d.round(args.session_episodes)
    finally:
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="interleaved (tool, agent) throughput rounds")
    ap.add_argument("--episodes", type=int, default=2048, help="episodes per throughput round (a multiple of 8)")
    ap.add_argument("--sessions", type=int, default=64, help="agents in flight in the latency run (as many slots)")
    ap.add_argument("--session-episodes", type=int, default=2048, help="episodes of the latency and occupancy runs")
    ap.add_argument("--slots", type=int, default=8, help="engine slots of the occupancy run")
    ap.add_argument("--occupancy-sessions", type=int, default=64, help="agents in flight in the occupancy run")
    ap.add_argument("--tool-ms", type=float, default=200.0)
    ap.add_argument("--tool-share", type=float, default=1.0, help="workflow.warm_start_tool_share of the models")
    ap.add_argument("--warm-steps", type=int, default=200)
    ap.add_argument("--parts", default="throughput,latency,occupancy")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the engines are up (see GcPauses)")
    ap.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval (0: Python's, 5 ms)")
    ap.add_argument("--out", type=Path, default=RESULTS / "agent_endpoint")
    args = ap.parse_args()
    args.n_samples = 8
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)  # a generator rank's (cluster.threads_per_rank=1): the other core serves the rest
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    parts = set(args.parts.split(","))
    models = {w: warm_model(w, args) for w in ("tool", "agent")}
    result = {"benchmark": "agent_endpoint", "host": platform.node(), "time": time.time(), "args": vars(args) | {}}
    result["args"]["out"] = str(args.out)
    if "throughput" in parts:
        tp = result["throughput"] = throughput(args, models)
        head = ("sampled tok/s", "transcript tok/s", "episodes/s", "tools/ep", "reward", "in flight", "loop idle")
        print(f"\n{'run':<7}" + "".join(f"{h:>17}" for h in head) + f"{'endpoint ms/call':>17}{'gc share':>10}")
        for w, rs in tp["runs"].items():
            for r in rs:
                keys = ("sampled_tokens_per_s", "transcript_tokens_per_s", "episodes_per_s", "tool_calls_per_episode")
                keys += ("reward_mean", "in_flight_mean", "loop_idle_share", "endpoint_thread_cpu_ms_per_call")
                print(f"{w:<7}" + "".join(f"{r[k]:>17.2f}" for k in keys) + f"{r['gc_share']:>10.3f}")
        pairs = ", ".join(f"{x:.3f}" for x in tp["pair_ratios"])
        print(f"agent / tool, sampled tokens/s: {tp['agent_over_tool']:.3f} (pairs: {pairs})\n")
    if "latency" in parts:
        print(f"[bench] latency: {args.sessions} sessions on {args.sessions} slots ...", flush=True)
        r = result["latency"] = sessions_run(args, models["agent"], args.sessions, args.sessions, 0.0)
        print(
            f"endpoint latency, {args.sessions} sessions in flight ({r['latency_calls']} calls): "
            f"p50 {r['latency_p50_ms']:.2f} ms, p99 {r['latency_p99_ms']:.2f} ms, max {r['latency_max_ms']:.2f} ms "
            f"(garbage collections {r['gc_share']:.3f} of the wall; gen 2: {r['gc_collections'][2]}, "
            f"{r['gc_ms'][2]:.0f} ms)"
        )
    if "occupancy" in parts:
        print(
            f"[bench] occupancy: {args.occupancy_sessions} sessions, {args.tool_ms:g} ms tools, {args.slots} slots ..."
        )
        r = result["occupancy"] = sessions_run(
            args, models["agent"], args.occupancy_sessions, args.slots, args.tool_ms / 1000
        )
        print(
            f"engine occupancy, {args.occupancy_sessions} agents, {args.tool_ms:g} ms tools, {args.slots} slots: "
            f"{r['occupancy']:.3f} (stepping {r['stepping_share_window']:.3f} of {r['occupancy_window_s']:.1f} s; "
            f"{r['sampled_tokens_per_s']:.0f} sampled tok/s, {r['tool_calls_per_episode']:.2f} tool calls/ep, "
            f"latency p50 {r.get('latency_p50_ms', float('nan')):.2f} ms, garbage collections {r['gc_share']:.3f})"
        )
    from areal_hpc.utils import atomic_write_text

    name = "agent_endpoint" + ("_gc_freeze" if args.gc_freeze else "")
    name += f"_switch{args.switch_interval * 1e3:g}ms" if args.switch_interval else ""
    name += ".json"
    atomic_write_text(args.out / name, json.dumps(result, indent=1))
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
