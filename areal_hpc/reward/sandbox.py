"""Runs untrusted Python in bubblewrap namespaces (or rlimits only) under rlimits and a wall timeout, then killpg."""

from __future__ import annotations

import ctypes
import functools
import math
import os
import pwd
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import NamedTuple

from areal_hpc.config.errors import ConfigError
from areal_hpc.rundir.lifetime import marker_env

__all__ = ["MODES", "Limits", "Result", "Isolation", "SandboxUnavailable", "isolation", "run_python"]

# reward.sandbox: bwrap = bubblewrap or refuse; auto = bubblewrap where it works, else rlimits only;
# none = rlimits only, on purpose
MODES = ("bwrap", "auto", "none")
BWRAP, RLIMITS_ONLY = "bwrap", "rlimits-only"

_DESCRIPTIONS = {
    BWRAP: (
        "bubblewrap: new user, pid, network, ipc, uts and mount namespaces; only /usr (and the interpreter) "
        "read-only, a private tmpfs as cwd, no network, no further user namespaces; rlimits on cpu, memory, "
        "file size and processes; wall timeout ending in killpg"
    ),
    RLIMITS_ONLY: (
        "rlimits only: own process group, wall timeout ending in killpg, rlimits on cpu, memory, file size and "
        "processes, a private temporary cwd, run as 'nobody' when started by root; the network and world-readable "
        "files are NOT isolated"
    ),
}


class SandboxUnavailable(ConfigError):
    """The configured isolation cannot run on this machine (one line: what failed, what to do)."""


class Isolation(NamedTuple):
    name: str  # bwrap | rlimits-only
    description: str  # one line: what is in force


@dataclass(frozen=True)
class Limits:
    """What one sandboxed program may use."""

    wall_s: float = 5.0  # wall clock, then SIGKILL to its process group; CPU time gets the same, rounded up
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    max_procs: int = 32  # processes and threads (RLIMIT_NPROC)
    file_mb: int = 16  # largest file it may write, its output included (RLIMIT_FSIZE)
    tmp_mb: int = 64  # bwrap: size of its private tmpfs
    output_kb: int = 4  # at most this much of the output's tail is read back


@dataclass
class Result:
    returncode: int  # negative: killed by that signal
    timed_out: bool  # killed at the wall timeout
    output_tail: bytes  # the last Limits.output_kb of stdout + stderr
    wall_s: float


# --------------------------------------------------------------------------- the interpreter and the user


def _interpreter() -> tuple[str, str | None]:
    """The Python run in the sandbox, and a folder outside /usr to bind read-only for it (None: under /usr).

    The run's own base interpreter (not its venv: the answer gets the standard library only), so answers
    meet the Python version the run was set up with; only its install prefix is made visible. When the
    sandbox runs as nobody and cannot reach that prefix (a pyenv or conda under /root), the system python3.
    """
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if prefix.startswith("/usr/"):
        return exe, None
    if _unprivileged() is None or _others_can_run(prefix):
        return exe, prefix
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3", None
    return exe, prefix


def _others_can_run(prefix: str) -> bool:
    """Whether a user with no rights of its own can reach prefix and read its files (mode bits only)."""
    path = prefix
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if path == "/":
            break
        path = os.path.dirname(path)
    return bool(os.stat(prefix).st_mode & stat.S_IROTH)


def _unprivileged() -> tuple[int, int] | None:
    """(uid, gid) to run as when we are root: root is exempt from RLIMIT_NPROC and reads every file."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return 65534, 65534


def _tasks_of(uid: int) -> int:
    """Threads now owned by uid: RLIMIT_NPROC outside a user namespace counts all of them, not only ours."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 0").split()[0]) == uid:
            n += int(fields.get("Threads", "1").strip() or 1)
    return n


# --------------------------------------------------------------------------- the two ways of running


@functools.lru_cache(maxsize=1)
def _bwrap_options() -> frozenset[str]:
    exe = shutil.which("bwrap")
    if exe is None:
        return frozenset()
    try:
        out = subprocess.run([exe, "--help"], capture_output=True, timeout=10).stdout.decode(errors="replace")
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(w for w in out.split() if w.startswith("--"))


def _bwrap_command(limits: Limits, exe: str, extra_ro: str | None) -> list[str]:
    opts = _bwrap_options()
    cmd = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    if "--disable-userns" in opts:  # bwrap >= 0.8: no nested user namespace to regain capabilities in
        cmd.append("--disable-userns")
    cmd += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    cmd += ["--setenv", "LANG", "C.UTF-8"]
    for key, value in marker_env().items():  # the run's marker: what a run leaves behind is found by it
        cmd += ["--setenv", key, value]
    cmd += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: the usual symlinks into it
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    if extra_ro:
        cmd += ["--ro-bind", extra_ro, extra_ro]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    if "--size" in opts:
        cmd += ["--size", str(limits.tmp_mb << 20)]
    cmd += ["--tmpfs", "/tmp", "--chdir", "/tmp", exe, "-I", "-S", "-"]
    return cmd


