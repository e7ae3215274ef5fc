"""Per-version metrics: a tidy CSV table in the run dir plus TensorBoard scalars."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from areal_hpc.rundir import RunDir
from areal_hpc.utils import atomic_write_text


class MetricsLogger:
    """One row per version in metrics.csv, mirrored to TensorBoard.

    Every row rewrites the file whole (atomically), with a header that widens when a row brings a new
    column, so the table stays tidy for pandas and is never left with half a row.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, keep_upto: int | None = None):
        """keep_upto: a resumed run keeps the existing rows up to this version and drops the rest."""
        self.run_dir = Path(run_dir)
        self.csv_path = RunDir(run_dir).metrics
        self.tb_dir = RunDir(run_dir).tensorboard
        self.rows: list[dict] = []
        self.fields: list[str] = []
        if keep_upto is not None and self.csv_path.exists():
            with open(self.csv_path, newline="") as f:
                reader = csv.DictReader(f)
                self.fields = list(reader.fieldnames or [])
                self.rows = [r for r in reader if r.get("version") and float(r["version"]) <= keep_upto]
            self._rewrite()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # flushed every few seconds by its own thread, not on every row of the training loop
            self._tb = SummaryWriter(str(self.tb_dir), flush_secs=10)

    def _rewrite(self) -> None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.fields, restval="")
        w.writeheader()
        w.writerows(self.rows)
        atomic_write_text(self.csv_path, buf.getvalue())

    def log(self, version: int, row: dict) -> None:
        row = {"version": version, **row}
        self.rows.append(row)
        self.fields += [k for k in row if k not in self.fields]
        # rewritten whole and renamed, not appended: a full disk or a kill mid-write never leaves half a row
        # (a few hundred rows of a few hundred bytes: cheap next to a training version)
        self._rewrite()
        if self._tb is not None:
            for k, v in row.items():
                if k != "version" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, version)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
