"""A run's record of its dataset (RUN_DIR/dataset.json: what the data was, by fingerprint) and its rows read back."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pandas as pd

from areal_hpc.data import arithmetic_dataset, file_rows
from areal_hpc.rundir import RunDir
from areal_hpc.utils import atomic_write_text

ARITHMETIC_PARAMS = ("train_size", "heldout_size", "max_operand", "min_operand", "operator", "seed")
_CHUNK = 1 << 20


def _arithmetic_rows(params: dict) -> dict[int, dict]:
    """The arithmetic task's problems by row index (train ids first, then held-out), as the run drew them."""
    p = params
    ds = arithmetic_dataset(
        p["train_size"], p["heldout_size"], p["max_operand"], p["seed"], p["operator"], p["min_operand"]
    )
    return {q.row_index: q.row for q in sorted(ds.train + ds.heldout, key=lambda q: q.row_index)}


def _rows_sha256(rows: dict[int, dict]) -> str:
    h = hashlib.sha256()
    for i, row in rows.items():
        h.update(json.dumps([i, row], sort_keys=True).encode() + b"\n")
    return h.hexdigest()


def file_sha256(path: os.PathLike | str) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of a file's bytes."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def fingerprint(data_cfg) -> dict:
    """What identifies the data a run reads: a file's kind, path, size and sha256; for the arithmetic task its
    parameters and the sha256 of its problems (so a change to how they are drawn shows too)."""
    if data_cfg.kind == "arithmetic":
        params = {k: getattr(data_cfg, k) for k in ARITHMETIC_PARAMS}
        rows = _arithmetic_rows(params)
        return {"kind": "arithmetic", "params": params, "rows": len(rows), "sha256": _rows_sha256(rows)}
    path = Path(data_cfg.path).resolve()
    sha, size = file_sha256(path)
    return {"kind": data_cfg.kind, "path": str(path), "bytes": size, "sha256": sha}


def record_dataset(run_dir: os.PathLike | str, data_cfg) -> str | None:
    """Write RUN_DIR/dataset.json at a run's first start (atomically, never rewritten); on a later start, one
    line if the data no longer matches it (a resume would then mix rows of two datasets), else None."""
    rd = RunDir(run_dir)
    now = fingerprint(data_cfg)
    try:
        then = json.loads(rd.dataset.read_text())
    except FileNotFoundError:
        atomic_write_text(rd.dataset, json.dumps(now, indent=1))
        return None
    if then.get("sha256") != now["sha256"]:
        where = now.get("path", "the arithmetic task")
        return (
            f"the dataset ({where}) changed since the run started: sha256 {now['sha256'][:12]}, "
            f"{rd.dataset.name} says {str(then.get('sha256'))[:12]}; rows stored before and after differ"
        )
    return None


def read_record(run_dir: os.PathLike | str) -> dict:
    rd = RunDir(run_dir)
    try:
        return json.loads(rd.dataset.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"run dir {str(rd.root)!r} has no {rd.dataset.name} (a run started before runs recorded their data); "
            "its rows cannot be joined"
        ) from None


def dataset_rows(run_dir: os.PathLike | str, path: os.PathLike | str | None = None) -> pd.DataFrame:
    """The run's dataset rows, one per row index, every field of a row a column (index `row_index`).

    The data must be what the run recorded (its sha256, else ValueError): the recorded file, or `path`, a
    copy of it moved elsewhere. A jsonl line that is no JSON object has no row.
    """
    rec = read_record(run_dir)
    if rec["kind"] == "arithmetic":
        rows = _arithmetic_rows(rec["params"])
        sha = _rows_sha256(rows)
        where = "the arithmetic task"
    else:
        where = str(path or rec["path"])
        try:
            sha, _ = file_sha256(where)
        except FileNotFoundError:
            raise ValueError(f"the run's dataset {where!r} is gone; pass a copy of it as rows=PATH") from None
        rows = file_rows(where, rec["kind"])
    if sha != rec["sha256"]:
        raise ValueError(
            f"{where} is not the data the run read (sha256 {sha[:12]}, {RunDir(run_dir).dataset.name} says "
            f"{rec['sha256'][:12]}); pass the file the run read as rows=PATH"
        )
    return pd.DataFrame.from_records(list(rows.values()), index=pd.Index(list(rows), name="row_index"))


def join_rows(trajectories: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """`trajectories` with each one's dataset row as `row.<field>` columns (NaN where row_index is -1)."""
    out = trajectories.join(rows.add_prefix("row."), on="row_index")
    out.attrs = dict(trajectories.attrs)
    return out