# Inside bwrap, first thing: the program came on stdin (a file the magic link /proc/self/fd/0 would reopen),
# and RLIMIT_NPROC is set here, inside the new user namespace, where it counts only this sandbox's tasks
# (set before the namespace exists, the kernel would check it against all of the user's processes).
_PREAMBLE = """import os as _os, resource as _r
_os.dup2(_os.open("/dev/null", _os.O_RDONLY), 0)
_r.setrlimit(_r.RLIMIT_NPROC, ({n}, {n}))
del _os, _r
"""
_PREAMBLE_PLAIN = """import os as _os
_os.dup2(_os.open("/dev/null", _os.O_RDONLY), 0)
del _os
"""


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # looked up here, in the parent: nothing is loaded between fork and exec
_PR_SET_PDEATHSIG = 1


def _limiter(limits: Limits, user: tuple[int, int] | None, nproc: int | None):
    cpu = max(1, math.ceil(limits.wall_s))
    mem = limits.memory_mb << 20
    fsize = limits.file_mb << 20
    parent = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec: only system calls
        if user is not None:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
        if _PRCTL is not None:
            # if the scorer is killed (a reward pool rebuilt after a hang), nobody would killpg: die with it
            # (after setuid, which clears the setting); bwrap's --die-with-parent then ends everything inside
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return preexec


def run_python(source: str, limits: Limits, how: str) -> Result:
    """Runs source with the sandbox's python3 (-I -S: stdlib only) under `how` (bwrap | rlimits-only)."""
    exe, extra_ro = _interpreter()
    user = _unprivileged()
    workdir = None
    if how == BWRAP:
        cmd, cwd, nproc = _bwrap_command(limits, exe, extra_ro), None, None
        program = _PREAMBLE.format(n=int(limits.max_procs)) + source
        env = marker_env()
    elif how == RLIMITS_ONLY:
        workdir = tempfile.mkdtemp(prefix="areal-sandbox-")
        if user is not None:
            os.chown(workdir, *user)
        cmd, cwd = [exe, "-I", "-S", "-"], workdir
        nproc = _tasks_of(user[0] if user else os.getuid()) + int(limits.max_procs)
        program = _PREAMBLE_PLAIN + source
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"} | marker_env()
    else:
        raise ValueError(f"isolation {how!r} is not one of {BWRAP}, {RLIMITS_ONLY}")
    t0 = time.monotonic()
    proc = None
    # Unnamed files: the program arrives on stdin and the output goes to disk, so printing a gigabyte costs
    # no memory here (RLIMIT_FSIZE stops it) and nothing needs cleaning up.
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out:
        stdin.write(program.encode("utf-8", errors="replace"))
        stdin.seek(0)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=stdin,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,  # its own process group, for killpg
                preexec_fn=_limiter(limits, user, nproc),
                close_fds=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            if proc is not None:
                # always, also after a clean exit: whatever it left running in its group dies with it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        size = out.seek(0, os.SEEK_END)
        out.seek(max(0, size - (limits.output_kb << 10)))
        tail = out.read(limits.output_kb << 10)
    return Result(proc.returncode, timed_out, tail, time.monotonic() - t0)


# --------------------------------------------------------------------------- what is in force


@functools.lru_cache(maxsize=4)
def _problem(how: str) -> str | None:
    """None if `how` runs a program here, else one line on why not (cached: asked once per process)."""
    if how == BWRAP and shutil.which("bwrap") is None:
        return "bwrap is not on PATH"
    try:
        r = run_python("print('sandbox-ok')", Limits(wall_s=20), how)
    except (OSError, subprocess.SubprocessError) as err:  # e.g. a limit preexec_fn could not set
        return f"{type(err).__name__}: {err}"
    text = r.output_tail.decode(errors="replace").strip()
    if r.returncode == 0 and text.endswith("sandbox-ok"):
        return None
    first = text.splitlines()[0] if text else f"exit code {r.returncode}"
    return f"{first[:200]}" + (" (timed out)" if r.timed_out else "")


def isolation(mode: str = "auto", key: str = "reward.sandbox") -> Isolation:
    """The isolation `key`=mode gets on this machine; SandboxUnavailable (one line, naming `key`) if it cannot run."""
    if mode not in MODES:
        raise SandboxUnavailable(f"config {key}={mode!r} is not allowed; choose one of {', '.join(MODES)}")
    if mode in ("bwrap", "auto"):
        why = _problem(BWRAP)
        if why is None:
            return Isolation(BWRAP, _DESCRIPTIONS[BWRAP])
        if mode == "bwrap":
            raise SandboxUnavailable(
                f"config {key}=bwrap but bubblewrap cannot run here ({why}); install it "
                f"(apt-get install bubblewrap) with user namespaces allowed, or set {key}=none to score "
                "code under rlimits only"
            )
    why = _problem(RLIMITS_ONLY)
    if why is not None:
        raise SandboxUnavailable(f"config {key}={mode}: cannot start the sandbox's python3 ({why})")
    return Isolation(RLIMITS_ONLY, _DESCRIPTIONS[RLIMITS_ONLY])
