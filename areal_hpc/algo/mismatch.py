"""How far the trainer's logprobs are from the sampler's: additive sums per piece, figures once merged (pure)."""

from __future__ import annotations

import math

import numpy as np

from areal_hpc.store.columns import as_columns

# what a metrics row shows, per token set (docs/algorithm.md, "Training-inference mismatch")
FIGURES = ("k1", "k3", "chi2", "log_ppl_diff", "max_ratio", "mult_prob_err", "ess", "tokens")
_SUMS = ("n", "n_seq", "neg_r", "k3", "rho", "rho2", "exp_abs_r", "seq_abs_r")


def gap_sums(behav_logp, train_logp, mask, seq) -> dict[str, float]:
    """Sums over the masked tokens that add across micro-batches and trainers (`max_abs_r` takes the max).

    r = train - behav per token (log of rho = pi_train / pi_behav), for tokens the behaviour policy sampled;
    `seq` names each token's sequence, for the per-sequence log-perplexity gap. r is clamped to +-20 so
    exp cannot overflow.
    """
    m = np.asarray(mask, dtype=bool)
    r = np.clip(np.asarray(train_logp, np.float64)[m] - np.asarray(behav_logp, np.float64)[m], -20.0, 20.0)
    out = dict.fromkeys(_SUMS, 0.0) | {"max_abs_r": 0.0}
    if r.size == 0:
        return out
    rho = np.exp(r)
    seq_ids = np.asarray(seq)[m]
    uniq, inverse = np.unique(seq_ids, return_inverse=True)
    per_seq = np.bincount(inverse, weights=r) / np.bincount(inverse)  # each sequence's mean log-ratio
    out.update(
        n=float(r.size),
        n_seq=float(len(uniq)),
        neg_r=float(-r.sum()),
        k3=float((np.expm1(r) - r).sum()),  # expm1: no cancellation at float-rounding gaps
        rho=float(rho.sum()),
        rho2=float((rho**2).sum()),
        exp_abs_r=float(np.exp(np.abs(r)).sum()),
        seq_abs_r=float(np.abs(per_seq).sum()),
        max_abs_r=float(np.abs(r).max()),
    )
    return out


def merge_sums(parts: list[dict]) -> dict[str, float]:
    """Several pieces' sums as one."""
    out = {k: float(sum(p.get(k, 0.0) for p in parts)) for k in _SUMS}
    out["max_abs_r"] = float(max((p.get("max_abs_r", 0.0) for p in parts), default=0.0))
    return out


def gap_figures(sums: dict) -> dict[str, float]:
    """The figures of merged sums; NaN where no token was measured (so a plot shows a gap, not a zero).

    k1 = mean(-r) and k3 = mean(rho - 1 - r): KL(behav || train); chi2 = mean(rho^2) - 1; log_ppl_diff: the
    mean over sequences of |mean_t r|; max_ratio = exp(max |r|); mult_prob_err = mean(exp |r|) (NeMo-RL's
    token_mult_prob_error); ess = (sum rho)^2 / (n sum rho^2), the effective sample size as a share.
    """
    n = sums.get("n", 0.0)
    if n <= 0:
        return {k: (0.0 if k == "tokens" else math.nan) for k in FIGURES}
    return {
        "k1": sums["neg_r"] / n,
        "k3": sums["k3"] / n,
        "chi2": sums["rho2"] / n - 1.0,
        "log_ppl_diff": sums["seq_abs_r"] / max(sums["n_seq"], 1.0),
        "max_ratio": math.exp(sums["max_abs_r"]),
        "mult_prob_err": sums["exp_abs_r"] / n,
        "ess": sums["rho"] ** 2 / (n * sums["rho2"]) if sums["rho2"] > 0 else math.nan,
        "tokens": n,
    }


# -- one version's measurement, as a trainer reports it and rank 0 writes it ---------------------------------
# mismatch: the tokens of staleness-0 trajectories (every token sampled by the very weights measured, over a KV
# cache those weights computed: numeric mismatch alone); offpolicy: every loss token (mismatch plus staleness)
SETS = ("mismatch", "offpolicy")
_KEY = "{}_sums/{}"  # flat float keys, so a trainer's stats stay a flat dict of numbers wherever they travel


def version_sums(trajectories, train_logp, version: int) -> dict[str, float]:
    """A trainer's sums of one version, as flat stats keys `<set>_sums/<sum>`.

    `trajectories`: columns (areal_hpc.store.columns) or Trajectory records; `train_logp[i]`: sequence i's per-token
    logprobs under the weights of `version` (the version before the step). A token counts as staleness 0 when
    its whole trajectory is (`version_start == version`): a token of `version` in a trajectory begun on older
    weights was sampled over keys and values those computed (`rollout.weight_update=keep_kv`), a gap that is
    not numeric. No trajectories: zero sums (an empty share).
    """
    c = as_columns(trajectories)
    if len(train_logp) != len(c):
        raise ValueError(f"version_sums: {len(train_logp)} logprob arrays for {len(c)} sequences")
    lens = c.lengths
    tr = np.concatenate([np.asarray(lp, np.float64) for lp in train_logp]) if len(c) else np.zeros(0)
    loss = c.tokens["loss_mask"] > 0
    fresh = loss & (c.tokens["versions"] == version) & np.repeat(c.seqs["version_start"] == version, lens)
    b, s = c.tokens["behav_logprobs"].astype(np.float64), np.repeat(np.arange(len(c)), lens)
    out = {}
    for name, mask in zip(SETS, (fresh, loss), strict=True):
        out |= {_KEY.format(name, k): v for k, v in gap_sums(b, tr, mask, s).items()}
    return out


def row_columns(stats: list[dict]) -> dict[str, float]:
    """The metrics row's `mismatch_<figure>` and `offpolicy_<figure>` from the trainers' stats, their sums merged.

    A figure without a token to measure (no staleness-0 token this version) is left out: an empty cell in
    metrics.csv, no point in TensorBoard. None of the stats carrying sums (the emulated trainer): no columns.
    """
    out: dict[str, float] = {}
    for name in SETS:
        prefix = _KEY.format(name, "")
        parts = [{k[len(prefix) :]: v for k, v in s.items() if k.startswith(prefix)} for s in stats]
        if not any(parts):
            continue
        figures = gap_figures(merge_sums([p for p in parts if p]))
        out |= {f"{name}_{k}": v for k, v in figures.items() if not math.isnan(v)}
    return out


def without_sums(stats: dict) -> dict:
    """The stats less the sums (what the synchronous loop copies into its row)."""
    return {k: v for k, v in stats.items() if not any(k.startswith(_KEY.format(n, "")) for n in SETS)}
