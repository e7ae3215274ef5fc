"""Per-rank event timeline (rank, role, event, t_start, t_end, cpu_s) for utilisation analysis."""

from __future__ import annotations

import csv
import math
import time
from contextlib import contextmanager
from pathlib import Path

from areal_hpc.rundir import RunDir


def _open_log(path: Path, header: list[str]):
    """An append-only CSV log (a resumed run appends to its earlier rows); the header once, when new or
    empty, written through at once: a rank killed before its first flush left an empty file, and the
    resumed run's rows then had no header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    f = open(path, "a", newline="")
    w = csv.writer(f)
    if new:
        w.writerow(header)
        f.flush()
    return f, w


class Timeline:
    """Appends rows to RUN_DIR/timeline/rank{r}.csv, flushed every `flush_s` (a log, read with pandas).

    A crash can cut the last row short; `load_timeline` skips such rows.
    """

    def __init__(self, run_dir: Path, rank: int, role: str, flush_s: float = 2.0):
        self.rank, self.role, self.flush_s = rank, role, flush_s
        self._f, self._w = _open_log(
            RunDir(run_dir).timeline_log(rank), ["rank", "role", "event", "t_start", "t_end", "cpu_s"]
        )
        self._last_flush = time.time()
        self.add("start", time.time(), time.time())

    def add(self, event: str, t_start: float, t_end: float, cpu_s: float | None = None) -> None:
        cpu = "" if cpu_s is None else f"{cpu_s:.6f}"
        self._w.writerow([self.rank, self.role, event, f"{t_start:.6f}", f"{t_end:.6f}", cpu])
        if t_end - self._last_flush > self.flush_s:
            self._f.flush()
            self._last_flush = t_end

    @contextmanager
    def span(self, event: str):
        """Times the block, and the CPU time this thread spent in it: wall / CPU is the share of a core
        the rank got (under 1 when the host's cores are oversubscribed), which the calibration needs."""
        t0, c0 = time.time(), time.thread_time()
        try:
            yield
        finally:
            self.add(event, t0, time.time(), time.thread_time() - c0)

    def close(self) -> None:
        self._f.flush()
        self._f.close()


def load_timeline(run_dir: Path):
    """All ranks' events as one DataFrame (rows cut short by a crash dropped; `cpu_s` is NaN for events
    that are not timed spans, and for runs from before it was recorded)."""
    import pandas as pd

    frames = []
    for p in RunDir(run_dir).timeline_logs():
        df = pd.read_csv(p, on_bad_lines="skip")
        if "cpu_s" not in df:
            df["cpu_s"] = float("nan")
        frames.append(df.dropna(subset=["rank", "role", "event", "t_start", "t_end"]))
    if not frames:
        return pd.DataFrame(columns=["rank", "role", "event", "t_start", "t_end", "cpu_s", "duration"])
    df = pd.concat(frames, ignore_index=True)
    df["duration"] = df["t_end"] - df["t_start"]
    return df


class EngineMeter:
    """How full a generator's engine was: one row per window in RUN_DIR/timeline/engine-rank{r}.csv.

    A row holds the window's start and end, the engine steps taken, the sequence-steps (running
    sequences summed over steps), the sequence-seconds (running sequences times step time), the
    capacity, and the steps' wall and CPU seconds (the stepping thread's; their ratio is the share of a
    core the engine got). Time-weighted occupancy over any span is sum(seq_s) / (capacity * span): time between
    steps, when the engine is idle, counts as empty.
    """

    FIELDS = ["rank", "t_start", "t_end", "steps", "seq_steps", "seq_s", "capacity", "step_s", "cpu_s"]

    def __init__(self, run_dir: Path, rank: int, capacity: int, window_s: float = 0.25):
        self.rank, self.capacity, self.window_s = rank, capacity, window_s
        self._f, self._w = _open_log(RunDir(run_dir).engine_log(rank), self.FIELDS)
        self._reset(time.time())

    def _reset(self, t: float) -> None:
        self.t0, self.steps, self.seq_steps, self.seq_s = t, 0, 0, 0.0
        self.step_s = self.cpu_s = 0.0

    def step(self, t_start: float, t_end: float, running: int, cpu_s: float = math.nan) -> None:
        """One engine step that held `running` sequences (and took `cpu_s` of the stepping thread)."""
        self.steps += 1
        self.seq_steps += running
        self.seq_s += running * (t_end - t_start)
        self.step_s += t_end - t_start
        self.cpu_s += cpu_s
        if t_end - self.t0 >= self.window_s:
            self.flush(t_end)

    def flush(self, t: float | None = None) -> None:
        t = time.time() if t is None else t
        if self.steps:
            self._w.writerow(
                [
                    self.rank,
                    f"{self.t0:.6f}",
                    f"{t:.6f}",
                    self.steps,
                    self.seq_steps,
                    f"{self.seq_s:.6f}",
                    self.capacity,
                    f"{self.step_s:.6f}",
                    f"{self.cpu_s:.6f}",
                ]
            )
            self._f.flush()
        self._reset(t)

    def close(self) -> None:
        self.flush()
        self._f.close()


def load_engine_samples(run_dir: Path):
    """Every generator's EngineMeter rows as one DataFrame."""
    import pandas as pd

    frames = [pd.read_csv(p, on_bad_lines="skip").dropna(subset=["steps"]) for p in RunDir(run_dir).engine_logs()]
    if not frames:
        return pd.DataFrame(columns=EngineMeter.FIELDS)
    return pd.concat(frames, ignore_index=True)
