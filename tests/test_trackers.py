"""Experiment trackers: logging.trackers in the config, and what TensorBoard, W&B (offline) and MLflow (file store)
hold after real runs, read back through each library's own reader; never a network."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from areal_hpc.config import ConfigError, load_config, to_yaml
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.reporting.metrics import MetricsLogger
from areal_hpc.trackers import TrackerNotInstalled, flat_params

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
CLI = [sys.executable, "-m", "areal_hpc.cli"]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """W&B offline, with no key; MLflow's file store allowed (the readers need it too)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


# -- readers -------------------------------------------------------------------------------------


def wandb_records(path: Path):
    """The records of one offline run file (run-<id>.wandb), decoded with wandb's own protobuf messages.

    The file is W&B's record log: a 7-byte header (':W&B', 0xBEE1, version), then LevelDB-log blocks of
    32 KiB whose chunks (7-byte header: crc32, length, type full/first/middle/last) carry one Record each."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), path
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def wandb_run(run_dir: Path) -> dict:
    """Every offline launch of the run's W&B folder, oldest first: run id, config, history rows by step, summary."""
    launches = []
    for f in sorted(RunDir(run_dir).wandb.glob("offline-run-*/run-*.wandb")):
        out = {"id": None, "config": {}, "history": {}, "summary": {}}
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                out["id"] = rec.run.run_id
                out["config"].update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            elif kind == "config":
                out["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update})
            elif kind == "history":
                row = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                out["history"][int(row["_step"])] = row
            elif kind == "summary":
                out["summary"].update(
                    {(u.key or ".".join(u.nested_key)): json.loads(u.value_json) for u in rec.summary.update}
                )
        launches.append(out)
    return launches


def mlflow_client(run_dir: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=RunDir(run_dir).mlflow.as_uri())


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(RunDir(run_dir).tensorboard)).Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _same(a: float, b: float) -> bool:
    return (pd.isna(a) and pd.isna(b)) or a == pytest.approx(b, rel=1e-5)


# -- config ----------------------------------------------------------------------------------------


def test_trackers_default_to_tensorboard_and_old_configs_map_onto_them(tmp_path, capsys):
    assert load_config(DEMO).logging.trackers == ["tensorboard"]
    assert load_config(DEMO, ["logging.trackers=[wandb,mlflow]"]).logging.trackers == ["wandb", "mlflow"]
    assert load_config(DEMO, ["logging.trackers=[]"]).logging.trackers == []
    capsys.readouterr()
    old = tmp_path / "old.yaml"
    old.write_text(f"base: {DEMO}\nlogging:\n  tensorboard: false\n")
    cfg = load_config(old)
    assert cfg.logging.trackers == []
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["areal-hpc: config logging.tensorboard=false is deprecated; it means logging.trackers=[]"]
    # a written config has only the new key, so the ranks (and a resume) never see the old one
    assert "tensorboard" not in yaml.safe_load(to_yaml(cfg))["logging"]
    cfg = load_config(old, ["logging.tensorboard=true", "logging.trackers=[wandb,tensorboard]"])
    assert cfg.logging.trackers == ["tensorboard", "wandb"]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["logging.trackers=[tensorboard,neptune]"], "has 'neptune', which is not a tracker; choose from tensorboard"),
        (["logging.trackers=wandb"], "logging.trackers must be a list in brackets, e.g. logging.trackers=[a,b]"),
        (["logging.trackers=[wandb,wandb]"], "names a tracker twice"),
        (["logging.tensorboard=false", "logging.trackers=[tensorboard]"], "contradicts logging.trackers"),
    ],
)
def test_bad_trackers_stop_with_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_tracker_whose_package_is_missing_stops_the_run_before_it_starts(tmp_path, monkeypatch):
    import areal_hpc.trackers as trackers
    from areal_hpc.launch.local import launch

    # as on a venv without the extra: the package wandb would be imported from is not there
    monkeypatch.setitem(trackers._PACKAGE, "wandb", "wandb_is_not_installed_here")
    cfg = load_config(DEMO, [f"store.run_dir={tmp_path / 'run'}", "logging.trackers=[tensorboard,wandb]"])
    with pytest.raises(TrackerNotInstalled) as err:
        launch(cfg, progress=False)
    assert "logging.trackers has wandb" in str(err.value) and "pip install -e '.[trackers]'" in str(err.value)
    assert not (tmp_path / "run").exists()  # refused before the run dir was written


# -- the fan-out, on the real libraries ---------------------------------------------------------------


