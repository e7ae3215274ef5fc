"""Per-version metrics: a tidy CSV table in the run dir, mirrored to the configured trackers."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

import yaml

from areal_hpc.rundir import RunDir
from areal_hpc.trackers import DEFAULT_TRACKERS, Trackers, TrackerSettings, flat_params
from areal_hpc.utils import atomic_write_text


class MetricsLogger:
    """One row per version in metrics.csv, mirrored to each tracker of logging.trackers (areal_hpc/trackers.py).

    Every row rewrites the file whole (atomically), with a header that widens when a row brings a new
    column, so the table stays tidy for pandas and is never left with half a row.
    """

    def __init__(
        self,
        run_dir: Path,
        trackers: Sequence[str] = DEFAULT_TRACKERS,
        keep_upto: int | None = None,
        config=None,
    ):
        """keep_upto: a resumed run keeps the existing rows up to this version and drops the rest.
        config: the run's Config (its name, logging.experiment and logging.mlflow_uri; every key a parameter)."""
        self.run_dir = Path(run_dir)
        self.csv_path = RunDir(run_dir).metrics
        self.tb_dir = RunDir(run_dir).tensorboard
        self.rows: list[dict] = []
        self.fields: list[str] = []
        if keep_upto is not None and self.csv_path.exists():
            with open(self.csv_path, newline="") as f:
                reader = csv.DictReader(f)
                self.fields = list(reader.fieldnames or [])
                # as logged: a reloaded row's numbers are numbers again (progress.json and status format them)
                self.rows = [row for r in reader if (row := typed_row(r)).get("version", keep_upto + 1) <= keep_upto]
            self._rewrite()
        settings = tracker_settings(config) if config is not None else TrackerSettings()
        self.trackers = Trackers(RunDir(run_dir), list(trackers), settings, self.rows, keep_upto)

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
        self.trackers.log_row(version, row)

    def close(self, summary: dict | None = None) -> None:
        """The run's summary (summary.json's values) to every tracker, then each tracker run ends."""
        if summary is not None:
            self.trackers.log_summary(summary)
        self.trackers.close()


def typed_row(row: dict) -> dict:
    """A row read back from metrics.csv as it was logged: numbers as int or float, other text as text, and an
    empty cell (a column this row never had) left out, as it was."""
    out = {}
    for k, v in row.items():
        if k is None or v is None or v == "":
            continue
        for cast in (int, float):
            try:
                v = cast(v)
                break
            except ValueError:
                pass
        out[k] = v
    return out


def tracker_settings(cfg) -> TrackerSettings:
    """The trackers' names for the run and its resolved config (as written to config.yaml) as dotted parameters."""
    from areal_hpc.config import to_yaml

    logging_cfg = cfg.logging
    params = flat_params(yaml.safe_load(to_yaml(cfg)))
    return TrackerSettings(cfg.run_name, logging_cfg.experiment, logging_cfg.mlflow_uri, params)
