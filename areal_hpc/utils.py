"""Small shared helpers: atomic file and directory writes, seeding, the pace of progress output."""

from __future__ import annotations

import errno
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from areal_hpc.rundir import TMP_SUFFIX


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_beside(path: Path) -> Path:
    """This process's temporary for `path`, in the same folder (so the rename into place is atomic)."""
    return path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a private tmp file, fsync, rename into place: readers see the old file or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


# seconds between progress lines where the output is a file or a pipe (a Slurm job's log, `> file`), not a
# terminal: a few lines a minute there, where a bar would add a line at every redraw
PIPED_PROGRESS_S = 20.0


def on_terminal(stream=None) -> bool:
    """Whether `stream` (default stderr, where progress goes) is a terminal."""
    try:
        return (sys.stderr if stream is None else stream).isatty()
    except (AttributeError, ValueError):  # a stand-in without isatty, or closed
        return False


def bar_interval() -> float:
    """tqdm's mininterval for a bar on stderr: its own 0.1 s on a terminal, PIPED_PROGRESS_S in a file."""
    return 0.1 if on_terminal() else PIPED_PROGRESS_S


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _fsync_tree(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        if p.is_dir():
            fsync_dir(p)
        else:
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def atomic_publish_dir(tmp: Path, final: Path) -> Path:
    """Move a fully written directory `tmp` to `final` so readers see the old or the new, never half.

    Files are fsynced first; an existing `final` is renamed aside before the new one is renamed in, so
    a crash at any point leaves a complete directory under `final` or under `final.old`.
    """
    tmp, final = Path(tmp), Path(final)
    _fsync_tree(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def publish_dir_if_absent(tmp: Path, final: Path) -> bool:
    """Move a fully written `tmp` to `final` unless another process published `final` first (first one
    wins, nobody's readers see a folder swapped under them); False, and `tmp` removed, if it lost."""
    tmp, final = Path(tmp), Path(final)
    _fsync_tree(tmp)
    try:
        os.rename(tmp, final)  # onto a missing or empty folder only; a non-empty one raises
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    fsync_dir(final.parent)
    return True


def new_tmp_dir_beside(final: Path) -> Path:
    """A fresh temporary directory next to `final` (same filesystem, so the rename is atomic)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=TMP_SUFFIX, dir=final.parent))
