"""One metrics row per version, built from its parts (trainers' stats, sync, weight loads, evaluation), in order."""

from __future__ import annotations

import math

from areal_hpc.algo import mismatch

# stats a trainer reports per token of loss, averaged over trainers weighted by their loss tokens
_PER_LOSS_TOKEN = ("clip_frac", "ratio_mean", "behav_w_mean", "capped_frac", "entropy")
# where the objective has them
_OBJECTIVE_TERMS = ("kl", "distill_kl", "entropy_bonus", "seq_ratio_mean", "truncated_frac", "seq_rejected_frac")


def trainers_columns(stats: list[dict]) -> dict:
    """A version's columns from every trainer's stats (TRAIN_DONE's `stats`), merged as one trainer's would be."""
    s = stats
    n = sum(x["samples"] for x in s)
    w = sum(x.get("loss_tokens", 0) for x in s) or 1
    row = {
        "reward_mean": sum(x["reward_sum"] for x in s) / max(n, 1),
        "samples": n,
        "tokens": sum(x["tokens"] for x in s),
        "gen_tokens": sum(x["gen_tokens"] for x in s),
        "staleness_mean": sum(x["staleness_sum"] for x in s) / max(n, 1),
        "staleness_max": max(x["staleness_max"] for x in s),
        "interrupted": sum(x["interrupted"] for x in s),
        "groups_kept": sum(x["groups_kept"] for x in s),
        "t_train": max(x["t_train"] for x in s),
        "loss": sum(x.get("loss", 0.0) for x in s),
        "grad_norm": s[0].get("grad_norm", math.nan),
        # share of the token positions the trainers' forwards computed that were padding
        "pad_frac": sum(x.get("fwd_padding", 0) for x in s) / max(sum(x.get("fwd_positions", 0) for x in s), 1),
    }
    for k in _PER_LOSS_TOKEN:
        row[k] = sum(x.get(k, 0.0) * x.get("loss_tokens", 0) for x in s) / w
    for k in _OBJECTIVE_TERMS:  # only the terms this objective has
        if any(k in x for x in s):
            row[k] = sum(x.get(k, 0.0) * x.get("loss_tokens", 0) for x in s) / w
    # the training-inference gap: each trainer's sums merged, then the figures (docs/algorithm.md)
    row |= mismatch.row_columns(s)
    for k in ("train_tokens_computed", "train_tokens_unshared"):  # trainers that count them: prefix sharing
        if any(k in x for x in s):
            row[k] = sum(x.get(k, 0) for x in s)
    if "lr" in s[0]:
        row["lr"] = s[0]["lr"]
    if any("overlong_penalty" in x for x in s):
        row["overlong_penalty"] = sum(x.get("overlong_penalty", 0.0) * x["samples"] for x in s) / max(n, 1)
    return row


def sync_columns(body: dict) -> dict:
    """Trainer 0's SYNC_DONE of a version."""
    gbps = body["bytes"] / max(body["sync_s"], 1e-9) / 1e9
    row = {"sync_s": body["sync_s"], "sync_bytes": body["bytes"], "sync_gbps": gbps}
    if body["checksum"] is not None:
        row["checksum_trainer"] = body["checksum"]
    return row


def eval_columns(body: dict) -> dict:
    """A periodic held-out evaluation's EVAL_RESULT; none when it was superseded before it ran."""
    if body["acc"] is None:
        return {}
    # the weights its tokens came from: an evaluation that spans a weight load ends on the newer
    return {
        "heldout_acc": body["acc"],
        "heldout_reward_mean": body["reward_mean"],
        "heldout_tool_share": body["tool_share"],
        "heldout_version": body["version"],
        "heldout_version_end": body["version_end"],
        "heldout_cut": body["cut"],
    }


class VersionRows:
    """Rows being assembled: a version's parts arrive in any order from different ranks; its row is complete once
    trained and every part it waits for is in, and rows leave in version order."""

    def __init__(self, n_generators: int):
        self.n_generators = n_generators
        self.rows: dict[int, dict] = {}  # version -> metrics row being assembled
        self.awaited: dict[int, set] = {}  # version -> parts the row still waits for
        self.arrived: dict[int, set] = {}  # version -> parts that arrived

    def expect(self, v: int, parts: set) -> None:
        """The row of version v waits for these parts (sync, weight loads, eval)."""
        self.awaited.setdefault(v, set()).update(parts - self.arrived.setdefault(v, set()))

    def add(self, v: int, values: dict) -> None:
        """Columns of version v's row that belong to no awaited part."""
        self.rows.setdefault(v, {}).update(values)

    def part_arrived(self, v: int, part: str, values: dict | None = None) -> None:
        self.add(v, values or {})
        self.arrived.setdefault(v, set()).add(part)
        self.awaited.setdefault(v, set()).discard(part)

    def trained_rows(self, upto: int) -> dict[str, dict]:
        """The rows of trained versions up to `upto` not written yet (a checkpoint keeps them)."""
        return {str(v): r for v, r in self.rows.items() if v <= upto and "train" in self.arrived.get(v, ())}

    def take_complete(self, force: bool = False) -> list[tuple[int, dict]]:
        """Complete rows, in version order up to the first incomplete one (every row with `force`), each with
        `weights_match` once the trainer's and every generator's checksums are in."""
        out = []
        for v in sorted(self.rows):
            done = "train" in self.arrived.get(v, set()) and not self.awaited.get(v)
            if not (done or force):
                break
            row = self.rows.pop(v)
            self.awaited.pop(v, None)
            self.arrived.pop(v, None)
            gens = [row.get(f"checksum_gen{i}") for i in range(self.n_generators)]
            if "checksum_trainer" in row and all(g is not None for g in gens):
                row["weights_match"] = int(all(g == row["checksum_trainer"] for g in gens))
            out.append((v, row))
        return out
