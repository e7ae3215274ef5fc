"""A run's stored episodes to read: tokens, masks, logprobs and versions with their decoded text, from RUN_DIR alone."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from areal_hpc.rundir import RunDir, RunDirError
from areal_hpc.store.columns import EPISODE_COUNTS, TrajectoryColumns
from areal_hpc.store.loader import load_trajectories
from areal_hpc.store.shards import read_columns
from areal_hpc.types import EpisodeCounts

# counts of the episode table that say something went wrong in the episode (agent failures are not among them:
# a failed agent's episode ran again, and only metrics.csv and summary.json count it)
FAILURE_COUNTS = ("tool_errors", "reward_errors", "reward_timeouts")
_KEY = ["group_id", "sample_idx"]


@dataclass(frozen=True, eq=False)  # identity: its numpy arrays have no single truth value
class TextSegment:
    """A run of a transcript's tokens that are all trained (sampled by the model, loss mask 1) or all untrained
    (the prompt, tool results, feedback: what the workflow or the agent's chat template added)."""

    text: str  # decoded, special tokens kept (role markers and EOS are part of what the model saw)
    trained: bool
    prompt: bool  # the transcript's first prompt_len tokens (a segment of its own, untrained)
    start: int  # its first token's position in the transcript
    ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32 behaviour logprobs: 0 where untrained
    versions: np.ndarray  # int32 weight version that sampled each token: -1 where untrained


@dataclass(frozen=True, eq=False)
class Transcript:
    """One stored trajectory of an episode, as its shard holds it, cut into segments."""

    shard: str  # file name in RUN_DIR/rollouts
    index: int  # position in the shard (the ledger's entry)
    input_ids: np.ndarray
    loss_mask: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    prompt_len: int
    reward: float
    finish_reason: str  # stop | length | abort
    version_start: int  # oldest sampled token's version (-1: none sampled)
    version_end: int
    consumed_version: int  # the version that trained on it, -1 if none
    staleness: int | None  # consumed_version - version_start, None if not consumed
    segments: list[TextSegment]


@dataclass(frozen=True, eq=False)
class EpisodeView:
    """An episode (group_id, sample_idx) with every transcript it left (several when it branched), its counts
    from the shard's episode table and its dataset row."""

    group_id: int
    sample_idx: int
    prompt_id: int
    row_index: int  # -1 where unknown (shards of schema < 3)
    reward: float
    counts: EpisodeCounts  # turns, tool_calls, tool_errors, tool_s, reward_timeouts, reward_errors
    transcripts: list[Transcript]
    row: dict = field(default_factory=dict)  # the dataset row's fields (empty with rows=False)

    @property
    def finish_reason(self) -> str:
        """The last transcript's: how the episode's final answer ended."""
        return self.transcripts[-1].finish_reason

    @property
    def branches(self) -> int:
        """Transcripts beyond the first (a branch that sampled nothing left none, so this is at most the count
        in metrics.csv's `branches`)."""
        return len(self.transcripts) - 1

    @property
    def failures(self) -> int:
        return sum(getattr(self.counts, k) for k in FAILURE_COUNTS)

    @property
    def version_start(self) -> int:
        vs = [t.version_start for t in self.transcripts if t.version_start >= 0]
        return min(vs, default=-1)

    @property
    def version_end(self) -> int:
        return max((t.version_end for t in self.transcripts), default=-1)

    @property
    def consumed_version(self) -> int:
        return max(t.consumed_version for t in self.transcripts)

    @property
    def staleness(self) -> int | None:
        """Versions between the oldest sampled token and the version that trained on the episode."""
        cv = self.consumed_version
        return cv - self.version_start if cv >= 0 and self.version_start >= 0 else None


def load_episodes(
    run_dir: os.PathLike | str,
    *,
    lowest: bool = False,
    failed: bool = False,
    prompt_id: int | None = None,
    versions: tuple[int | None, int | None] | None = None,
    limit: int | None = None,
    rows: bool | os.PathLike | str = True,
    tokenizer=None,
) -> list[EpisodeView]:
    """The stored episodes of RUN_DIR, in store order (shards by generator and sequence), or lowest reward first.

    failed: only episodes whose counts show a tool error, a reward error or a reward time-out. prompt_id: only
    that prompt's. versions=(a, b): only episodes sampled in part by weights a..b (version_start <= b and
    version_end >= a; None leaves an end open). limit: the first `limit` after filtering and ordering; only
    their shards' tokens are read. rows: as load_trajectories' (True: the data RUN_DIR/dataset.json records,
    a path: a copy of it, False: none). tokenizer: decodes the segments; None loads the run's model folder's
    (model.path in its config.yaml, else the folder its model.json recorded), a path loads that folder's.
    RunDirError for a folder that holds no run; an empty list for a run with no shards yet.
    """
    run = RunDir(run_dir)
    if not run.config.is_file() and not run.rollouts.is_dir():
        raise RunDirError(f"{str(run.root)!r} is not a run directory (it has no {run.config.name})")
    df = load_trajectories(run.root, verify_tokens=False)  # summaries only: tokens are read for the picked
    if not len(df):
        return []
    picked = _pick(df, lowest, failed, prompt_id, versions, limit)
    trajectories = df.merge(picked[_KEY], on=_KEY)  # the picked episodes' trajectories, in store order
    if rows is not False and len(trajectories):
        from areal_hpc.data.record import dataset_rows, join_rows

        trajectories = join_rows(trajectories, dataset_rows(run.root, None if rows is True else rows))
    by_episode = dict(iter(trajectories.groupby(_KEY, sort=False)))
    decode = _decoder(run, tokenizer) if len(picked) else None
    columns: dict[str, TrajectoryColumns] = {}
    out = []
    for key in zip(picked["group_id"].tolist(), picked["sample_idx"].tolist()):
        own = by_episode[key]
        transcripts = []
        for t in own.to_dict("records"):
            if t["shard"] not in columns:  # every token checked against its shard's checksum
                columns[t["shard"]] = read_columns(run.rollouts / t["shard"])
            transcripts.append(_transcript(t, columns[t["shard"]], decode))
        first = own.iloc[0]
        known = int(first["row_index"]) >= 0
        out.append(
            EpisodeView(
                group_id=key[0],
                sample_idx=key[1],
                prompt_id=int(first["prompt_id"]),
                row_index=int(first["row_index"]),
                reward=float(first["reward"]),
                counts=EpisodeCounts(*key, **{k: own[k].sum().item() for k in EPISODE_COUNTS}),
                transcripts=transcripts,
                row={c.removeprefix("row."): _plain(first[c]) for c in own.columns if c.startswith("row.") and known},
            )
        )
    return out


def _pick(df: pd.DataFrame, lowest, failed, prompt_id, versions, limit) -> pd.DataFrame:
    """One row per episode that passes the filters (group_id, sample_idx, reward), ordered and cut to limit."""
    # the episode counts sit on each episode's first trajectory (0 on the others), so sums are the episode's;
    # -1 (no sampled token) is left out of the version range
    df = df.assign(vs=df["version_start"].where(df["version_start"] >= 0), ve=df["version_end"])
    agg = {"prompt_id": "first", "reward": "first", "vs": "min", "ve": "max"} | {k: "sum" for k in FAILURE_COUNTS}
    ep = df.groupby(_KEY, sort=False).agg(agg).reset_index()
    keep = np.ones(len(ep), dtype=bool)
    if failed:
        keep &= (ep[list(FAILURE_COUNTS)] > 0).any(axis=1).to_numpy()
    if prompt_id is not None:
        keep &= (ep["prompt_id"] == prompt_id).to_numpy()
    if versions is not None:
        lo, hi = versions
        if lo is not None:
            keep &= (ep["ve"] >= lo).to_numpy()
        if hi is not None:
            keep &= (ep["vs"] <= hi).to_numpy()
    ep = ep[keep]
    if lowest:
        ep = ep.sort_values("reward", kind="stable")  # ties stay in store order
    return ep if limit is None else ep.head(limit)


def _transcript(t: dict, cols: TrajectoryColumns, decode) -> Transcript:
    """Trajectory t (a row of load_trajectories' frame) with its tokens from its shard's columns."""
    i = int(t["index"])
    ids, mask, logprobs, versions = (cols.token(k, i) for k in ("input_ids", "loss_mask", "behav_logprobs", "versions"))
    cv = int(t["consumed_version"])
    return Transcript(
        shard=t["shard"],
        index=i,
        input_ids=ids,
        loss_mask=mask,
        behav_logprobs=logprobs,
        versions=versions,
        prompt_len=int(t["prompt_len"]),
        reward=float(t["reward"]),
        finish_reason=str(t["finish_reason"]),
        version_start=int(t["version_start"]),
        version_end=int(t["version_end"]),
        consumed_version=cv,
        staleness=None if cv < 0 else cv - int(t["version_start"]),
        segments=segments(ids, mask, logprobs, versions, int(t["prompt_len"]), decode),
    )


def segments(ids, loss_mask, logprobs, versions, prompt_len: int, decode) -> list[TextSegment]:
    """A transcript cut where the loss mask changes and after the prompt; `decode(ids) -> str` gives each text."""
    n = len(ids)
    cuts = np.flatnonzero(np.diff(np.asarray(loss_mask, dtype=np.int8))) + 1
    bounds = np.unique(np.r_[0, cuts[(cuts > 0) & (cuts < n)], [prompt_len] if 0 < prompt_len < n else [], n])
    out = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        piece = ids[a:b]
        text = decode(piece.tolist())
        out.append(TextSegment(text, bool(loss_mask[a]), a < prompt_len, a, piece, logprobs[a:b], versions[a:b]))
    return out


def _decoder(run: RunDir, tokenizer):
    """ids -> text with special tokens kept, from a tokenizer, a model folder, or the run's own model folder."""
    from areal_hpc.model import load_tokenizer, no_hf_progress_bars

    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        folder = Path(tokenizer) if tokenizer is not None else run_model_folder(run)
        with no_hf_progress_bars():
            tokenizer = load_tokenizer(folder)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def run_model_folder(run_dir: os.PathLike | str) -> Path:
    """The run's model folder, for its tokenizer: model.path in its config.yaml, else the folder its model.json
    recorded at the first start; RunDirError in one line if neither is there."""
    from areal_hpc.config import ConfigError, load_config
    from areal_hpc.model.record import read_model_record

    run = RunDir(run_dir)
    tried = []
    try:
        tried.append(Path(load_config(run.config).model.path))
    except (ConfigError, OSError):
        pass
    if (record := read_model_record(run.root)) is not None:
        tried.append(Path(record["path"]))
    for folder in tried:
        if folder.is_dir():
            return folder
    where = " or ".join(repr(str(p)) for p in tried) or f"none named in its {run.config.name}"
    raise RunDirError(f"run {str(run.root)!r}: its model folder ({where}) is gone; pass the tokenizer's folder")


def _plain(value):
    """A row field as Python reads it: numpy scalars as numbers, NaN (no row) as None."""
    if isinstance(value, float) and np.isnan(value):
        return None
    return value.item() if isinstance(value, np.generic) else value
