"""Fit the simulator's cost model and latencies to a real run directory (its timeline, metrics and store)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import yaml

from areal_hpc.config import Config, concurrent_groups, load_config
from areal_hpc.costmodel import SHAPES, CostModel, EmpiricalLengths, ResponseLengths, emulated_cost, settings_of
from areal_hpc.disk_estimate import read_model_shape
from areal_hpc.reward.emulated import EmulatedRewards
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.comm.timeline import load_engine_samples, load_timeline
from areal_hpc.simulate.loop import SimConfig
from areal_hpc.store import load_trajectories


def sim_config(cfg: Config, cost: CostModel | None = None, **extra) -> SimConfig:
    """The simulator's view of a run config; the cost model and lengths are the emulation section's
    unless given (a calibration gives measured ones). The preset's costs are taken under the run's settings:
    the objective's extra forwards and LoRA's smaller sync (a calibrated model measured its run's)."""
    rc, ec = cfg.rollout, cfg.emulation
    if cost is None:
        cost = emulated_cost(ec.preset, dict(ec.cost), settings_of(cfg, _teacher_params(cfg)))
    lengths = extra.pop("lengths", None) or ResponseLengths(
        ec.len_median or rc.max_new_tokens / 4, ec.len_sigma, rc.max_new_tokens
    )
    if "p_uniform" not in extra and rc.engine == "emulated":
        extra["p_uniform"] = EmulatedRewards(ec.p_correct).p_uniform(rc.n_samples)
    if "prompt_len" not in extra:
        extra["prompt_len"] = _prompt_tokens(cfg)
    return SimConfig(
        n_generators=cfg.cluster.n_generators,
        n_trainers=cfg.cluster.n_trainers,
        devices_per_generator=cfg.cluster.devices_per_generator,
        batch_prompts=rc.batch_prompts,
        n_samples=rc.n_samples,
        eta=rc.eta,
        capacity=rc.max_num_seqs,
        max_groups=concurrent_groups(rc),
        weight_update=rc.weight_update,
        versions=cfg.trainer.versions,
        cost=cost,
        lengths=lengths,
        reject_uniform=cfg.ppo.drop_uniform_groups,
        share_prefixes=cfg.trainer.share_prefixes,
        share_min_tokens=cfg.trainer.share_min_tokens,
        max_tokens_per_mb=cfg.trainer.max_tokens_per_mb,
        eval_every=cfg.logging.eval_every,
        eval_prompts=min(cfg.logging.eval_prompts, cfg.data.heldout_size),
        seed=cfg.trainer.seed,
        **extra,
    )


def _teacher_params(cfg: Config) -> float:
    """distill.teacher's parameters at the preset's scale: its size over the policy's, from the two folders'
    config.json (the same size when either is not here), times the preset's parameters."""
    if not cfg.distill.teacher:
        return 0.0
    try:
        teacher, policy = read_model_shape(cfg.distill.teacher), read_model_shape(cfg.model.path)
    except ValueError:  # a shape model_shape cannot count
        teacher = policy = None
    ratio = teacher.params / policy.params if teacher and policy else 1.0
    return ratio * SHAPES[cfg.emulation.preset].params


def _prompt_tokens(cfg: Config, sample: int = 200) -> int:
    """Mean prompt length of the run's dataset in the model's tokens (64 when the model folder is not built)."""
    from pathlib import Path

    if not (Path(cfg.model.path) / "tokenizer_config.json").is_file():
        return 64
    from areal_hpc.data import load_run_dataset
    from areal_hpc.model import load_tokenizer

    tok = load_tokenizer(Path(cfg.model.path))
    prompts = load_run_dataset(cfg, tok).train[:sample]
    return max(1, round(sum(len(p.prompt_ids) for p in prompts) / max(1, len(prompts))))


def _decode_fit(run: RunDir, m: pd.DataFrame) -> tuple[float, float]:
    """(per-step overhead, per-sequence compute) from the engine meter: step time against batch size,
    plus the time between steps inside generate spans (the generator's own work), as overhead."""
    m = m[m["seq_steps"] > 0]
    if m.empty:
        raise ValueError(f"{run.root}: no engine steps recorded under timeline/engine-rank*.csv; nothing to calibrate")
    batch = m["seq_steps"] / m["steps"]
    step = m["seq_s"] / m["seq_steps"]
    slope, intercept = np.polyfit(batch, step, 1, w=np.sqrt(m["steps"])) if batch.nunique() > 1 else (0.0, step.mean())
    if slope <= 0:
        slope, intercept = 0.0, float(np.average(step, weights=m["steps"]))
    tl = load_timeline(run.root)
    gen_span = tl[(tl["role"] == "generator") & (tl["event"] == "generate")]["duration"].sum()
    mean_batch = m["seq_steps"].sum() / m["steps"].sum()
    gap = gen_span / m["steps"].sum() - (intercept + slope * mean_batch)
    return max(intercept + max(gap, 0.0), 1e-6), max(slope, 0.0)


def _busy_overlap(spans: pd.DataFrame, m: pd.DataFrame) -> float:
    """Generator-steps running during the spans, per second of span (the engine meter's windows, each
    counted as busy for its share of stepping)."""
    if spans.empty or m.empty:
        return 0.0
    w0, w1 = m["t_start"].to_numpy(), m["t_end"].to_numpy()
    busy = (m["step_s"] / (w1 - w0).clip(min=1e-9)).clip(upper=1.0).to_numpy()
    total = 0.0
    for a, b in zip(spans["t_start"], spans["t_end"]):
        total += float((np.clip(np.minimum(w1, b) - np.maximum(w0, a), 0, None) * busy).sum())
    return total / max(spans["duration"].sum(), 1e-9)


def _core_sharing(cfg: Config, tl: pd.DataFrame, m: pd.DataFrame) -> dict:
    """How much each role slowed while the other one ran, from the share of a core its work got (CPU over
    wall seconds) and how much of that work overlapped the other role. A role counts when the run is on
    CPU and its engine is not emulated; a run whose roles never overlapped (synchronous, or from before
    CPU time was recorded) shows no sharing."""
    on_cpu = cfg.cluster.device == "cpu"
    trains = tl[(tl["role"] == "trainer") & (tl["event"] == "train")].dropna(subset=["cpu_s"])
    if cfg.trainer.warm_start_steps and not trains.empty:  # each trainer's first span is the warm start
        trains = trains[trains.groupby("rank")["t_start"].rank(method="first") > 1]
    out = {"gen_share": 1.0, "train_share": 1.0, "gen_slowdown": 0.0, "train_slowdown": 0.0, "train_wait_s": 0.0}
    if not on_cpu or "cpu_s" not in m or trains.empty or m.empty:
        return out
    gen_wall, train_wall = float(m["step_s"].sum()), float(trains["duration"].sum())
    # generator-steps per second of training, per generator; and the share of the steps taken while training
    stepping = _busy_overlap(trains, m) / cfg.cluster.n_generators
    while_training = stepping * cfg.cluster.n_generators * train_wall / max(gen_wall, 1e-9)
    if cfg.rollout.engine != "emulated" and gen_wall > 0 and while_training > 0.05:
        out["gen_share"] = min(1.0, float(m["cpu_s"].sum()) / gen_wall)
        out["gen_slowdown"] = (1 / out["gen_share"] - 1) / min(1.0, while_training)
    if cfg.trainer.engine != "emulated" and train_wall > 0 and stepping > 0.05:
        out["train_share"] = min(1.0, float(trains["cpu_s"].sum()) / train_wall)
        out["train_slowdown"] = (1 / out["train_share"] - 1) / min(1.0, stepping)
        out["train_wait_s"] = float((trains["duration"] - trains["cpu_s"]).clip(lower=0).sum())
    return out


def _service_s(spans: pd.DataFrame, workers: int) -> float:
    """A reward worker's time per group: the time some group was being scored (the union of the spans,
    which include queueing) times the workers, over the groups."""
    if spans.empty:
        return 0.0
    busy = 0.0
    for _, per_rank in spans.groupby("rank"):
        end = -math.inf
        for t0, t1 in sorted(zip(per_rank["t_start"], per_rank["t_end"])):
            busy += max(0.0, t1 - max(t0, end))
            end = max(end, t1)
    return busy * workers / len(spans)


def calibrate(run_dir, overrides: list[str] | None = None) -> tuple[SimConfig, dict]:
    """A SimConfig fitted to the run in `run_dir` (the config it ran, with `overrides` applied after the
    fit), and what was measured. Every figure is measured from the run's files; nothing is tuned to make
    the simulated run match."""
    run = RunDir(run_dir)
    if not run.config.is_file() or not run.summary.is_file():
        raise ValueError(f"{run.root} is not a finished run directory (needs config.yaml and summary.json)")
    cfg = load_config(run.config)
    summary = json.loads(run.summary.read_text())
    metrics = pd.read_csv(run.metrics).dropna(subset=["tokens"])
    tl = load_timeline(run.root)
    trajs = load_trajectories(run.root)
    engine = load_engine_samples(run.root)
    overhead, per_seq = _decode_fit(run, engine)
    latencies = _latencies(tl)
    sharing = _core_sharing(cfg, tl, engine)
    # the costs on cores of its own: the simulator slows them again by the sharing it models
    overhead, per_seq = overhead * sharing["gen_share"], per_seq * sharing["gen_share"]

    gens = tl[tl["role"] == "generator"]
    loads = max(1, int((gens["event"] == "load").sum()))
    sync_s = gens[gens["event"].isin(["sync", "load"])]["duration"].sum() / loads
    per_trainer = _computed_tokens(metrics) / cfg.cluster.n_trainers
    waited = sharing.pop("train_wait_s") / cfg.cluster.n_trainers
    train_rate = float(per_trainer.sum() / max(metrics["t_train"].sum() - waited, 1e-9))
    cost = CostModel(
        name=f"calibrated:{run.root.name}",
        weight_bytes=0.0,
        kv_bytes_per_token=0.0,
        mem_bytes_per_s=1.0,
        step_overhead_s=overhead,
        seq_step_s=per_seq,
        prefill_tokens_per_s=math.inf,  # the step-time fit covers steps where requests joined
        train_tokens_per_s=train_rate,
        sync_s=sync_s,
    )
    groups = len(trajs.groupby("group_id")) if len(trajs) else 0
    rejected = int(summary.get("rejected_uniform", 0))
    measured = {
        "rl_wall_s": float(summary["rl_wall_s"]),
        "consumed_tokens_per_s": trained_span_tokens_per_s(run),
        # on cores of its own, as the engine's costs: the workers share the generator's host the same way
        # (in a run on a loaded host, scoring took 1.8x as long in the asynchronous run as in the synchronous one)
        "reward_s": _service_s(gens[gens["event"] == "reward"], cfg.reward.num_workers) * sharing["gen_share"],
        "p_uniform": rejected / groups if groups else 0.0,
        "prompt_len": int(round(trajs["prompt_len"].mean())) if len(trajs) else 16,
        **latencies,
    }
    sim = sim_config(
        cfg,
        cost,
        lengths=EmpiricalLengths(tuple(int(x) for x in trajs["gen_len"])),
        prompt_len=measured["prompt_len"],
        p_uniform=measured["p_uniform"],
        reward_s=measured["reward_s"],
        reward_workers=cfg.reward.num_workers,
        gen_slowdown=sharing["gen_slowdown"],
        train_slowdown=sharing["train_slowdown"],
        **latencies,
    )
    measured["cost"] = cost.to_dict()
    measured["core_sharing"] = sharing
    if overrides:
        sim = apply_overrides(sim, overrides)
    return sim, measured


def _computed_tokens(metrics: pd.DataFrame) -> pd.Series:
    """The tokens each version's training cost: its tokens, less the share of positions prefix sharing spared
    (train_tokens_computed over train_tokens_unshared; runs from before it computed every token)."""
    if "train_tokens_computed" not in metrics or "train_tokens_unshared" not in metrics:
        return metrics["tokens"]
    share = metrics["train_tokens_computed"] / metrics["train_tokens_unshared"].where(lambda x: x > 0)
    return metrics["tokens"] * share.fillna(1.0)


def trained_span_tokens_per_s(run_dir) -> float:
    """The last start's consumed tokens/s over the span the simulator models: from its starting weights
    published to the last version it trained. The summary's figure runs to the end of the run, so it also
    counts the final evaluation and the shutdown (on the emulated cluster the final evaluation's long answers
    add 8% to an 8-version run)."""
    run = RunDir(run_dir)
    summary = json.loads(run.summary.read_text())
    m = pd.read_csv(run.metrics)
    # the versions this start trained: a resumed run's row of its starting version, and every row before it,
    # are an earlier start's, with wall_s counted from that start's beginning
    m = m[m["version"] > summary.get("start_version", 0)].drop_duplicates("version", keep="last")
    # the span begins at this start's publish of its starting weights (wall_s counts from its beginning, t0)
    published = float(summary["wall_s"]) - float(summary["rl_wall_s"])
    span = float(m["wall_s"].iloc[-1]) - published if len(m) else 0.0
    if span <= 0:
        return float(summary["consumed_tokens_per_s"])  # a start that trained nothing: the run's figure
    return float(m["tokens"].sum() / span)


def _latencies(tl: pd.DataFrame) -> dict[str, float]:
    """What rank 0's relaying costs, from the timeline (medians over versions): trainer 0's start of
    loading a batch after it was ready, apart for batches it waited for (from the last shard written)
    and batches that waited for it (from the end of its previous training or publish); a trained
    version to the generators' start of receiving it, which includes trainer 0's own publish time
    (the mean)."""
    t0 = tl[tl["role"] == "trainer"]
    t0 = t0[t0["rank"] == t0["rank"].min()]
    loads = t0[t0["event"] == "load"].sort_values("t_start")
    trains = t0[t0["event"] == "train"].sort_values("t_end")
    free = t0[t0["event"].isin(["train", "sync"])]["t_end"].to_numpy()
    writes = tl[(tl["role"] == "generator") & (tl["event"] == "write")]["t_end"].sort_values().to_numpy()
    waited, asked = [], []
    for t_load in loads["t_start"]:
        written, freed = writes[writes <= t_load], free[free <= t_load]
        if len(written) and len(freed):
            (waited if written[-1] > freed.max() else asked).append(t_load - max(written[-1], freed.max()))
    syncs = tl[(tl["role"] == "generator") & (tl["event"] == "sync")]["t_start"].to_numpy()
    publish = []
    for t_end in trains["t_end"]:
        after = syncs[syncs >= t_end]
        if len(after):
            publish.append(after.min() - t_end)
    own = t0[t0["event"] == "sync"]["duration"]
    med = lambda xs: float(np.median(xs)) if len(xs) else 0.0  # noqa: E731
    # a run that saw only one kind (a synchronous run never has a batch waiting) lends it to the other
    batch, ask = med(waited or asked), med(asked or waited)
    # the publish is the mean: when generators are still loading the previous version, it waits for them
    own_s = float(own.mean()) if len(own) else 0.0
    return {"batch_latency_s": batch, "ask_latency_s": ask, "publish_latency_s": med(publish), "publish_s": own_s}


# config key -> the SimConfig field it sets (what a calibrated model may be asked about)
SIM_KEYS = {
    "rollout.eta": "eta",
    "rollout.batch_prompts": "batch_prompts",
    "rollout.n_samples": "n_samples",
    "rollout.weight_update": "weight_update",
    "rollout.max_num_seqs": "capacity",
    "rollout.max_concurrent_groups": "max_groups",
    "cluster.n_generators": "n_generators",
    "cluster.n_trainers": "n_trainers",
    "trainer.versions": "versions",
    "trainer.share_prefixes": "share_prefixes",
    "trainer.share_min_tokens": "share_min_tokens",
    "trainer.max_tokens_per_mb": "max_tokens_per_mb",
}


def apply_overrides(sim: SimConfig, overrides: list[str]) -> SimConfig:
    """The model with some of the loop's numbers changed (`rollout.eta=4`, ...), checked as the run config is."""
    fields = {}
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep or key not in SIM_KEYS:
            raise ValueError(f"override {ov!r}: the simulator can change {', '.join(sorted(SIM_KEYS))} (as key=value)")
        load_config(None, [ov, "model.path=unused"])  # the same one-line error a run would give
        fields[SIM_KEYS[key]] = yaml.safe_load(value)
    return replace(sim, **fields)
