"""A run's record of its model (RUN_DIR/model.json: config.json and weights by sha256): moved, never changed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from areal_hpc.data.record import file_sha256
from areal_hpc.rundir import DEEPSPEED_TAG, REFERENCE_FILE, RunDir
from areal_hpc.utils import atomic_write_text

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")  # what check_model_folder counts as weights


def _config_sha256(folder: Path) -> str:
    """config.json's content (not its bytes' layout): a copy written by another tool still matches."""
    content = json.loads((folder / "config.json").read_text())
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def model_fingerprint(path: os.PathLike | str, cache: dict | None = None) -> dict:
    """What identifies a model folder: config.json's content hash and one sha256 over its weight files (names,
    sizes, contents). `cache` maps "path|size|mtime_ns" to a file's sha256 and is filled in: an unchanged file
    is read once."""
    folder = Path(path).resolve()
    files = sorted({f for pat in WEIGHT_PATTERNS for f in folder.glob(pat)})
    return {"path": str(folder), "config_sha256": _config_sha256(folder)} | _files_digest(folder, files, cache)


def _files_digest(folder: Path, paths: list[Path], cache: dict | None) -> dict:
    """weights_sha256 (one sha256 over the files' names relative to `folder`, sizes and contents), bytes, files."""
    files = {}
    for f in paths:
        st = f.stat()
        key = f"{f}|{st.st_size}|{st.st_mtime_ns}"
        if cache is None or key not in cache:
            sha, _ = file_sha256(f)
            if cache is not None:
                cache[key] = sha
        files[str(f.relative_to(folder))] = {"bytes": st.st_size, "sha256": cache[key] if cache is not None else sha}
    h = hashlib.sha256()
    for name, info in files.items():
        h.update(f"{name} {info['bytes']} {info['sha256']}\n".encode())
    return {"weights_sha256": h.hexdigest(), "bytes": sum(i["bytes"] for i in files.values()), "files": files}


def _read_cache(run: RunDir) -> dict:
    try:
        return json.loads(run.model_hashes.read_text())
    except (OSError, ValueError):
        return {}


def _fingerprint(run: RunDir, path: os.PathLike | str) -> tuple[dict, dict | None]:
    """model_fingerprint with the run's hash cache (RunDir.model_hashes); the cache as it should be saved, or None
    when nothing new was hashed."""
    cache = _read_cache(run)
    before = len(cache)
    fp = model_fingerprint(path, cache)
    return fp, (cache if len(cache) != before else None)


def _save_cache(run: RunDir, cache: dict | None) -> None:
    """Only the run's own model's hashes are kept (a refusal writes nothing); a cache only, rewritten freely."""
    if cache is not None:
        try:
            atomic_write_text(run.model_hashes, json.dumps(cache, indent=1))
        except OSError:
            pass  # a cache that cannot be written only costs a hash next time


def read_model_record(run_dir: os.PathLike | str) -> dict | None:
    """RUN_DIR/model.json, or None for a run that has none yet (not started, or started before runs recorded it)."""
    try:
        return json.loads(RunDir(run_dir).model.read_text())
    except FileNotFoundError:
        return None


def model_mismatch(run_dir: os.PathLike | str, path: os.PathLike | str, record: dict | None = None) -> str | None:
    """One line if the model folder `path` is not the run's model (RUN_DIR/model.json, or `record`): missing,
    another config.json or other weights; None when it is (the same files, wherever they now lie) or when the
    run has no record."""
    run = RunDir(run_dir)
    rec = record if record is not None else read_model_record(run.root)
    if rec is None:
        return None
    allowed = f"the run's model ({rec['path']}) may only be moved: point model.path at a copy of its files"
    p = Path(path)
    if not (p / "config.json").is_file():
        what = "does not exist" if not p.exists() else "has no config.json"
        return f"model.path={str(p)!r} {what}; {allowed}"
    now, cache = _fingerprint(run, p)
    if now["config_sha256"] != rec["config_sha256"]:
        return f"model.path={str(p)!r} is another model: its config.json differs from the run's; {allowed}"
    if now["weights_sha256"] != rec["weights_sha256"]:
        return (
            f"model.path={str(p)!r} is another model: its weights' sha256 {now['weights_sha256'][:12]} differs from "
            f"the run's {rec['weights_sha256'][:12]}; {allowed}"
        )
    _save_cache(run, cache)
    return None


def record_model(run_dir: os.PathLike | str, path: os.PathLike | str) -> None:
    """Write RUN_DIR/model.json at the run's first start (atomically; never rewritten)."""
    run = RunDir(run_dir)
    if not run.model.exists():
        fp, cache = _fingerprint(run, path)
        atomic_write_text(run.model, json.dumps(fp, indent=1))
        _save_cache(run, cache)


# -- the distillation teacher (RUN_DIR/teacher.json): a resume keeps the same one -------------------------------
CHECKPOINT_WEIGHTS = ("*.safetensors", f"{DEEPSPEED_TAG}/*_states.pt")  # what holds a trainer checkpoint's weights


def teacher_fingerprint(teacher: os.PathLike | str, cache: dict | None = None) -> dict:
    """A teacher's identity: a Hugging Face folder's as model_fingerprint gives it, or a trainer checkpoint's (its
    run's config.json and its weight files: safetensors, or DeepSpeed's model and optimizer shards)."""
    from areal_hpc.model.teacher import teacher_folder

    folder, is_ckpt = teacher_folder(teacher)
    if not is_ckpt:
        return model_fingerprint(folder, cache) | {"kind": "folder"}
    ckpt = Path(teacher).resolve()
    files = sorted({f for pat in CHECKPOINT_WEIGHTS for f in ckpt.glob(pat)} - {ckpt / REFERENCE_FILE})
    fp = {"path": str(ckpt), "kind": "checkpoint", "config_sha256": _config_sha256(folder)}
    return fp | _files_digest(ckpt, files, cache)


def teacher_mismatch(run_dir: os.PathLike | str, teacher: str) -> str | None:
    """One line if a start of a run that has started before names another teacher than its first start did (or
    distils where it did not, or the reverse); None when it is the same (its files, wherever they now lie)."""
    run = RunDir(run_dir)
    try:
        rec = json.loads(run.teacher.read_text())
    except FileNotFoundError:
        rec = None
    if rec is None:
        if teacher and run.model.exists():
            return (
                f"distill.teacher={teacher!r}, but the run started without distillation; a resume keeps its objective"
            )
        return None
    keep = f"the run distils from {rec['path']}: a resume keeps the same teacher (its files may only be moved)"
    if not teacher:
        return f"distill.teacher is empty; {keep}"
    from areal_hpc.model.teacher import TeacherError

    try:
        now = teacher_fingerprint(teacher, _read_cache(run))
    except TeacherError as err:
        return f"{err}; {keep}"
    for key, what in (("config_sha256", "config.json differs"), ("weights_sha256", "weights differ")):
        if now[key] != rec[key]:
            return f"distill.teacher={teacher!r} is another model: its {what} from the run's teacher; {keep}"
    return None


def record_teacher(run_dir: os.PathLike | str, teacher: str) -> None:
    """Write RUN_DIR/teacher.json at the run's first start with a teacher (atomically; never rewritten)."""
    run = RunDir(run_dir)
    if teacher and not run.teacher.exists():
        cache = _read_cache(run)
        atomic_write_text(run.teacher, json.dumps(teacher_fingerprint(teacher, cache), indent=1))
        _save_cache(run, cache)
