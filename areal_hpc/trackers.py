"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) behind one interface, fed by MetricsLogger."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import posixpath
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from areal_hpc.rundir import RunDir
from areal_hpc.utils import atomic_write_text

log = logging.getLogger("areal_hpc.trackers")

# logging.trackers' names (not folders: RunDir names those)
TENSORBOARD, WANDB, MLFLOW = TRACKERS = ("tensorboard", "wandb", "mlflow")
DEFAULT_TRACKERS = (TENSORBOARD,)
_PACKAGE = {WANDB: WANDB, MLFLOW: MLFLOW}  # the package an optional tracker imports (TensorBoard comes with torch's)
_MLFLOW_PARAM_CHARS = 6000  # MLflow refuses longer parameter values
_MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit; metrics allow 1000)
_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- :]")  # what MLflow refuses in a metric name


class TrackerNotInstalled(ValueError):
    """logging.trackers names a tracker whose package this Python cannot import; the message says how to add it.

    A ValueError: like a bad config value, it is refused before any work starts."""


def require_trackers(names: list[str]) -> None:
    """Raise TrackerNotInstalled for the first tracker whose package is missing (found without importing it)."""
    for name in names:
        if name in _PACKAGE and importlib.util.find_spec(_PACKAGE[name]) is None:
            raise TrackerNotInstalled(
                f"logging.trackers has {name}, but its package is not installed in {sys.prefix}; install the "
                "trackers extra (pip install -e '.[trackers]', as env/setup.sh does) or drop it from logging.trackers"
            )


@dataclass
class TrackerSettings:
    """What a tracker run is named and filed under, and the run's config as flat parameters."""

    run_name: str = "run"
    experiment: str = "areal-hpc"  # W&B project, MLflow experiment
    mlflow_uri: str = ""  # '' = a file store in the run directory
    params: dict[str, Any] = field(default_factory=dict)  # dotted key -> value


