"""The comparisons users ask of runs, each as a DataFrame: speedup, staleness, utilisation, learning curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from areal_hpc.analysis.runs import Run, as_runs

# the spans that are a role's own work; others (a group's lifetime, its scoring, an evaluation in the
# stream) overlap these and would count twice
BUSY_EVENTS = {"generator": ("generate",), "trainer": ("train",), "scheduler": ()}


def _final(r: Run, key: str):
    if key in r.summary:
        return r.summary[key]
    col = r.metrics.get(key)
    return None if col is None or col.dropna().empty else col.dropna().iloc[-1]


def time_to_accuracy(r: Run, target: float) -> float:
    """Wall seconds at the first version whose held-out accuracy reached `target` (NaN if none did)."""
    m = r.metrics
    if "heldout_acc" not in m:
        return float("nan")
    hit = m[m["heldout_acc"] >= target]
    return float(hit["wall_s"].iloc[0]) if len(hit) else float("nan")


def speedup_table(runs, baseline=None, target_acc: float | None = None) -> pd.DataFrame:
    """One row per run: throughput, RL wall time, final accuracy and, with `target_acc`, wall time to
    reach it; the `*_speedup` columns are ratios to `baseline` (a run, its path or name; default the first).

    Throughput is consumed tokens per second of RL (summary.json), so runs of different lengths compare.
    """
    runs = as_runs(runs)
    if not runs:
        raise ValueError("speedup_table needs at least one run")
    rows = []
    for r in runs:
        row = {
            "run": r.name,
            "versions": r.summary.get("versions", len(r.metrics)),
            "eta": r.config.get("rollout.eta"),
            "consumed_tokens_per_s": _final(r, "consumed_tokens_per_s"),
            "rl_wall_s": r.summary.get("rl_wall_s"),
            "acc_final": r.summary.get("acc_final"),
            # the mean reward of the same evaluation (None for runs from before it was logged)
            "heldout_reward_mean_final": r.summary.get("heldout_reward_mean_final"),
        }
        if target_acc is not None:
            row["time_to_target_s"] = time_to_accuracy(r, target_acc)
        rows.append(row)
    t = pd.DataFrame(rows).set_index("run")
    base = _baseline_name(runs, baseline)
    t["throughput_speedup"] = t["consumed_tokens_per_s"].astype(float) / float(t.loc[base, "consumed_tokens_per_s"])
    if target_acc is not None:
        t["time_to_target_speedup"] = float(t.loc[base, "time_to_target_s"]) / t["time_to_target_s"].astype(float)
    t.attrs["baseline"], t.attrs["target_acc"] = base, target_acc
    return t


def _baseline_name(runs: list[Run], baseline) -> str:
    if baseline is None:
        return runs[0].name
    if isinstance(baseline, Run):
        return baseline.name
    names = {r.name for r in runs}
    if str(baseline) in names:
        return str(baseline)
    for r in runs:
        if r.path.resolve() == Path(baseline).resolve():
            return r.name
    raise ValueError(f"baseline {baseline!r} is none of the runs ({sorted(names)})")


def staleness_distribution(runs) -> pd.DataFrame:
    """Consumed trajectories per (run, staleness): how many versions behind the weights that trained on them."""
    frames = []
    for r in as_runs(runs):
        eaten = r.trajectories[r.trajectories["consumed_version"] >= 0]
        counts = eaten["staleness"].astype(int).value_counts().sort_index()
        frames.append(
            pd.DataFrame({"run": r.name, "staleness": counts.index, "trajectories": counts.to_numpy()}).assign(
                share=lambda d: d.trajectories / max(1, d.trajectories.sum())
            )
        )
    cols = ["run", "staleness", "trajectories", "share"]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


def utilisation(run, bin_s: float = 1.0) -> pd.DataFrame:
    """Busy share per role over time: for each `bin_s` window since the run's first event, the fraction
    its ranks of that role spent in their own work (generate, train), averaged over the role's ranks."""
    (r,) = as_runs([run])
    tl = r.timeline
    if tl.empty:
        return pd.DataFrame(columns=["t", "role", "ranks", "busy"])
    t0, t1 = tl["t_start"].min(), tl["t_end"].max()
    edges = np.arange(0.0, t1 - t0 + bin_s, bin_s)
    lo, hi = edges[:-1], edges[1:]
    rows = []
    for role, events in BUSY_EVENTS.items():
        ranks = tl.loc[tl["role"] == role, "rank"].unique()
        if not len(ranks) or not events:
            continue
        spans = tl[(tl["role"] == role) & tl["event"].isin(events)]
        s, e = spans["t_start"].to_numpy() - t0, spans["t_end"].to_numpy() - t0
        # overlap of every span with every bin, summed per bin
        cover = np.clip(np.minimum(e[:, None], hi[None, :]) - np.maximum(s[:, None], lo[None, :]), 0, None).sum(0)
        rows.append(pd.DataFrame({"t": lo, "role": role, "ranks": len(ranks), "busy": cover / (bin_s * len(ranks))}))
    return pd.concat(rows, ignore_index=True)


