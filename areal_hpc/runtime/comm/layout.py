"""Who does what in the MPI world: rank 0 schedules; the other ranks generate or train."""

from __future__ import annotations

from dataclasses import dataclass, replace

SCHEDULER, GENERATOR, TRAINER = "scheduler", "generator", "trainer"
TRAIN_GROUP, GEN_GROUP = "train", "gen"  # the two parts of a heterogeneous Slurm job


@dataclass(frozen=True)
class Layout:
    """The role of every rank. Rank 0 is always the scheduler; its messages go to and from rank 0.

    Locally (`from_counts`) ranks 1..G generate and ranks G+1..G+T train. Under Slurm each rank only
    knows which component of the heterogeneous job it belongs to (`from_groups`): the training
    component (scheduler + trainers) comes first, so its first rank is rank 0.
    """

    roles: tuple[str, ...]
    hosts: tuple[str, ...] = ()  # where each rank runs, once the world has told (`with_hosts`)

    @classmethod
    def from_counts(cls, n_generators: int, n_trainers: int) -> Layout:
        return cls((SCHEDULER,) + (GENERATOR,) * n_generators + (TRAINER,) * n_trainers)

    @classmethod
    def from_groups(cls, groups: list[str]) -> Layout:
        """groups[r] is rank r's het-job component: 'train' (scheduler + trainers) or 'gen'."""
        bad = sorted({g for g in groups if g not in (TRAIN_GROUP, GEN_GROUP)})
        if bad:
            raise ValueError(f"unknown rank group(s) {bad}; each rank is 'train' or 'gen'")
        if not groups or groups[0] != TRAIN_GROUP:
            raise ValueError("rank 0 must belong to the training component (het group 0: scheduler + trainers)")
        return cls(
            tuple(SCHEDULER if r == 0 else (TRAINER if g == TRAIN_GROUP else GENERATOR) for r, g in enumerate(groups))
        )

    def with_hosts(self, hosts: list[str]) -> Layout:
        return replace(self, hosts=tuple(hosts))

    def describe(self, rank: int) -> str:
        """'rank 3 (generator on n2)': how a message names a rank to the user."""
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        return f"rank {rank} ({self.role(rank)} on {host})"

    @property
    def world_size(self) -> int:
        return len(self.roles)

    @property
    def n_generators(self) -> int:
        return self.roles.count(GENERATOR)

    @property
    def n_trainers(self) -> int:
        return self.roles.count(TRAINER)

    @property
    def generator_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles) if role == GENERATOR]

    @property
    def trainer_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles) if role == TRAINER]

    @property
    def trainer0(self) -> int:
        return self.trainer_ranks[0]

    def role(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        return self.roles[rank]

    def index(self, rank: int) -> int:
        """Position of a rank among the ranks of its role (generator 0.., trainer 0..)."""
        role = self.role(rank)
        return self.roles[:rank].count(role)

    def check(self, world_size: int, n_generators: int, n_trainers: int) -> None:
        """The world must hold exactly the ranks the config asks for."""
        if (world_size, self.n_generators, self.n_trainers) != (
            1 + n_generators + n_trainers,
            n_generators,
            n_trainers,
        ):
            raise ValueError(
                f"MPI world has {world_size} ranks ({self.n_generators} generators, {self.n_trainers} trainers) "
                f"but the config needs {1 + n_generators + n_trainers} "
                f"(1 scheduler + {n_generators} generators + {n_trainers} trainers)"
            )
