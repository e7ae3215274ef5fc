"""The simulator: a discrete-event model of the asynchronous loop (loop.py), fitted to real runs (calibrate.py)."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
from tqdm import tqdm

from areal_hpc.costmodel import EmpiricalLengths
from areal_hpc.simulate.calibrate import SIM_KEYS, apply_overrides, calibrate, sim_config, trained_span_tokens_per_s
from areal_hpc.simulate.loop import SimConfig, simulate
from areal_hpc.simulate.result import SimResult


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """'rollout.eta=0,1,2' -> ('rollout.eta', ['0', '1', '2'])."""
    key, sep, values = spec.partition("=")
    if not sep or not values or key not in SIM_KEYS:
        raise ValueError(f"--sweep {spec!r} must be KEY=V1,V2,... with KEY one of {', '.join(sorted(SIM_KEYS))}")
    return key, [v for v in values.split(",") if v]


def with_prompts(sim: SimConfig, prompt_tokens: int | None = None, shared_tokens: int | None = None) -> SimConfig:
    """The model with prompts of `prompt_tokens` tokens whose first `shared_tokens` every sample of a group
    shares (an agent's preamble; default the whole prompt): the numbers `simulate` takes beside the config."""
    if prompt_tokens is not None and prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens {prompt_tokens}: a prompt has at least 1 token")
    prompt = sim.prompt_len if prompt_tokens is None else prompt_tokens
    if shared_tokens is not None and not 0 <= shared_tokens <= prompt:
        raise ValueError(
            f"--shared-prefix-tokens {shared_tokens}: the shared prefix is part of the prompt, 0 to {prompt}"
        )
    return replace(sim, prompt_len=prompt, shared_prefix_len=shared_tokens)


def sweep(sim: SimConfig, key: str, values: list[str], progress: bool = True) -> pd.DataFrame:
    """One simulated run per value of `key`; a row of figures each."""
    rows = []
    for v in tqdm(values, desc=f"simulating {key}", disable=not progress, leave=False):
        r = simulate(apply_overrides(sim, [f"{key}={v}"]))
        rows.append({key: v, **r.row()})
    return pd.DataFrame(rows)


def sweep_figure(table: pd.DataFrame, key: str):
    """Consumed tokens/s against the swept value (a matplotlib Figure, made outside pyplot)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2))
    ax = fig.add_subplot()
    ax.plot(table[key].astype(str), table["consumed_tokens_per_s"], marker="o")
    ax.set_xlabel(key)
    ax.set_ylabel("consumed tokens/s (simulated)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


__all__ = [
    "EmpiricalLengths",
    "SimConfig",
    "SimResult",
    "apply_overrides",
    "calibrate",
    "parse_sweep",
    "sim_config",
    "simulate",
    "sweep",
    "sweep_figure",
    "trained_span_tokens_per_s",
    "with_prompts",
]
