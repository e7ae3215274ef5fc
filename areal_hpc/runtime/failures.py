"""A rank's failure as its error file records it: one line for the user, and what kind of failure it was."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.rundir import RunDir

PEER = "peer"
"""A collective or a connection to a peer failed: the echo of another rank's death, not a cause."""
STARTUP = "start-up"
"""Raised by the rank's own set-up before its role loop ran, by an input that does not fit (config, data, model
folder, checkpoint, user code): a new world would fail the same way, so the job does not restart it."""
OWN = "own"
"""Anything else of the rank's own: a failure mid-run, or any other error at start-up (an engine that could not
start, the disk, memory, a device), which a new world may well get past."""

# what a failed collective or a lost connection says, in the exception's type name or message (gloo, NCCL, MPI,
# torch.distributed's Dist*Error, socket errors) and the weight sync's own line when its broadcast failed
_PEER_WORDS = re.compile(
    r"\b(Dist\w*Error|Connection\w*Error|BrokenPipeError|TimeoutError|gloo|nccl|pmix|MPI_ERR\w*)\b"
    r"|connection (reset|closed|refused|aborted)|closed by peer|\btimed out\b|broadcast of version \d+ failed",
    re.IGNORECASE,
)
# Errors that say an input does not fit, by class name (no import of the modules that raise them): this project's
# checks, and user code that does not import. Engines' own errors (vLLM's "Free memory on device ... less than
# desired", "Engine core initialization failed") are not among them: the last world may still hold the GPU.
_REPEATING = {
    "ConfigError",
    "PluginError",
    "ModelFolderError",
    "CheckpointError",
    "WarmStartError",
    "LedgerError",
    "WeightLayoutMismatch",
    "BaseMismatch",
    "RunDirError",
    "EngineNotInstalled",
    "TrackerNotInstalled",
    "ImportError",
    "SyntaxError",
}
# weights that do not fit the model (torch's load_state_dict): the checkpoint or model folder, every time
_NOT_LOADING = re.compile(r"Error\(s\) in loading state_dict|size mismatch for ")
_PACKAGE = f"{os.sep}areal_hpc{os.sep}"
# Testing hook: AREAL_HPC_FAULT="trainer@3" makes trainer rank 0 raise before training version 3, so the
# shutdown-after-error path is exercised by a real run (kill -9 covers crashes without a message);
# "stall-update@3" stalls a vLLM generator's workers inside the update of version 3 (the weight sync's limit)
FAULT_ENV = "AREAL_HPC_FAULT"
_KIND_PREFIX = "kind: "
loop_started = threading.Event()
"""Set when this process's role loop starts (RoleLoop.loop): an error before it is a start-up error."""


@dataclass(frozen=True)
class RankFailure:
    line: str  # "rank 1 (trainer) failed: RuntimeError: ...": what the user is shown
    kind: str  # PEER, STARTUP or OWN
    path: Path  # its error file (RunDir.log_of_error finds the rank's log)


def _chain(err: BaseException) -> list[BaseException]:
    """The error and what it was raised from or during (a wrapper's cause may be the lost connection)."""
    seen: list[BaseException] = []
    while err is not None and all(err is not s for s in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def kind_of(err: BaseException, loop_started: bool, peer_errors: tuple[type, ...] = ()) -> str:
    """The kind of a rank's error; `peer_errors`: exception types that mean a failed exchange (MPI's)."""
    if any(type(e).__name__ == "WeightSyncTimeout" for e in _chain(err)):
        return OWN  # a weight sync's own limit names the stalled step: the cause, though a peer stalled
    for e in _chain(err):
        if isinstance(e, (ConnectionError, TimeoutError, *peer_errors)) or _PEER_WORDS.search(
            f"{type(e).__name__}: {e}"
        ):
            return PEER
    if loop_started or not isinstance(err, Exception) or isinstance(err, (OSError, MemoryError)):
        return OWN  # mid-run, a signal, the disk or memory: a new world may pass
    names = {c.__name__ for c in type(err).__mro__}
    if names & _REPEATING or _NOT_LOADING.search(str(err)) or _own_check(err):
        return STARTUP
    return OWN


def _own_check(err: BaseException) -> bool:
    """A ValueError this project raised (its checks of data rows, prompts, the layout), not one of an engine's."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return isinstance(err, ValueError) and tb is not None and _PACKAGE in tb.tb_frame.f_code.co_filename


def error_file_text(line: str, kind: str) -> str:
    """What a failing rank writes to its error file: the line, then its kind (read by read_failures)."""
    return f"{line}\n{_KIND_PREFIX}{kind}\n"


def _read(path: Path) -> RankFailure:
    lines = path.read_text(errors="replace").strip().splitlines() or [""]
    kinds = [ln[len(_KIND_PREFIX) :] for ln in lines[1:] if ln.startswith(_KIND_PREFIX)]
    if kinds:
        return RankFailure(lines[0], kinds[0], path)
    # written without a kind (rank 0's verdict on a run that ended failed): judged by its words
    return RankFailure(lines[0], PEER if _PEER_WORDS.search(lines[0]) else OWN, path)


def read_failures(run_dir: Path | RunDir, since: float = 0.0) -> list[RankFailure]:
    """The error files written since `since` (epoch seconds), first written first."""
    out = []
    for p in RunDir(run_dir).rank_errors():
        try:
            if p.stat().st_mtime >= since:
                out.append(_read(p))
        except OSError:  # removed meanwhile (a new world's start)
            continue
    return out
