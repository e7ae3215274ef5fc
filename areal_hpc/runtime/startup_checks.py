"""The start-up check list, in one order, for every start: the local launcher, the Slurm job's script and the
synchronous loop run it before any rank (or engine) starts work."""

from __future__ import annotations

from pathlib import Path

from areal_hpc.config import Config
from areal_hpc.data import MathDataset
from areal_hpc.engines import require_installed
from areal_hpc.model import ensure_model
from areal_hpc.model.record import model_mismatch, record_model, record_teacher, teacher_mismatch
from areal_hpc.rundir import RunDir
from areal_hpc.rundir.actions import before_start
from areal_hpc.runtime.build import check_model_fits
from areal_hpc.runtime.rank0.resume import check_resumable
from areal_hpc.trackers import require_trackers
from areal_hpc.workflow import check_user_code
from areal_hpc.workflow.warm_start import check_warm_start


class StartRefused(ValueError):
    """A start of a run whose run dir records another model or teacher: one line."""


def check_start(cfg: Config, run_root: Path, resume: bool) -> tuple[Path, MathDataset | None]:
    """Every start-up check, each failing with one line, in this order: the engines' and trackers' packages,
    the user's code (reward.fn, workflow.fn), the run's recorded model and teacher (a start of a run that
    started before keeps them), then a resume's checkpoint or a fresh start's warm-start rows, then the model
    folder (built here, once, never by several ranks at once) and whether the task fits it. Nothing is written
    in the run dir; returns the model folder and the dataset whose prompts were checked (None: none were)."""
    require_installed(cfg.rollout.engine, cfg.trainer.engine)
    require_trackers(cfg.logging.trackers)
    check_user_code(cfg)
    # before ensure_model: a run's missing model is never rebuilt as another
    for why in (model_mismatch(run_root, cfg.model.path), teacher_mismatch(run_root, cfg.distill.teacher)):
        if why:
            raise StartRefused(why)
    if resume:
        check_resumable(run_root, cfg)  # CheckpointError on a damaged checkpoint, before the config is rewritten
    else:  # a resumed run's weights are past the warm start
        check_warm_start(cfg)  # rows lacking what the warm start trains on
    model_dir = ensure_model(cfg.model)
    dataset = check_model_fits(cfg, model_dir)  # the prompts fit the context, LoRA targets, the teacher's tokenizer
    return model_dir, dataset


def record_start(run: RunDir, cfg: Config) -> None:
    """After the checks, once the run dir holds the config: the model and teacher of the first start are
    recorded (model.json, teacher.json), and an earlier start's stop request and error files go."""
    record_model(run.root, cfg.model.path)
    record_teacher(run.root, cfg.distill.teacher)
    before_start(run)
