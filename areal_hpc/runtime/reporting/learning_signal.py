"""Groups without a learning signal (all rewards equal), counted by value: when a run cannot learn. Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

WARNING = "no learning signal"  # how the warning line starts (progress.json's warning, cleared when a streak ends)
WARN_BATCHES = 3  # batches' worth of such groups in a row before the run says so (the stop bound, if lower)
LIKELY_CAUSES = (
    "the reward (does it score these answers as you expect?), the warm start (trainer.warm_start_template, "
    "trainer.warm_start_steps: it may teach a form the reward never credits) or the prompt format "
    "(data.prompt_template, data.chat_template)"
)


def _values(counts: dict[float, int]) -> str:
    return "{" + ", ".join(f"{v!r}: {n}" for v, n in sorted(counts.items())) + "}"


@dataclass
class UniformGroups:
    """Counts finished groups whose samples all got the same reward (no advantage, nothing to learn from).

    `in_a_row` is the current streak of them (any group with a spread ends it); `untrained` the same streak
    since the last version trained (with ppo.drop_uniform_groups=false, versions train on such groups and
    learn nothing, but the run moves). A streak of `warn_after` is worth a warning, once per streak; a streak
    of `stop_after` with no version trained stops the run (0 = never)."""

    warn_after: int
    stop_after: int = 0
    by_value: dict[float, int] = field(default_factory=dict)  # every such group of the run, by its reward
    in_a_row: dict[float, int] = field(default_factory=dict)  # the current streak, by reward
    untrained: int = 0
    warned: bool = False
    stopped: bool = False

    @classmethod
    def for_run(cls, batch_prompts: int, max_uniform_batches: int) -> UniformGroups:
        """The bounds of a run: trainer.max_uniform_batches batches' worth to stop, WARN_BATCHES' worth to warn."""
        warn = min(WARN_BATCHES, max_uniform_batches or WARN_BATCHES)
        return cls(warn_after=warn * batch_prompts, stop_after=max_uniform_batches * batch_prompts)

    def group(self, value: float | None) -> str | None:
        """A finished group: the reward all its samples got, or None when they differ. Returns "warn" when the
        streak reaches warn_after, "stop" when the untrained streak reaches stop_after (each once), "clear" when
        a streak that was warned about ends, else None."""
        if value is None:
            was = self.warned
            self.in_a_row, self.untrained, self.warned = {}, 0, False
            return "clear" if was else None
        value = float(value)
        self.by_value[value] = self.by_value.get(value, 0) + 1
        self.in_a_row[value] = self.in_a_row.get(value, 0) + 1
        self.untrained += 1
        if self.stop_after and self.untrained >= self.stop_after and not self.stopped:
            self.stopped = True
            return "stop"
        if sum(self.in_a_row.values()) >= self.warn_after and not self.warned:
            self.warned = True
            return "warn"
        return None

    def version_trained(self) -> None:
        self.untrained = 0

    def warning_line(self) -> str:
        n = sum(self.in_a_row.values())
        return (
            f"{WARNING}: the last {n} groups each scored alike (rewards {_values(self.in_a_row)}), so "
            f"nothing is learned from them; likely causes: {LIKELY_CAUSES}"
        )

    def stop_line(self, max_uniform_batches: int) -> str:
        n = sum(self.in_a_row.values())
        since = "" if n == self.untrained else f" for the last {self.untrained} of them"
        return (
            f"the run cannot learn: {n} groups in a row each scored alike (rewards {_values(self.in_a_row)}) "
            f"and no version trained{since}; stopped by "
            f"trainer.max_uniform_batches={max_uniform_batches} (0 = never); likely causes: {LIKELY_CAUSES}"
        )

    def summary(self) -> dict[str, int]:
        """Every such group of the run by its reward, as JSON keeps it ({"0.0": 14719})."""
        return {repr(v): n for v, n in sorted(self.by_value.items())}

    def load(self, counts: dict) -> None:
        """A resumed run's counts so far (summary's form); streaks start again."""
        self.by_value = {float(v): int(n) for v, n in counts.items()}
