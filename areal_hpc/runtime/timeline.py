"""Per-rank event timeline (rank, role, event, t_start, t_end) for utilisation analysis."""

from __future__ import annotations

import csv
import time
from contextlib import contextmanager
from pathlib import Path

TIMELINE_SUBDIR = "timeline"


class Timeline:
    """Appends rows to RUN_DIR/timeline/rank{r}.csv, flushed every `flush_s` (a log, read with pandas).

    A crash can cut the last row short; `load_timeline` skips such rows.
    """

    def __init__(self, run_dir: Path, rank: int, role: str, flush_s: float = 2.0):
        self.rank, self.role, self.flush_s = rank, role, flush_s
        path = Path(run_dir) / TIMELINE_SUBDIR / f"rank{rank:03d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        self._f = open(path, "a", newline="")
        self._w = csv.writer(self._f)
        if new:
            self._w.writerow(["rank", "role", "event", "t_start", "t_end"])
        self._last_flush = time.time()
        self.add("start", time.time(), time.time())

    def add(self, event: str, t_start: float, t_end: float) -> None:
        self._w.writerow([self.rank, self.role, event, f"{t_start:.6f}", f"{t_end:.6f}"])
        if t_end - self._last_flush > self.flush_s:
            self._f.flush()
            self._last_flush = t_end

    @contextmanager
    def span(self, event: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.add(event, t0, time.time())

    def close(self) -> None:
        self._f.flush()
        self._f.close()


def load_timeline(run_dir: Path):
    """All ranks' events as one DataFrame (rows cut short by a crash dropped)."""
    import pandas as pd

    frames = []
    for p in sorted((Path(run_dir) / TIMELINE_SUBDIR).glob("rank*.csv")):
        df = pd.read_csv(p, on_bad_lines="skip")
        frames.append(df.dropna())
    if not frames:
        return pd.DataFrame(columns=["rank", "role", "event", "t_start", "t_end", "duration"])
    df = pd.concat(frames, ignore_index=True)
    df["duration"] = df["t_end"] - df["t_start"]
    return df
