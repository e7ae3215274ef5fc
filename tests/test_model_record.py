"""A run's record of its model (RUN_DIR/model.json): its files moved are the run's model; another model, a folder
changed in place or a folder that is gone is not, and no start builds a new model in its place."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from areal_hpc.config import load_config
from areal_hpc.model import build_tiny_model
from areal_hpc.model.record import model_mismatch, record_model
from areal_hpc.rundir import RunDir
from areal_hpc.rundir.actions import create

ROOT = Path(__file__).resolve().parents[1]


def _mtimes(run: RunDir) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in run.root.iterdir()}


def test_the_same_files_moved_pass_another_model_does_not(tmp_path):
    model, other = build_tiny_model(tmp_path / "model"), build_tiny_model(tmp_path / "other", seed=1)
    assert (model / "config.json").read_text() == (other / "config.json").read_text()  # only the weights differ
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    record_model(run.root, model)
    record = run.model.read_text()
    moved = shutil.copytree(model, tmp_path / "moved")
    assert model_mismatch(run.root, model) is None and model_mismatch(run.root, moved) is None
    assert any(k.startswith(f"{moved}/") for k in json.loads(run.model_hashes.read_text()))  # hashed once

    before = _mtimes(run)
    assert "is another model: its weights' sha256" in model_mismatch(run.root, other)
    layers = shutil.copytree(model, tmp_path / "layers")
    config = json.loads((layers / "config.json").read_text())
    (layers / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert "its config.json differs from the run's" in model_mismatch(run.root, layers)
    shutil.copyfile(other / "model.safetensors", moved / "model.safetensors")  # changed in place
    assert "is another model" in model_mismatch(run.root, moved)
    assert "does not exist" in model_mismatch(run.root, tmp_path / "gone")
    record_model(run.root, other)  # written once, at the first start
    assert run.model.read_text() == record and _mtimes(run) == before  # a refusal writes nothing


def test_a_start_never_builds_a_model_where_the_run_s_model_was(tmp_path):
    run, model = RunDir(tmp_path / "run"), tmp_path / "model"
    cfg = load_config(ROOT / "jobs" / "demo.yaml", [f"store.run_dir={run}", f"model.path={model}"])
    assert cfg.model.build_tiny
    create(run, cfg)
    prepare = [sys.executable, "-m", "areal_hpc.cli", "prepare", str(run)]
    first = subprocess.run(prepare, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and json.loads(run.model.read_text())["path"] == str(model), first.stderr
    shutil.move(model, tmp_path / "elsewhere")
    again = subprocess.run(prepare, capture_output=True, text=True, timeout=300)
    lines = again.stderr.strip().splitlines()
    assert again.returncode != 0 and len(lines) == 1 and "does not exist" in lines[0], again.stderr
    assert not model.exists()
