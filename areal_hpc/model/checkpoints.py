"""A run's checkpoint as a model: which run and version a folder is, the model it trained, its LoRA base."""

from __future__ import annotations

from pathlib import Path

from areal_hpc.config import load_config
from areal_hpc.rundir import ADAPTER_FILE, RunDir


def run_of_checkpoint(path: Path) -> tuple[RunDir, int] | None:
    """The run dir and version of RUN_DIR/checkpoints/vN, None for any other folder."""
    run = RunDir(path.parent.parent)
    if not path.name[1:].isdigit():
        return None
    version = int(path.name[1:])
    if run.trainer_checkpoint(version) != path or not run.config.is_file():
        return None
    return run, version


def run_model_folder(run: RunDir) -> Path:
    """The model folder a run trained (model.path in its config.yaml; relative: to where it was started, here)."""
    return Path(load_config(run.config).model.path).resolve()


def adapter_base_folder(run: RunDir) -> Path:
    """The model a LoRA run's adapters apply to: its warm-started base if it wrote one, else model.path."""
    return run.base_model if run.base_model.is_dir() else run_model_folder(run)


def is_lora_checkpoint(path: Path) -> bool:
    return (Path(path) / ADAPTER_FILE).is_file()
