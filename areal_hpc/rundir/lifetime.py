"""Nothing of a run outlives it: the run's environment marker, death signals tied to a parent, and the sweep."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
from pathlib import Path

# Set by the launcher for mpirun and by every rank for itself: each process of the run (reward workers,
# tool sandboxes, the commands they start) inherits it, so what a run left behind can be found by it
MARKER = "AREAL_RUN_DIR"
_PR_SET_PDEATHSIG = 1


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # looked up here: a preexec function must not load libraries between fork and exec


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets `sig` when the thread that started it ends (Linux's PR_SET_PDEATHSIG). Safe in a
    preexec function: one system call."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig))


def exit_with(owner_pid: int) -> None:
    """Leave (SIGKILL to this process) the moment process `owner_pid` ends, from a daemon thread.

    For processes whose parent is not the owner: a forkserver's children are the forkserver's, and the
    forkserver lives as long as any of them holds its pipe, so neither ends by itself when the rank dies.
    """
    try:
        fd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (OSError, AttributeError):  # no pidfd (Linux < 5.3): the parent's death signal is all there is
        return

    def watch() -> None:
        select.select([fd], [], [])  # readable once the owner has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-owner", daemon=True).start()


def _ancestors() -> set[int]:
    """This process and the ones it descends from (a wrapper that set the marker itself is not the run's)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def marked(run_dir: str | Path) -> list[int]:
    """Pids of live processes (zombies aside) whose environment carries this run's marker, this one and its
    ancestors aside."""
    want = f"{MARKER}={Path(run_dir).resolve()}".encode()
    mine, found = _ancestors(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if want in env and state != "Z":
            found.append(int(entry))
    return found


def describe(pid: int) -> str:
    """`pid (command line)`, for a log line."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid} ({cmd[:80]})"


def sweep(run_dir: str | Path) -> list[str]:
    """SIGKILL every process still carrying this run's marker; what was killed, one `pid (command)` each."""
    killed = []
    for pid in marked(run_dir):
        what = describe(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(what)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def marker_env() -> dict[str, str]:
    """The run's marker, for a child started with an environment of its own (a sandbox): empty outside a run."""
    return {MARKER: os.environ[MARKER]} if MARKER in os.environ else {}


def tied_to_me(sig: int = signal.SIGTERM):
    """A preexec function for a child that must end with this process: it gets `sig` when this process's
    current thread ends, killed or not (checked once more after the call: this process may be gone already)."""
    parent = os.getpid()

    def preexec() -> None:  # between fork and exec: system calls only
        die_with_parent(sig)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
