"""Hang detection: every rank's heartbeat to rank 0, rank 0's silence check, rank 0's own heartbeat file."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from areal_hpc.utils import atomic_write_text


class RankSilent(RuntimeError):
    """A rank sent nothing for longer than cluster.hang_timeout_s: stopped, or blocked outside its loop."""


def silence_verdict(error_lines: list[str]) -> str | None:
    """Rank 0's line naming a silent rank, among the ranks' error lines: the launcher's cause of death,
    ahead of the kill of the stopped rank that follows it (srun's or mpirun's "killed" line)."""
    return next((ln for ln in error_lines if f" {RankSilent.__name__}: " in ln), None)


class Liveness:
    """One rank's side of hang detection (`timeout_s` 0: off).

    A rank beats from its role loop, not from a thread: a thread would go on beating while the loop is
    deadlocked in a collective, which is the hang that matters. So a single step of work (one PPO
    version, one weight load) must take less than the timeout. Any message counts as a beat.
    Rank 0 watches each other rank from its first message (start-up, which loads models and data, is
    not timed) until its BYE, and writes `heartbeat_file` from its loop for the job script, which kills
    the world when rank 0 itself goes quiet.
    """

    def __init__(self, rank: int, timeout_s: float, describe=None, heartbeat_file: Path | None = None):
        self.rank, self.timeout_s = rank, float(timeout_s)
        self.every = self.timeout_s / 4
        self.describe = describe or (lambda r: f"rank {r}")
        self.last_heard: dict[int, float] = {}
        self.gone: set[int] = set()
        self.last_beat = -float("inf")  # rank 0's first check writes the heartbeat file
        self.heartbeat_file = heartbeat_file

    def beat_due(self) -> bool:
        """A non-zero rank: time to tell rank 0 it is still here (the caller sends the HEARTBEAT)."""
        if not self.timeout_s:
            return False
        now = time.monotonic()
        if now - self.last_beat < self.every:
            return False
        self.last_beat = now
        return True

    def heard(self, src: int) -> None:
        if src not in self.gone:
            self.last_heard[src] = time.monotonic()

    def forget(self, src: int) -> None:
        """The rank said BYE: it sends nothing more, by design."""
        self.gone.add(src)
        self.last_heard.pop(src, None)

    def check(self) -> None:
        """Rank 0: raise RankSilent for the quietest rank past the timeout; keep the heartbeat file fresh."""
        if not self.timeout_s:
            return
        now = time.monotonic()
        if self.heartbeat_file is not None and now - self.last_beat >= self.every:
            self.last_beat = now
            self._write_heartbeat()
        if not self.last_heard:
            return
        rank, seen = min(self.last_heard.items(), key=lambda kv: kv[1])
        if now - seen > self.timeout_s:
            raise RankSilent(
                f"{self.describe(rank)} sent nothing for {now - seen:.0f} s (cluster.hang_timeout_s="
                f"{self.timeout_s:g}): stopped, or stuck outside its loop; ending the run"
            )

    def _write_heartbeat(self) -> None:
        write_heartbeat(self.heartbeat_file)


_write_lock = threading.Lock()  # the start-up thread's last beat may meet the loop's first (one tmp file per pid)


def write_heartbeat(path: Path) -> None:
    with _write_lock:
        atomic_write_text(path, json.dumps({"time": time.time(), "pid": os.getpid()}))


def beat_during_startup(path: Path, timeout_s: float, loop_started: threading.Event) -> None:
    """Rank 0's heartbeat file from a thread, now and every timeout / 4 until its role loop runs.

    The job script counts a world whose rank 0 writes no heartbeat for cluster.hang_timeout_s as hung, from
    the world's start on. Rank 0's start-up (data, a resume's shard checks) can outlast that and is not timed,
    like every rank's; a thread still shows that the process runs (a stopped or dead rank 0 writes nothing).
    Once the loop runs it beats from there, so a loop stuck in a collective goes quiet.
    """
    if not timeout_s:
        return

    def beat() -> None:
        while not loop_started.is_set():
            write_heartbeat(path)
            loop_started.wait(timeout_s / 4)

    threading.Thread(target=beat, name="startup-heartbeat", daemon=True).start()
