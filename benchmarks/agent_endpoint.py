"""The agent endpoint's cost: an agent on the `openai` client against the built-in `tool` workflow, the endpoint's
latency per call, and the engine's occupancy while agents wait on their tools.

Generation only (no trainer, no MPI): one process drives a torch generation engine and an episode runner the way a
generator rank does (poll the episodes, one engine step, poll again; the generator's back-off when idle), on one
torch thread; the endpoint and the agents run in the endpoint's process, the rewards in the reward pool's worker.
The models are the demos' (jobs/demo_tool.yaml: arith_tool vocabulary, jobs/demo_agent.yaml: arith_agent), each
warm-started as its demo does but with workflow.warm_start_tool_share (default 1.0: nearly every episode calls
the calculator, as both demos' policies do after RL), built once into --out.

1. Throughput on the tool-demo task: rounds of --episodes episodes, `tool` (calculator) and `agent`
   (jobs/examples/calculator_agent.py) alternated (tool, agent, tool, agent, ...), admitted as a generator admits
   groups (the demos' 8 samples a prompt, 16 groups in the engine, 256 slots; at most 16 groups in flight,
   standing in for rank 0's staleness bound). Sampled tokens per second of a round's wall (the engine's tokens:
   both vocabularies spell a calculator call in 10 tokens, so the ratio is also one of work done), agent over
   tool per pair and overall; transcript tokens/s (prompt, tool results and samples) in the JSON.
2. Long turns: the same on the agent demo's model before its warm start, one answer of up to --long-tokens
   tokens per episode: `single_turn` against an agent making one call (`one_call_agent`). The agent path costs
   a fixed amount per call, so the ratio depends on the tokens per call; this is its second point.
3. Heavy model: the same A/B as 2 with the agent demo's short turns (max_new_tokens 12), on the agent demo's
   model widened (--heavy: hidden 512, MLP 2048, 4 layers, untrained), so that an engine step costs tens of ms,
   as a small real model's would on a GPU: what the fixed cost per call amounts to against such steps (the step
   ms of both paths printed).
4. Latency: --sessions agents in flight at once (calculator_agent, no tool wait) on as many slots; the endpoint's
   `latencies_ms` (request received by the endpoint process's HTTP handler -> request handed to the engine in the
   generator, time.monotonic on both sides), p50 and p99.
5. Occupancy: --occupancy-sessions agents whose every tool call first awaits --tool-ms (asyncio.sleep), on
   --slots slots; the share of slot-time the engine held a sequence, sum(rows x step time) / (slots x wall), as
   benchmarks/workflows.py measures it, over the steady part (from the end of the first sessions' worth of
   episodes to the last episode's start).
Every round also says where the CPU went: the loop asleep (nothing to step), the endpoint process's CPU per call
(psutil's user + system of that process: HTTP server, request checks, the agents' openai clients), the loop's CPU
per model call with and without the engine's steps, the generator's other threads' CPU per model call (the pipe
reader, the reward pool's threads), Python's garbage collections (the generator's). As the Generator does,
gc.freeze() once the engines are built (--no-gc-freeze: not).

    .venv/bin/python benchmarks/agent_endpoint.py   # about 4 minutes on 2 cores (more the first time: warm starts)
    .venv/bin/python benchmarks/agent_endpoint.py --parts throughput,latency --pairs 2 --episodes 512
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

from _agent_drive import Drive  # benchmarks/ is on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
AGENT = ROOT / "jobs" / "examples" / "calculator_agent.py"
PARTS = "throughput,long,heavy,latency,occupancy"


@functools.cache
def calculator_agent():
    """jobs/examples/calculator_agent.py as a module (its tool and its settings)."""
    spec = importlib.util.spec_from_file_location("calculator_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def slow_tool_agent(client, row: dict) -> str:
    """calculator_agent with a tool that takes row["tool_s"] seconds (awaited: the engine's slot is free meanwhile)."""
    ca = calculator_agent()
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(ca.MAX_CALLS):
        reply = await client.chat.completions.create(model=ca.MODEL, messages=messages, tools=[ca.CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            await asyncio.sleep(row["tool_s"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": ca.run_tool(call)})
    return ""


async def one_call_agent(client, row: dict) -> str:
    """One chat completion, no tools: the endpoint's cost per call against single_turn's."""
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["question"]}]
    )
    return reply.choices[0].message.content or ""


def demo_config(workflow: str, args, overrides: list[str] = ()):
    """jobs/demo_tool.yaml for `tool`, else jobs/demo_agent.yaml (its model) under `workflow`."""
    from areal_hpc.config import load_config

    job, model = ("demo_tool.yaml", "tool") if workflow == "tool" else ("demo_agent.yaml", "agent")
    ov = [
        f"model.path={args.out / ('base-' + model)}",
        f"workflow.fn={workflow}",
        f"workflow.warm_start_tool_share={args.tool_share}",
        f"trainer.warm_start_steps={args.warm_steps}",
        "logging.progress=false",
        f"workflow.agent={AGENT}:agent" if workflow == "agent" else 'workflow.agent=""',  # demo_agent.yaml names it
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


def freeze(args) -> None:
    """As the Generator does once start-up is done (unless --no-gc-freeze): what exists now (modules, the model,
    the engine) leaves the collector's view, so a full collection walks only what the episodes made since."""
    if args.gc_freeze:
        gc.collect()
        gc.freeze()


def interleaved(args, specs: dict, episodes: int, label: str) -> dict:
    """Rounds of a built-in workflow and `agent` alternated, each on its own engine and runner (kept across its
    rounds); `specs`: name -> (config, model folder, workflow), the agent's last."""
    drives = {name: Drive(cfg, model, workflow) for name, (cfg, model, workflow) in specs.items()}
    runs: dict[str, list[dict]] = {name: [] for name in drives}
    freeze(args)
    try:
        for d in drives.values():  # a short round each first: imports, the endpoint, the first prefill shapes
            d.round(args.n_samples * 2)
        for i in range(args.pairs):
            for name, d in drives.items():
                print(f"[bench] {label} pair {i + 1}/{args.pairs}: {name} ...", flush=True)
                runs[name].append(d.round(episodes))
    finally:
        for d in drives.values():
            d.close()
    base, agent = ([r["sampled_tokens_per_s"] for r in rs] for rs in runs.values())
    return {
        "runs": runs,
        "pair_ratios": [a / b for a, b in zip(agent, base)],
        "agent_over_builtin": sum(agent) / sum(base),
    }


def print_pairs(res: dict, label: str) -> None:
    head = ("sampled tok/s", "tokens/turn", "tools/ep", "reward", "step ms", "loop idle", "endpt ms/call")
    head += ("loop ms/turn", "less steps", "step cpu ms", "other ms/turn")
    print(f"\n{'run':<12}" + "".join(f"{h:>17}" for h in head) + f"{'gc share':>10}")
    for name, rs in res["runs"].items():
        for r in rs:
            per_turn = r["sampled_tokens"] / (r["turns_per_episode"] * r["episodes"])
            keys = ("reward_mean", "step_ms_mean", "loop_idle_share", "endpoint_process_cpu_ms_per_call")
            keys += ("loop_cpu_ms_per_turn", "loop_cpu_outside_steps_ms_per_turn", "step_cpu_ms_mean")
            keys += ("other_threads_cpu_ms_per_turn",)
            print(
                f"{name:<12}{r['sampled_tokens_per_s']:>17.0f}{per_turn:>17.1f}{r['tool_calls_per_episode']:>17.2f}"
                + "".join(f"{r[k]:>17.2f}" for k in keys)
                + f"{r['gc_share']:>10.3f}"
            )
    pairs = ", ".join(f"{x:.3f}" for x in res["pair_ratios"])
    base = next(iter(res["runs"]))
    print(f"{label}: agent / {base}, sampled tokens/s: {res['agent_over_builtin']:.3f} (pairs: {pairs})\n")


def sessions_run(args, model: Path, sessions: int, slots: int, tool_s: float) -> dict:
    """`sessions` agents in flight on `slots` slots; with tool_s, each tool call awaits that long first."""
    ov = [f"rollout.max_num_seqs={slots}"]
    if tool_s:
        ov.append(f"workflow.agent={Path(__file__).resolve()}:slow_tool_agent")
    d = Drive(demo_config("agent", args, ov), model, "agent", sessions, {"tool_s": tool_s} if tool_s else None)
    freeze(args)
    try:
        d.round(sessions)  # the first calls: imports, connections
        return d.round(args.session_episodes)
    finally:
        d.close()


def heavy_part(args) -> dict:
    """single_turn against a one-call agent, the agent demo's short turns, on its model widened (untrained): a
    step costs tens of ms, as a small real model's step would on a GPU, against the same fixed cost per call."""
    from areal_hpc.model import ensure_model

    hidden, inter, layers = (int(x) for x in args.heavy.split(","))
    wide = args.out / f"base-agent-{hidden}x{inter}x{layers}"
    ov = [f"model.path={wide}", f"model.hidden_size={hidden}", f"model.intermediate_size={inter}"]
    ov += [f"model.num_layers={layers}", "model.num_heads=8"]
    ensure_model(demo_config("agent", args, ov).model)
    one_call = [*ov, f"workflow.agent={Path(__file__).resolve()}:one_call_agent"]
    specs = {
        "single_turn": (demo_config("single_turn", args, ov), wide, "single_turn"),
        "agent": (demo_config("agent", args, one_call), wide, "agent"),
    }
    res = interleaved(args, specs, args.heavy_episodes, "heavy model")
    res["model"] = {"hidden_size": hidden, "intermediate_size": inter, "num_layers": layers, "num_heads": 8}
    res["max_new_tokens"] = n = specs["agent"][0].rollout.max_new_tokens
    print_pairs(res, f"heavy model ({hidden} wide, {inter} MLP, {layers} layers; untrained), one call of <= {n} tokens")
    return res


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
    ap.add_argument("--long-tokens", type=int, default=128, help="a turn's token budget in the long-turns part")
    ap.add_argument("--long-episodes", type=int, default=512, help="episodes per long-turns round")
    ap.add_argument("--parts", default=PARTS)
    ap.add_argument(
        "--gc-freeze", action=argparse.BooleanOptionalAction, default=True, help="gc.freeze() once the engines are up"
    )
    ap.add_argument("--heavy-episodes", type=int, default=512, help="episodes per round of the heavy-model part")
    ap.add_argument("--heavy", default="512,2048,4", help="the heavy part's model: hidden,intermediate,layers")
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
        specs = {w: (demo_config(w, args), models[w], w) for w in ("tool", "agent")}
        result["throughput"] = interleaved(args, specs, args.episodes, "throughput")
        print_pairs(result["throughput"], "tool-demo task")
    if "long" in parts:
        # the agent demo's model before its warm start: answers of up to --long-tokens tokens (EOS when it comes),
        # one call per episode, over which each call's cost is spread; single_turn samples the same distribution
        ov = [f"rollout.max_new_tokens={args.long_tokens}"]
        one_call = [*ov, f"workflow.agent={Path(__file__).resolve()}:one_call_agent"]
        base = args.out / "base-agent"
        specs = {
            "single_turn": (demo_config("single_turn", args, ov), base, "single_turn"),
            "agent": (demo_config("agent", args, one_call), base, "agent"),
        }
        result["long_turns"] = interleaved(args, specs, args.long_episodes, "long turns")
        print_pairs(result["long_turns"], f"one answer of up to {args.long_tokens} tokens (untrained model)")
    if "heavy" in parts:
        result["heavy"] = heavy_part(args)
    if "latency" in parts:
        print(f"[bench] latency: {args.sessions} sessions on {args.sessions} slots ...", flush=True)
        r = result["latency"] = sessions_run(args, models["agent"], args.sessions, args.sessions, 0.0)
        print(
            f"endpoint latency, {args.sessions} sessions in flight ({r['latency_calls']} calls): "
            f"p50 {r['latency_p50_ms']:.2f} ms, p95 {r['latency_p95_ms']:.2f} ms, p99 {r['latency_p99_ms']:.2f} ms, "
            f"max {r['latency_max_ms']:.2f} ms "
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

    name = "agent_endpoint" + ("" if args.parts == PARTS else "_" + args.parts.replace(",", "_"))
    name += "" if args.gc_freeze else "_no_gc_freeze"
    name += f"_switch{args.switch_interval * 1e3:g}ms" if args.switch_interval else ""
    name += ".json"
    atomic_write_text(args.out / name, json.dumps(result, indent=1))
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
