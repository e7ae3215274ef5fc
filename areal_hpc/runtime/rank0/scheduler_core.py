"""Rank 0's bookkeeping without MPI: dataset cursor, staleness admission, ready queue, batch assembly."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

from areal_hpc.algo.packing import balance_across_ranks
from areal_hpc.algo.staleness import StalenessGate
from areal_hpc.data.order import PromptOrder


@dataclass
class ReadyGroup:
    """A finished group as announced by a generator: where its n trajectories live and a summary."""

    shard: str
    indices: list[int]  # trajectory indices inside the shard
    prompt_id: int
    group_id: int
    n_tokens: int
    version_start: int  # oldest policy version among the group's tokens


@dataclass
class BatchPlan:
    """What one training version consumes: groups split into PPO minibatches, each split across trainers.

    Minibatches are formed over the whole batch before the split, so T trainers take exactly the
    optimizer steps one trainer would (a per-trainer split would change what each step sees).
    """

    version: int
    groups: list[ReadyGroup]
    shares: list[list[list[int]]]  # [trainer][minibatch] -> indices into `groups`

    def entries(self) -> list[tuple[str, int]]:
        return [(g.shard, i) for g in self.groups for i in g.indices]


def fair_shares(wants: dict[int, int], capacity: int) -> dict[int, int]:
    """Split `capacity` prompts among generators in proportion to what each asked for (its free capacity).

    Largest remainder; ties go to the larger want, then the lower rank. When there is enough for
    everyone, everyone gets what it asked for.
    """
    wants = {g: w for g, w in wants.items() if w > 0}
    total = sum(wants.values())
    if total <= capacity:
        return dict(wants)
    shares = {g: capacity * w // total for g, w in wants.items()}
    left = capacity - sum(shares.values())
    for g in sorted(wants, key=lambda g: (-(capacity * wants[g] % total), -wants[g], g))[:left]:
        shares[g] += 1
    return shares


@dataclass
class SchedulerCore:
    """Pure state machine the MPI scheduler drives; its state_dict is the scheduler's checkpoint.

    Prompts are granted in a seeded shuffled order, epoch after epoch. A finished group with no
    learning signal (all rewards equal) is rejected when `reject_uniform`: its slot returns and it is
    never accepted, so every batch holds B informative groups (dynamic sampling with refill). Ready
    groups are queued by the oldest version among their tokens and consumed oldest first, so a late
    group is not overtaken until it turns stale; a group whose oldest token is more than eta versions
    behind the version it would train is dropped (counted) and its slot returned, so the staleness
    bound holds even for a group that outlived it (a slow generator under eta >= 1).
    """

    n_prompts: int
    batch_prompts: int
    eta: int
    n_trainers: int = 1
    n_minibatches: int = 1
    max_running: int | None = None
    seed: int = 0
    reject_uniform: bool = False
    cursor: int = 0
    dropped_stale: int = 0
    dropped_ids: list = field(default_factory=list)  # group ids dropped as too stale
    rejected: int = 0  # groups rejected for carrying no learning signal
    ready: list = field(default_factory=list)  # ReadyGroups ordered by version_start, then arrival
    gate: StalenessGate | None = None

    def __post_init__(self):
        if self.n_prompts <= 0:
            raise ValueError(f"scheduler needs at least one training prompt, got {self.n_prompts}")
        if self.gate is None:
            self.gate = StalenessGate(self.batch_prompts, self.eta, self.max_running)
        self._order = PromptOrder(self.n_prompts, self.seed)  # the sync loop draws in the same order

    @property
    def version(self) -> int:
        return self.gate.version

    def grant(self, k: int) -> list[int]:
        """Admit up to k prompts now; returns their dataset indices (may be empty)."""
        n = self.gate.admit(k)
        out = [self._order.at(self.cursor + i) for i in range(n)]
        self.cursor += n
        return out

    def group_done(self, group: ReadyGroup, uniform: bool = False) -> bool:
        """A granted group finished; False if it was rejected (uniform rewards under reject_uniform)."""
        if uniform and self.reject_uniform:
            self.gate.drop(1)  # its slot is free for a new prompt, and it never counts as accepted
            self.rejected += 1
            return False
        self.gate.finish(1)
        bisect.insort(self.ready, group, key=lambda g: g.version_start)  # after groups of the same version
        return True

    def next_batch(self) -> BatchPlan | None:
        """The next training batch if B fresh-enough groups are ready, else None."""
        fresh = []
        for g in self.ready:
            if self.version - g.version_start > self.eta:
                # too old already; it only gets older, so drop it now and return its slot
                self.dropped_stale += 1
                self.dropped_ids.append(g.group_id)
                self.gate.discard(1)
            else:
                fresh.append(g)
        self.ready = fresh
        if len(self.ready) < self.batch_prompts:
            return None
        groups, self.ready = self.ready[: self.batch_prompts], self.ready[self.batch_prompts :]
        tokens = [g.n_tokens for g in groups]
        shares: list[list[list[int]]] = [[] for _ in range(self.n_trainers)]
        for mb in balance_across_ranks(tokens, self.n_minibatches):
            for t, part in enumerate(balance_across_ranks([tokens[i] for i in mb], self.n_trainers)):
                shares[t].append([mb[j] for j in part])
        return BatchPlan(self.version, groups, shares)

    def version_trained(self, new_version: int) -> None:
        self.gate.set_version(new_version)

    def state_dict(self) -> dict:
        return {
            "cursor": self.cursor,
            "dropped_stale": self.dropped_stale,
            "dropped_ids": list(self.dropped_ids),
            "rejected": self.rejected,
            "ready": [asdict(g) for g in self.ready],
            "gate": asdict(self.gate),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint. In-flight prompts of the crashed run are not running any more."""
        self.cursor = state["cursor"]
        self.dropped_stale = state["dropped_stale"]
        self.dropped_ids = list(state.get("dropped_ids", []))
        self.rejected = state.get("rejected", 0)
        self.ready = sorted((ReadyGroup(**g) for g in state["ready"]), key=lambda g: g.version_start)
        self.gate = StalenessGate(**{**state["gate"], "running": 0})

    def restore(self, version: int, state: dict, stored: list[tuple[ReadyGroup, int]]) -> tuple[int, int]:
        """Back to the checkpoint of `version` after a crash or requeue; returns (groups reused, dropped).

        `stored` is every group the store holds that no kept ledger version consumed, each with the newest
        version among its tokens. A group is reused if it is fresh enough for `version` and was sampled
        only by versions that still exist (<= version): a resume must not train on tokens of weights it
        rolled back. The rest are dropped as stale, so their ids are never reused.
        """
        self.load_state_dict(state)
        already = set(self.dropped_ids)
        fresh, stale = [], []
        for g, newest in stored:
            if g.group_id in already:
                continue
            (fresh if version - g.version_start <= self.eta and newest <= version else stale).append(g)
        self.dropped_ids += [g.group_id for g in stale]
        self.ready = sorted(fresh, key=lambda g: g.version_start)
        self.gate.set_version(version)
        # every version before this one consumed B groups; the reused ones are finished and waiting
        self.gate.accepted = version * self.batch_prompts + len(fresh)
        return len(fresh), len(stale)