def _logger(run_dir: Path, names, keep_upto=None) -> MetricsLogger:
    cfg = load_config(DEMO, [f"store.run_dir={run_dir}", "run_name=fanout"])
    return MetricsLogger(run_dir, names, keep_upto=keep_upto, config=cfg)


def test_a_failing_tracker_is_logged_once_and_dropped_while_the_others_go_on(tmp_path, caplog):
    m = _logger(tmp_path, ["tensorboard", "mlflow"])
    m.log(0, {"reward_mean": 0.5})
    shutil.rmtree(RunDir(tmp_path).mlflow)  # the store vanishes under the run (a quota purge, a full disk)
    with caplog.at_level(logging.WARNING, logger="areal_hpc.trackers"):
        for v in (1, 2):
            m.log(v, {"reward_mean": 0.5 + v})
        m.close({"versions": 2})
    failed = [r.getMessage() for r in caplog.records if "tracker mlflow failed" in r.getMessage()]
    assert len(failed) == 1 and "off for the rest of this run" in failed[0], failed
    assert pd.read_csv(RunDir(tmp_path).metrics)["reward_mean"].tolist() == [0.5, 1.5, 2.5]
    assert tensorboard_scalars(tmp_path)["reward_mean"] == {0: 0.5, 1: 1.5, 2: 2.5}


def test_a_column_named_as_mlflow_refuses_keeps_mlflow_on(tmp_path, caplog):
    # a reward's extra or an ep.log name is the user's: "@" or "(" in it must not switch MLflow off
    m = _logger(tmp_path, ["mlflow"])
    with caplog.at_level(logging.WARNING, logger="areal_hpc.trackers"):
        for v in (0, 1):
            m.log(v, {"episode/pass@1": v / 2, "reward/len(x)": float(v)})
        m.close({"versions": 1})
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    client = mlflow_client(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("areal-hpc").experiment_id])
    assert [p.value for p in client.get_metric_history(run.info.run_id, "episode/pass_1")] == [0, 0.5]
    assert run.data.metrics["reward/len_x_"] == 1 and run.info.status == "FINISHED"


def test_a_resume_sends_each_version_once_and_a_tracker_added_then_gets_the_history(tmp_path):
    m = _logger(tmp_path, ["tensorboard", "mlflow"])
    for v in range(6):
        m.log(v, {"loss": float(v), "reward/format": v / 10})  # a reward's extra number: a name with a slash
    # killed here: the checkpoint is v3, so the resumed launch re-trains v4 and v5 (new values) and goes on
    m2 = _logger(tmp_path, ["tensorboard", "mlflow", "wandb"], keep_upto=3)
    for v in range(4, 8):
        m2.log(v, {"loss": 10.0 + v})
    m2.close({"versions": 7, "acc_final": 0.25})
    csv = pd.read_csv(RunDir(tmp_path).metrics)
    assert csv["loss"].tolist() == [0, 1, 2, 3, 14, 15, 16, 17]
    # TensorBoard hides the events after the checkpoint (purge_step): what it shows is metrics.csv
    assert tensorboard_scalars(tmp_path)["loss"] == dict(zip(csv["version"], csv["loss"]))
    # MLflow takes each version once: its history keeps the rows it had, then goes on; no step twice
    client = mlflow_client(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("areal-hpc").experiment_id])
    hist = {p.step: p.value for p in client.get_metric_history(run.info.run_id, "loss")}
    assert len(client.get_metric_history(run.info.run_id, "loss")) == len(hist) == 8
    assert hist == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 16, 7: 17}
    assert [p.value for p in client.get_metric_history(run.info.run_id, "reward/format")] == [
        0,
        0.1,
        0.2,
        0.3,
        0.4,
        0.5,
    ]
    assert run.data.metrics["summary.acc_final"] == 0.25 and run.info.status == "FINISHED"
    # W&B joined on the resume: it got the kept history first, then the new rows
    (wb,) = wandb_run(tmp_path)
    assert {s: r["loss"] for s, r in wb["history"].items()} == dict(zip(csv["version"], csv["loss"]))
    assert wb["summary"]["acc_final"] == 0.25 and wb["config"]["run_name"] == "fanout"
    assert [wb["history"][v]["reward/format"] for v in range(4)] == [0, 0.1, 0.2, 0.3]
    assert json.loads(RunDir(tmp_path).trackers_state.read_text())["wandb"] == {"id": wb["id"], "step": 7}


