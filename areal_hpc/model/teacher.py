"""Which teacher a run distils from: its folder (a Hugging Face folder or a checkpoint of this project), and the
start-up check that it shares the student's tokenizer."""

from __future__ import annotations

from pathlib import Path

from areal_hpc.engines.teacher import DistillSpec


class TeacherError(ValueError):
    """A teacher the run cannot use; one line naming distill.teacher and what is wrong."""


def teacher_folder(path: str | Path) -> tuple[Path, bool]:
    """The folder whose config.json and tokenizer the teacher has, and whether `path` is a checkpoint of this
    project (its weights are then the checkpoint's, its architecture its run's model folder's)."""
    from areal_hpc.model import ModelFolderError, check_model_folder
    from areal_hpc.model.checkpoints import run_of_checkpoint
    from areal_hpc.model.export import ExportError, checkpoint_model

    p = Path(path).resolve()
    if (p / "config.json").is_file():
        try:
            return check_model_folder(p), False  # weights and tokenizer files there
        except ModelFolderError as err:
            raise TeacherError(f"distill.teacher: {err}") from None
    if p.is_dir() and run_of_checkpoint(p) is not None:
        try:
            return checkpoint_model(p, weights=False)[0], True
        except ExportError as err:
            raise TeacherError(f"distill.teacher: {err}") from None
    from areal_hpc.rundir import RunDir

    like = RunDir("RUN_DIR").trainer_checkpoint(42)
    what = "does not exist" if not p.exists() else f"is neither a Hugging Face folder nor a checkpoint (like {like})"
    raise TeacherError(f"distill.teacher={str(p)!r} {what}")


def teacher_problem(teacher: str) -> str | None:
    """One line if distill.teacher is set and names neither a Hugging Face folder nor a complete checkpoint."""
    try:
        if teacher:
            teacher_folder(teacher)
    except TeacherError as err:
        return str(err)
    return None


def _vocab_size(folder: Path) -> int:
    import json

    cfg = json.loads((folder / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)


def check_teacher(teacher: str, student: str | Path) -> None:
    """One line (TeacherError) unless the teacher shares the student's tokenizer (the same token -> id map) and its
    output layer covers every id the student can sample; the launchers run it before any rank loads a model."""
    from areal_hpc.model import load_tokenizer

    if not teacher:
        return
    folder, _ = teacher_folder(teacher)
    theirs, ours = load_tokenizer(folder).get_vocab(), load_tokenizer(student).get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=str)
        token = differ[0][0]
        raise TeacherError(
            f"distill.teacher={teacher!r} has another tokenizer than model.path: {len(theirs)} vs {len(ours)} tokens, "
            f"{token!r} is {theirs.get(token)} vs {ours.get(token)}; the teacher must use the student's tokenizer"
        )
    need = max(len(ours), _vocab_size(Path(student)))
    if _vocab_size(folder) < need:
        raise TeacherError(
            f"distill.teacher={teacher!r} has an output layer of {_vocab_size(folder)} tokens, fewer than the "
            f"{need} ids the student can sample; the teacher must cover the student's vocabulary"
        )


def distill_spec(teacher: str, coef: float = 1.0, estimator: str = "sample") -> DistillSpec:
    """What a trainer distils from: the teacher's folder, and for a checkpoint a reader of its weights (called on the
    trainer when the teacher loads, so nothing is read before the first version)."""
    from areal_hpc.model.export import checkpoint_model

    folder, is_ckpt = teacher_folder(teacher)
    read = (lambda: checkpoint_model(teacher)[1]) if is_ckpt else None  # a checkpoint's fp32 weights, cast on load
    return DistillSpec(teacher, coef, str(folder), read, estimator)