def flat_params(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys ({'rollout': {'eta': 4}} -> {'rollout.eta': 4}); lists stay values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def numbers(row: dict) -> dict[str, float]:
    """The row's numeric columns (metrics.csv re-read on a resume holds strings; '' is a missing value)."""
    out = {}
    for k, v in row.items():
        if k == "version" or v is None or isinstance(v, str) and not v:
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue  # a text column has no place in a scalar tracker
    return out


class Tracker:
    """One tracker run. `step` is the last version it holds (-1: none); it takes each version once."""

    name = "tracker"
    step = -1
    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_row(self, step: int, row: dict[str, float]) -> None:
        pass

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Scalars under RUN_DIR/tensorboard/; a resumed run hides the events after its checkpoint (purge_step)."""

    name = TENSORBOARD

    def __init__(self, run_dir: RunDir, keep_upto: int | None, kept_upto: int):
        from torch.utils.tensorboard import SummaryWriter

        # the kept rows (up to kept_upto) are in the event files already, unless TensorBoard joins on this resume
        self.step = kept_upto if keep_upto is not None and run_dir.tensorboard.exists() else -1
        purge = None if keep_upto is None else keep_upto + 1
        # flushed every few seconds by its own thread, not on every row of the training loop
        self._w = SummaryWriter(str(run_dir.tensorboard), flush_secs=10, purge_step=purge)

    def log_row(self, step: int, row: dict[str, float]) -> None:
        for k, v in row.items():
            self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


class WandbTracker(Tracker):
    """A W&B run, offline unless WANDB_MODE says otherwise; its folder is RUN_DIR/wandb/ (wandb sync uploads it)."""

    name = WANDB

    def __init__(self, run_dir: RunDir, s: TrackerSettings, run_id: str | None):
        import wandb

        mode = None if os.environ.get("WANDB_MODE") else "offline"  # compute nodes rarely reach the internet
        self.run = wandb.init(
            project=s.experiment,
            name=s.run_name,
            id=run_id,
            resume="allow",  # the stored id continues the same run; a new one starts it
            dir=str(run_dir.root),
            mode=mode,
            # rank 0's output is in its own log; the tracker keeps metrics, not a second copy of it
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = self.run.id

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)  # a resume may change settings (more versions)

    def log_row(self, step: int, row: dict[str, float]) -> None:
        self.run.log(row, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in logging.mlflow_uri, or in a file store at RUN_DIR/mlruns/ (no server, any shared filesystem)."""

    name = MLFLOW

    def __init__(self, run_dir: RunDir, s: TrackerSettings, run_id: str | None):
        if not s.mlflow_uri:
            # MLflow 3.x keeps its file store in maintenance mode behind this switch; a database on a cluster's
            # shared filesystem (SQLite over NFS or Lustre) would be the riskier store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=s.mlflow_uri or run_dir.mlflow.as_uri())
        self.resumed = False
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
                self.run_id, self.resumed = run_id, True
            except Exception as err:  # deleted, or a different logging.mlflow_uri than before: a new run
                log.warning("mlflow run %s not found (%s); starting a new one", run_id, str(err).splitlines()[0])
        if not self.resumed:
            exp = self.client.get_experiment_by_name(s.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(s.experiment)
            self.run_id = self.client.create_run(exp_id, run_name=s.run_name).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag

        text = {k: (v if isinstance(v, str) else json.dumps(v))[:_MLFLOW_PARAM_CHARS] for k, v in params.items()}
        have = self.client.get_run(self.run_id).data.params if self.resumed else {}
        new = [Param(k, v) for k, v in text.items() if k not in have]
        # MLflow's parameters never change; a resume's new value goes beside it as a tag resume.<key>
        changed = [RunTag(f"resume.{k}", v) for k, v in text.items() if k in have and have[k] != v]
        for i in range(0, max(len(new), len(changed)), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + _MLFLOW_BATCH], tags=changed[i : i + _MLFLOW_BATCH])

    def log_row(self, step: int, row: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), v, now, step) for k, v in row.items()])

    def log_summary(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        # metrics of their own (summary.<key>), so the per-version histories hold metrics.csv's rows alone
        now, step = int(time.time() * 1000), int(summary.get("versions") or 0)
        nums = numbers({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        tags = {k: v for k, v in summary.items() if v is not None and not isinstance(v, (int, float))}
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(f"summary.{k}", v, now, step) for k, v in nums.items()],
            tags=[RunTag(f"summary.{k}", v if isinstance(v, str) else json.dumps(v)) for k, v in tags.items()],
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def mlflow_name(column: str) -> str:
    """A metrics.csv column as MLflow takes a metric name: a name of a reward's extra or an ep.log call with a
    character MLflow refuses (or that reads as another path) would otherwise switch the tracker off."""
    name = _MLFLOW_BAD_CHARS.sub("_", column)
    if posixpath.normpath(name) != name or name.startswith((".", "/")):
        name = name.replace("/", "_").replace(".", "_")
    return name


class Trackers:
    """Fans MetricsLogger's calls out to every tracker. A tracker that raises is logged once and dropped: a
    tracking service's trouble never costs the run. Each tracker run's id and last version are kept in
    RUN_DIR/trackers.json, so a resumed run continues the same tracker run and sends no version twice."""

    def __init__(self, run_dir: RunDir, names: list[str], settings: TrackerSettings, kept: list[dict], keep_upto):
        self.run_dir = run_dir
        self.state = self._read_state() if keep_upto is not None else {}
        self.active: list[Tracker] = []
        kept_upto = max((int(float(r["version"])) for r in kept), default=-1)
        for name in names:
            tracker = self._guard(name, "open", lambda n=name: self._open(n, settings, keep_upto, kept_upto))
            if tracker is None:
                continue
            self.active.append(tracker)
            if tracker.run_id:
                self.state[name] = {"id": tracker.run_id, "step": tracker.step}
            self._call(tracker, "log_params", settings.params)
        self._write_state()
        ahead = [t for t in self.active if keep_upto is not None and t.step > keep_upto]
        if ahead:
            log.info(
                "%s hold versions %d..%d from before this resume; their re-trained rows go to metrics.csv only",
                ", ".join(t.name for t in ahead), keep_upto + 1, max(t.step for t in ahead),
            )  # fmt: skip
        # rows of the run from before this tracker joined it (or before a crash cut its feed): sent once now
        for row in kept:
            self.log_row(int(float(row["version"])), row)

    def _open(self, name: str, s: TrackerSettings, keep_upto: int | None, kept_upto: int) -> Tracker:
        before = self.state.get(name) or {}
        if name == TENSORBOARD:
            return TensorBoardTracker(self.run_dir, keep_upto, kept_upto)
        cls = WandbTracker if name == WANDB else MlflowTracker
        tracker = cls(self.run_dir, s, before.get("id"))
        if tracker.run_id == before.get("id"):
            tracker.step = int(before.get("step", -1))
        return tracker

    def _read_state(self) -> dict:
        try:
            return json.loads(self.run_dir.trackers_state.read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self) -> None:
        if any(t.run_id for t in self.active):
            atomic_write_text(self.run_dir.trackers_state, json.dumps(self.state, indent=1))

    def _guard(self, name: str, what: str, fn):
        try:
            return fn()
        except Exception as err:  # any failure of a tracker's library or service
            first = (str(err).strip().splitlines() or [""])[0]
            log.warning("tracker %s failed to %s (%s: %s); it is off for the rest of this run", name, what,
                        type(err).__name__, first)  # fmt: skip
            return None

    def _call(self, tracker: Tracker, method: str, *args) -> None:
        if self._guard(tracker.name, method, lambda: getattr(tracker, method)(*args) or True) is None:
            self.active.remove(tracker)  # its id stays in trackers.json: a resume continues its run

    def log_row(self, step: int, row: dict) -> None:
        values = numbers(row)
        moved = False
        for t in list(self.active):
            if step > t.step:  # a version once: the re-trained rows after a resume's checkpoint are not resent
                self._call(t, "log_row", step, values)
                if t in self.active:
                    t.step, moved = step, True
                    if t.run_id:
                        self.state[t.name]["step"] = step
        if moved:
            self._write_state()

    def log_summary(self, summary: dict) -> None:
        for t in list(self.active):
            self._call(t, "log_summary", summary)

    def close(self) -> None:
        for t in list(self.active):
            self._call(t, "close")
        self.active.clear()


def tracker_lines(names: list[str], run_dir: RunDir, mlflow_uri: str = "") -> list[str]:
    """The end of a run's printout: where each tracker's records are and the command that shows them."""
    lines = []
    for name in names:
        if name == TENSORBOARD:
            lines.append(f"tensorboard: tensorboard --logdir {run_dir.tensorboard}")
        elif name == WANDB:
            online = os.environ.get("WANDB_MODE", "offline") not in ("offline", "dryrun", "disabled")
            lines.append(
                f"wandb:       {run_dir.wandb} (online)"
                if online
                else f"wandb:       wandb sync {run_dir.wandb}/offline-run-*  (from a node with internet access)"
            )
        elif name == MLFLOW:
            where = mlflow_uri or f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {run_dir.mlflow}"
            lines.append(f"mlflow:      {where}")
    return lines
