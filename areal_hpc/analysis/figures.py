"""Matplotlib figures, each made from the DataFrame one function of `analysis.tables` returns."""

from __future__ import annotations

import pandas as pd


def _figure(ncols: int = 1, width: float = 6.0, height: float = 3.5):
    """A Figure outside pyplot: no backend is chosen or changed (a login node has no display, a user's
    session keeps its own); notebooks display it, and savefig writes it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height))
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def speedup_figure(table: pd.DataFrame):
    """Bars of throughput (and time to the target accuracy) relative to the baseline, from `speedup_table`."""
    cols = [c for c in ("throughput_speedup", "time_to_target_speedup") if c in table]
    fig, axes = _figure(len(cols))
    titles = {
        "throughput_speedup": "consumed tokens/s vs baseline",
        "time_to_target_speedup": f"time to accuracy {table.attrs.get('target_acc')} vs baseline",
    }
    for ax, col in zip(axes, cols, strict=True):
        table[col].plot.barh(ax=ax, color="tab:blue")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(titles[col])
        ax.set_xlabel(f"x {table.attrs.get('baseline', 'baseline')}")
    fig.tight_layout()
    return fig


def staleness_figure(dist: pd.DataFrame):
    """Share of consumed trajectories per staleness, one group of bars per run, from `staleness_distribution`."""
    fig, (ax,) = _figure()
    dist.pivot_table(index="staleness", columns="run", values="share", fill_value=0).plot.bar(ax=ax)
    ax.set_xlabel("versions behind the weights that trained on it")
    ax.set_ylabel("share of consumed trajectories")
    ax.set_title("staleness")
    fig.tight_layout()
    return fig


def utilisation_figure(util: pd.DataFrame, title: str = "busy share per role"):
    """Each role's busy share over time, from `utilisation`."""
    fig, (ax,) = _figure(width=8)
    util.pivot_table(index="t", columns="role", values="busy").plot(ax=ax, ylim=(0, 1.05))
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("busy share")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def learning_figure(curves: pd.DataFrame, x: str = "wall_s"):
    """Reward and held-out accuracy against wall time (or `x="version"`), one line per run, from `learning_curves`."""
    fig, axes = _figure(2)
    for ax, y in zip(axes, ("reward_mean", "heldout_acc"), strict=True):
        for run, c in curves.groupby("run", sort=False):
            c = c.dropna(subset=[y])
            line = ax.plot(c[x], c[y], marker="o" if y == "heldout_acc" else None, label=run)[0]
            r = c.dropna(subset=["heldout_reward_mean"]) if "heldout_reward_mean" in c else c.iloc[:0]
            if y == "heldout_acc" and len(r):  # partial credit shows as the gap between the two
                ax.plot(r[x], r["heldout_reward_mean"], ls="--", color=line.get_color(), label=f"{run} mean reward")
        ax.set_xlabel({"wall_s": "wall seconds", "version": "version"}.get(x, x))
        title = {"reward_mean": "batch reward", "heldout_acc": "held-out accuracy (dashed: mean reward)"}
        ax.set_title(title[y])
        ax.legend()
    fig.tight_layout()
    return fig


def mismatch_figure(curves: pd.DataFrame):
    """k3 KL and the effective sample size per version, from `mismatch_curves`: solid over staleness-0 tokens
    (numeric mismatch), dashed over every loss token (mismatch plus staleness), one colour per run."""
    fig, axes = _figure(2)
    titles = {"k3": "k3 KL(behaviour || trainer)", "ess": "effective sample size (share)"}
    for ax, y in zip(axes, ("k3", "ess"), strict=True):
        colours: dict = {}
        for (run, tokens), c in curves.groupby(["run", "tokens"], sort=False):
            c = c.dropna(subset=[y])
            style = {"ls": "-" if tokens == "mismatch" else "--", "color": colours.get(run)}
            line = ax.plot(c["version"], c[y], label=f"{run} {tokens}", **style)[0]
            colours.setdefault(run, line.get_color())
        if y == "k3" and len(curves) and (curves[y].dropna() > 0).all():
            ax.set_yscale("log")  # the two sets sit orders of magnitude apart
        ax.set_xlabel("version")
        ax.set_title(titles[y])
        ax.legend()
    fig.tight_layout()
    return fig


def prefix_sharing_figure(per_version: pd.DataFrame):
    """The share of token positions the trainers did not compute thanks to prefix sharing, per version, one
    line per run, from `prefix_sharing`."""
    fig, (ax,) = _figure()
    for run, c in per_version.groupby("run", sort=False):
        ax.plot(c["version"], c["saved"], marker="o", label=run)
    ax.set_xlabel("version")
    ax.set_ylabel("share of token positions saved")
    ax.set_ylim(bottom=0)
    ax.set_title("prefix sharing in the trainers")
    ax.legend()
    fig.tight_layout()
    return fig
