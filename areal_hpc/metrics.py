"""Per-version metrics: a tidy CSV table in the run dir plus TensorBoard scalars."""

from __future__ import annotations

import csv
from pathlib import Path


class MetricsLogger:
    """Appends one row per version to metrics.csv (flushed each row) and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.csv_path = self.run_dir / "metrics.csv"
        self.tb_dir = self.run_dir / "tensorboard"
        self._fields: list[str] | None = None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tb_dir))

    def log(self, version: int, row: dict[str, float]) -> None:
        row = {"version": version, **row}
        if self._fields is None:
            self._fields = list(row)
            new = not self.csv_path.exists()
            self._file = open(self.csv_path, "a", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=self._fields, extrasaction="ignore")
            if new:
                self._writer.writeheader()
        self._writer.writerow({k: row.get(k, "") for k in self._fields})
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "version" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, version)

    def scalar(self, name: str, value: float, version: int) -> None:
        if self._tb is not None:
            self._tb.add_scalar(name, value, version)

    def close(self) -> None:
        if self._fields is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
