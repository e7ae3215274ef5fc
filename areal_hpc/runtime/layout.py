"""Who does what in the MPI world: rank 0 schedules, then G generator ranks, then T trainer ranks."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER, GENERATOR, TRAINER = "scheduler", "generator", "trainer"


@dataclass(frozen=True)
class Layout:
    """Ranks 1..G generate, ranks G+1..G+T train.

    On Slurm a heterogeneous job lists its components in this same order (training component:
    scheduler + trainers is mapped by the launcher script), so roles never depend on host names.
    """

    n_generators: int
    n_trainers: int

    @property
    def world_size(self) -> int:
        return 1 + self.n_generators + self.n_trainers

    @property
    def generator_ranks(self) -> list[int]:
        return list(range(1, 1 + self.n_generators))

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(1 + self.n_generators, self.world_size))

    @property
    def trainer0(self) -> int:
        return 1 + self.n_generators

    def role(self, rank: int) -> str:
        if rank == 0:
            return SCHEDULER
        if rank <= self.n_generators:
            return GENERATOR
        if rank < self.world_size:
            return TRAINER
        raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")

    def index(self, rank: int) -> int:
        """Position of a rank among the ranks of its role (generator 0.., trainer 0..)."""
        role = self.role(rank)
        return 0 if role == SCHEDULER else (rank - 1 if role == GENERATOR else rank - self.trainer0)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"MPI world has {world_size} ranks but the config needs {self.world_size} "
                f"(1 scheduler + {self.n_generators} generators + {self.n_trainers} trainers)"
            )
