"""The distillation teacher on a trainer: a frozen model in the trainer's compute precision, without gradients."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from areal_hpc.engines.reference import FrozenPolicy


@dataclass(frozen=True)
class DistillSpec:
    """What a trainer distils from (the distill section, resolved by areal_hpc.model.teacher.distill_spec): the teacher,
    the term's weight, the folder with its config and tokenizer (default: `teacher` itself, a Hugging Face folder),
    for a checkpoint of this project a reader of its weights, and the estimator (sample or full)."""

    teacher: str
    coef: float = 1.0
    folder: str = ""
    read_weights: Callable[[], dict] | None = None
    estimator: str = "sample"


def load_teacher(spec: DistillSpec, dtype: str, device, packing: bool, trees: bool = False) -> FrozenPolicy:
    """The teacher on this trainer's device in `dtype` (the trainer's compute precision), without gradients."""
    weights = spec.read_weights() if spec.read_weights is not None else None
    return FrozenPolicy(spec.folder or spec.teacher, weights, dtype, device, packing, trees)
