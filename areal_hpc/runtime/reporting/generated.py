"""Rank 0's account of every episode generated for training, whatever became of its group (kept, rejected, stale)."""

from __future__ import annotations

from areal_hpc.count_schema import GENERATED, GROUP_COUNTS, PER_EPISODE


class GeneratedEpisodes:
    """Adds up the counts each GROUPS_DONE group carries (episode_counts.group_counts): over the run (summary.json,
    progress.json) and since the last metrics row, with the mean of each logged number per row. The schema's
    "generated" counts (count_schema) are summed per row and over the run; its per-episode ones averaged."""

    def __init__(self, total: dict | None = None):
        self.total = dict.fromkeys(GROUP_COUNTS, 0) | {"failure_kinds": {}} | (total or {})
        self.since = dict.fromkeys(GROUP_COUNTS, 0)
        self.logged: dict[str, list[float]] = {}  # name -> [sum, episodes] since the last row

    def add(self, group: dict) -> None:
        """A group's counts, taken out of its GROUPS_DONE entry."""
        for k in GROUP_COUNTS:
            n = group.pop(k)
            self.total[k] += n
            self.since[k] += n
        kinds = self.total["failure_kinds"]
        for kind, n in group.pop("failure_kinds").items():
            kinds[kind] = kinds.get(kind, 0) + n
        for name, (total, n) in group.pop("logged").items():
            acc = self.logged.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += n

    def row(self) -> dict:
        """The next metrics row's columns (episodes since the previous row), and a fresh start for the next."""
        row = self._sums(self.since)
        row |= {name: total / n for name, (total, n) in sorted(self.logged.items()) if n}
        self.since = dict.fromkeys(GROUP_COUNTS, 0)
        self.logged = {}
        return row

    def totals(self) -> dict:
        """The run's sums so far (progress.json): episodes_generated and each "generated" count."""
        return self._sums(self.total)

    def summary(self) -> dict:
        """summary.json's (and progress.json's) keys for the training episodes of the whole run. `after_last_row`:
        the counts of groups that arrived after the last metrics row (a run's last groups, never trained on), so
        that each count is the sum of its metrics.csv column plus its entry there."""
        t, n = self.total, max(self.total["episodes"], 1)
        return {
            "after_last_row": self._sums(self.since),
            **self.totals(),
            "agent_failures_by_kind": dict(t["failure_kinds"]),  # raised, timed out, bad result
            **{f"{k}_per_episode": t[k] / n if t["episodes"] else None for k in PER_EPISODE},
        }

    @staticmethod
    def _sums(counts: dict) -> dict:
        return {"episodes_generated": counts["episodes"]} | {k: counts[k] for k in GENERATED}
