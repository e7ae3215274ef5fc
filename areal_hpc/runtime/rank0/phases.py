"""Rank 0's phases without MPI (starting, running, stopping, final evaluation, draining, done), checkpoint rounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    STARTING = "starting"  # waiting for trainer 0 to publish the starting weights
    RUNNING = "running"  # granting prompts and dispatching batches
    STOPPING = "stopping"  # no grants or batches: the batch in flight ends, then the current version is checkpointed
    FINAL_EVAL = "final evaluation"  # STOP sent; the final held-out evaluation runs at the last weights
    DRAINING = "draining"  # waiting for every other rank's BYE
    DONE = "done"


@dataclass
class StopSequence:
    """Where rank 0 is in its run, and why it stops. Every transition is a method; the Scheduler's tick and
    handlers call them and send what each returns it must send (this class sends nothing)."""

    other_ranks: list[int]  # every rank but 0: each says BYE once stopped
    generator_ranks: list[int]
    phase: Phase = Phase.STARTING
    reason: str = ""
    # stopping on a request (a signal, Ctrl-C, the stop file), not at the end: the final evaluation is bounded
    requested: bool = False
    stopped_ranks: set[int] = field(default_factory=set)  # ranks that said BYE

    @property
    def evaluator(self) -> int | None:
        return self.generator_ranks[0] if self.generator_ranks else None

    def started(self) -> None:
        """Trainer 0 published the starting weights (a stop asked during start-up stays a stop)."""
        if self.phase is Phase.STARTING:
            self.phase = Phase.RUNNING

    def stop(self, reason: str, requested: bool = False) -> bool:
        """Begin the stop; False when it has begun already (the first reason stays)."""
        if self.phase not in (Phase.STARTING, Phase.RUNNING):
            return False
        self.phase, self.reason, self.requested = Phase.STOPPING, reason, requested
        return True

    def final_eval_budget(self, stop_eval_s: float) -> float | None:
        """The STOP message's bound on the final evaluation: logging.stop_eval_s after a stop request, else none."""
        return stop_eval_s if self.requested else None

    def checkpointed(self, eval_asked: bool) -> None:
        """The stop's checkpoint is complete and STOP went out with (`eval_asked`) or without a final evaluation."""
        if self.phase is Phase.STOPPING:
            self.phase = Phase.FINAL_EVAL if eval_asked else Phase.DRAINING
            self._maybe_done()

    def cut_final_eval(self) -> list[int]:
        """A stop request during the final evaluation of a run that ended by itself: the generators still
        running, to be sent STOP with no time for the evaluation. Empty when there is nothing to cut."""
        if self.phase is not Phase.FINAL_EVAL or self.requested:
            return []
        self.requested = True
        return [g for g in self.generator_ranks if g not in self.stopped_ranks]

    def final_eval_ended(self) -> None:
        if self.phase is Phase.FINAL_EVAL:
            self.phase = Phase.DRAINING

    def said_bye(self, rank: int) -> None:
        self.stopped_ranks.add(rank)
        if rank == self.evaluator:  # it evaluates before its BYE: whatever it had is over
            self.final_eval_ended()
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.phase in (Phase.FINAL_EVAL, Phase.DRAINING) and self.stopped_ranks >= set(self.other_ranks):
            self.phase = Phase.DONE

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE


@dataclass
class CheckpointRound:
    """Rank 0's side of checkpoints: at most one round in flight, complete once every trainer has answered."""

    n_trainers: int
    pending: int | None = None  # the version being checkpointed
    answers: int = 0  # trainers whose CKPT_DONE came for it
    last: int = -1  # the newest complete checkpoint's version
    began_at: float = 0.0

    def resumed_from(self, version: int) -> None:
        """A resume starts from this complete checkpoint: it is never written again."""
        self.last = version

    def begin(self, version: int, now: float) -> bool:
        """True when a round for `version` starts now (not while one runs, nor for a version already saved)."""
        if self.last == version or self.pending is not None:
            return False
        self.pending, self.answers, self.began_at = version, 0, now
        return True

    def trainer_done(self) -> int | None:
        """One trainer saved its part; the version once all have (rank 0 then writes its state), else None."""
        self.answers += 1
        return self.pending if self.answers >= self.n_trainers else None

    def complete(self, now: float) -> float:
        """Rank 0's state is written: the round is over; returns how long it took."""
        self.last, self.pending = self.pending, None
        return now - self.began_at

    def holds(self, version: int) -> bool:
        """No round running and `version` saved."""
        return self.pending is None and self.last == version