# -- one real run, resumed ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_and_its_resume_log_every_metric_the_config_and_the_summary_to_each_tracker(tmp_path):
    run = tmp_path / "run"
    args = [
        str(DEMO),
        f"store.run_dir={run}",
        f"model.path={tmp_path / 'model'}",
        "trainer.versions=3",
        "trainer.max_wall_s=0",
        "rollout.batch_prompts=8",
        "logging.eval_prompts=8",
        "logging.eval_every=2",
        "logging.trackers=[tensorboard,wandb,mlflow]",
    ]
    first = subprocess.run([*CLI, "run", *args, "--no-progress"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert f"wandb sync {run}/wandb/offline-run-*" in first.stdout
    again = subprocess.run(
        [*CLI, "run", "--resume", str(run), "trainer.versions=5", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr
    csv = pd.read_csv(RunDir(run).metrics)
    summary = json.loads(RunDir(run).summary.read_text())
    params = flat_params(yaml.safe_load(RunDir(run).config.read_text()))  # the resolved config, as the run wrote it
    assert csv["version"].tolist() == [0, 1, 2, 3, 4, 5] and summary["versions"] == 5
    columns = [c for c in csv.columns if c != "version" and pd.api.types.is_numeric_dtype(csv[c])]
    assert {"reward_mean", "loss", "heldout_acc", "staleness_mean"} <= set(columns)

    # W&B: one run id over both launches; steps 0..3, then 4..5 (the checkpoint's v3 is not sent again)
    first_wb, second_wb = wandb_run(run)
    assert first_wb["id"] == second_wb["id"]
    assert sorted(first_wb["history"]) == [0, 1, 2, 3] and sorted(second_wb["history"]) == [4, 5]
    history = {**first_wb["history"], **second_wb["history"]}
    for _, row in csv.iterrows():
        got = history[int(row["version"])]
        for c in columns:
            if pd.notna(row[c]):
                assert _same(got[c], row[c]), (c, row["version"])
            else:
                assert c not in got or got[c] is None or pd.isna(got[c]), (c, row["version"])
    assert {k: second_wb["config"][k] for k in params} == params  # the resumed launch's config, key by key
    assert second_wb["config"]["trainer.versions"] == 5 and first_wb["config"]["trainer.versions"] == 3
    for k in ("acc_final", "tokens_consumed", "stop_reason", "versions"):
        assert second_wb["summary"][k] == summary[k], k

    # MLflow: one run, each column's history equal to metrics.csv's, params the config, summary at the end
    client = mlflow_client(run)
    (ml,) = client.search_runs([client.get_experiment_by_name("areal-hpc").experiment_id])
    state = json.loads(RunDir(run).trackers_state.read_text())
    assert state["mlflow"] == {"id": ml.info.run_id, "step": 5} and state["wandb"]["id"] == first_wb["id"]
    for c in columns:
        points = client.get_metric_history(ml.info.run_id, c)
        want = {int(v): x for v, x in zip(csv["version"], csv[c]) if pd.notna(x)}
        assert len(points) == len({p.step for p in points}), c  # no version twice
        got = {p.step: p.value for p in points if not pd.isna(p.value)}  # a NaN cell reads back as NaN or empty
        assert got.keys() == want.keys() and all(_same(got[s], want[s]) for s in want), c
    assert ml.data.params["rollout.eta"] == str(params["rollout.eta"]) and ml.data.params["run_name"] == "demo"
    assert set(params) <= set(ml.data.params)
    assert ml.data.params["trainer.versions"] == "3" and ml.data.tags["resume.trainer.versions"] == "5"
    assert ml.data.metrics["summary.acc_final"] == pytest.approx(summary["acc_final"])
    assert ml.data.tags["summary.stop_reason"] == summary["stop_reason"] and ml.info.status == "FINISHED"

    # TensorBoard: the same rows
    tb = tensorboard_scalars(run)
    assert tb["reward_mean"] == pytest.approx({v: x for v, x in zip(csv["version"], csv["reward_mean"]) if pd.notna(x)})


def test_a_resume_of_a_run_from_before_trackers_takes_them_from_an_override(tmp_path):
    # its config.yaml says logging.tensorboard (the old default, written into every run) and cannot be edited
    old = tmp_path / "config.yaml"
    old.write_text(f"base: {DEMO}\nlogging:\n  tensorboard: true\n")
    assert load_config(old, ["logging.trackers=[wandb]"]).logging.trackers == ["wandb"]
    assert load_config(old).logging.trackers == ["tensorboard"]
