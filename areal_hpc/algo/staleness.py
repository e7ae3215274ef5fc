"""AReaL's staleness admission rule as a small pure object (counts are in prompts, i.e. groups)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessGate:
    """Admits new prompts only while accepted + running + k <= (v + eta + 1) * B.

    `accepted` counts prompts whose groups finished (consumed or waiting to be consumed), `running`
    those granted to generators and not finished yet, v the current policy version and B the number
    of prompts per training step. eta = 0 is the synchronous baseline. `max_running` optionally caps
    the number of prompts in flight.
    """

    batch_prompts: int
    eta: int
    max_running: int | None = None
    version: int = 0
    accepted: int = 0
    running: int = 0

    def capacity(self) -> int:
        """How many more prompts may be admitted now."""
        room = (self.version + self.eta + 1) * self.batch_prompts - self.accepted - self.running
        if self.max_running is not None:
            room = min(room, self.max_running - self.running)
        return max(0, room)

    def admit(self, k: int) -> int:
        """Admit up to k prompts; returns how many were admitted."""
        n = min(k, self.capacity())
        self.running += n
        return n

    def finish(self, k: int = 1) -> None:
        """k admitted prompts finished generating (their groups are now ready)."""
        if k > self.running:
            raise ValueError(f"finish({k}) with only {self.running} running")
        self.running -= k
        self.accepted += k

    def discard(self, k: int = 1) -> None:
        """k finished prompts will never be trained on (too stale); their slots return."""
        if k > self.accepted:
            raise ValueError(f"discard({k}) with only {self.accepted} accepted")
        self.accepted -= k

    def drop(self, k: int = 1) -> None:
        """k running prompts were given up (e.g. a generator died); they free their slots."""
        self.running -= min(k, self.running)

    def set_version(self, v: int) -> None:
        self.version = v
