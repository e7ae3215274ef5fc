"""How many prompts a generator asks rank 0 for (pure): the runtime's generator and the simulator's share it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    """How many prompts to ask rank 0 for: as many groups as keep the engine full with one group queued beyond
    its slots, counting sequences (a group holds no slot for its finished samples); at most `max_groups` groups
    with a request in the engine or asked for."""

    n_samples: int
    capacity: int  # the engine's slots
    max_groups: int  # rollout.max_concurrent_groups resolved
    asked: int = 0  # prompts asked for and not granted yet

    def ask(self, sequences: int, groups_on_engine: int) -> int:
        """Prompts to ask for now (0: none), counted as asked; `sequences` are in the engine or held for it."""
        n = self.n_samples
        want = -(-(self.capacity + n - sequences - self.asked * n) // n)
        k = min(want, self.max_groups - groups_on_engine - self.asked)
        if k <= 0:
            return 0
        self.asked += k
        return k

    def granted(self, k: int) -> None:
        self.asked -= k