def learning_curves(runs) -> pd.DataFrame:
    """Reward, held-out accuracy and held-out mean reward per (run, version), with the wall time at that version."""
    frames = []
    for r in as_runs(runs):
        m = r.metrics
        frames.append(
            pd.DataFrame(
                {
                    "run": r.name,
                    "version": m["version"],
                    "wall_s": m["wall_s"],
                    "reward_mean": m.get("reward_mean", np.nan),
                    "heldout_acc": m.get("heldout_acc", np.nan),
                    "heldout_reward_mean": m.get("heldout_reward_mean", np.nan),  # NaN in runs from before it
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def mismatch_curves(runs) -> pd.DataFrame:
    """The training-inference gap per (run, version, tokens): `tokens` is `mismatch` (staleness-0 tokens: numeric
    mismatch alone) or `offpolicy` (every loss token: mismatch plus staleness); the figures as metrics.csv has
    them (docs/algorithm.md, "Training-inference mismatch"), NaN where a version measured no such token."""
    from areal_hpc.algo.mismatch import FIGURES, SETS

    frames = []
    for r in as_runs(runs):
        m = r.metrics
        for name in SETS:
            if f"{name}_tokens" not in m:
                continue  # a run from before the gap was measured, or an emulated trainer
            cols = {k: m.get(f"{name}_{k}", np.nan) for k in FIGURES if k != "tokens"}
            frame = pd.DataFrame({"run": r.name, "version": m["version"], "tokens": name, **cols})
            frames.append(frame.assign(n_tokens=m[f"{name}_tokens"]).dropna(subset=["n_tokens"]))
    cols = ["run", "version", "tokens", *[k for k in FIGURES if k != "tokens"], "n_tokens"]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


SHARING = ("train_tokens_computed", "train_tokens_unshared")


def prefix_sharing(runs) -> pd.DataFrame:
    """Per (run, version): the token positions the trainers computed and those they stand for (without prefix
    sharing), and `saved`, the share not computed; runs from before they were counted are left out."""
    frames = []
    for r in as_runs(runs):
        m = r.metrics
        if not set(SHARING) <= set(m):
            continue
        f = pd.DataFrame({"run": r.name, "version": m["version"], **{k: m[k] for k in SHARING}}).dropna()
        frames.append(f.assign(saved=1 - f[SHARING[0]] / f[SHARING[1]].where(f[SHARING[1]] > 0)))
    cols = ["run", "version", *SHARING, "saved"]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


def prefix_sharing_totals(per_version: pd.DataFrame) -> pd.DataFrame:
    """One row per run of `prefix_sharing`: its positions over every version, and the share saved."""
    t = per_version.groupby("run", sort=False)[list(SHARING)].sum()
    return t.assign(saved=1 - t[SHARING[0]] / t[SHARING[1]].where(t[SHARING[1]] > 0))
