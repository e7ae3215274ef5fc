"""Resume bookkeeping: rank 0's checkpoint state, the ready queue rebuilt from the store, temporaries cleaned."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

from areal_hpc.config import Config
from areal_hpc.rundir import CHECKPOINT_META, RunDir
from areal_hpc.runtime.rank0.scheduler_core import ReadyGroup
from areal_hpc.store import CorruptShardError, list_shards, read_shard_summary
from areal_hpc.utils import atomic_write_text


def save_scheduler_state(run_dir: Path, version: int, state: dict) -> None:
    """Written after the trainers' checkpoint is in place: its presence marks the checkpoint complete."""
    atomic_write_text(RunDir(run_dir).scheduler_state(version), json.dumps(state, default=_plain))


def _plain(obj):
    """numpy scalars in the metrics rows the state carries, as Python numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} in the scheduler state is not JSON")


class CheckpointError(ValueError):
    """A checkpoint a resume would start from is damaged; the message is one line naming what and how to go on."""


def check_resumable(run_dir: Path, cfg: Config | None = None) -> int:
    """The newest complete checkpoint's version, after reading what a resume needs from it: rank 0's state
    (JSON), the trainers' meta.json, and the headers of their safetensors files; with `cfg`, also the folders
    its settings need (check_adapter_base). Raises CheckpointError before any rank starts, so a damaged
    checkpoint costs one line and touches nothing."""
    from safetensors import safe_open

    run = RunDir(run_dir)
    if cfg is not None:
        check_adapter_base(run, cfg)
    v = run.latest_checkpoint()
    if v is None:
        raise CheckpointError(f"run dir {str(run.root)!r} has no complete checkpoint to resume from")
    ck = run.trainer_checkpoint(v)
    hint = f"move {ck.name}* out of {run.checkpoints} to resume from the one before"
    try:
        load_scheduler_state(run_dir, v)
        if (ck / CHECKPOINT_META).exists():
            json.loads((ck / CHECKPOINT_META).read_text())
        files = sorted(ck.rglob("*.safetensors"))
        if not any(ck.iterdir()):
            raise CheckpointError(f"checkpoint v{v} ({ck}) is empty; {hint}")
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                h.keys()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable part makes the checkpoint unusable
        what = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        raise CheckpointError(f"checkpoint v{v} in {str(run.root)!r} is damaged ({what}); {hint}") from None
    return v


def check_adapter_base(run: RunDir, cfg: Config) -> None:
    """LoRA after a warm start trains its adapter on RUN_DIR/base_model, written once by the first start: a
    resume cannot rebuild it (its warm start is past), so a missing folder is one line."""
    if cfg.trainer.lora_rank and cfg.trainer.warm_start_steps and not run.base_model.is_dir():
        raise CheckpointError(
            f"{run.base_model} is missing: this LoRA run's adapter trains on the warm-started model its first "
            "start wrote there; restore that folder to resume, or start a new run"
        )


def load_scheduler_state(run_dir: Path, version: int) -> dict:
    return json.loads(RunDir(run_dir).scheduler_state(version).read_text())


def quarantine_corrupt_shards(run_dir: Path, consumed: dict) -> list[str]:
    """Move every shard a resume would read from that fails its checks to RUN_DIR/quarantine/; returns one
    line per shard. A shard is read from when some trajectory in it is not consumed, and those are
    verified in full (token data too). Their groups then never reach a batch: new grants replace them,
    so no batch is short. A shard whose trajectories were all consumed is not read again."""
    run = RunDir(run_dir)
    lines = []
    for path in list_shards(run.rollouts):
        try:
            s = read_shard_summary(path)
            if all((path.name, i) in consumed for i in range(s.n_trajectories)):
                continue
            read_shard_summary(path, verify_tokens=True)
        except CorruptShardError as err:
            run.quarantine.mkdir(exist_ok=True)
            os.replace(path, run.quarantine / path.name)
            lines.append(f"{err}; moved to {run.quarantine.name}/, its groups will be generated again")
    return lines


def unconsumed_groups(
    run_dir: Path, consumed: dict, skip_uniform: bool = False
) -> tuple[list[tuple[ReadyGroup, int]], int]:
    """Every group in the store none of whose trajectories the ledger lists, oldest first, each with the
    newest version among its tokens (a resume must not reuse tokens of versions it rolled back).
    `skip_uniform` leaves out groups whose rewards are all equal (the scheduler rejected those).

    Also returns the largest group id seen (-1 if none), so new group ids never repeat old ones.
    A corrupt shard (torn by a crash mid-write cannot happen: writes are atomic, but a damaged
    disk can) is skipped; its groups are simply never trained on.
    """
    groups: list[tuple[ReadyGroup, int]] = []
    max_gid = -1
    for path in list_shards(RunDir(run_dir).rollouts):
        try:
            s = read_shard_summary(path)
        except CorruptShardError:
            continue
        members: dict[int, list[int]] = defaultdict(list)
        for i, gid in enumerate(s.group_id.tolist()):
            members[gid].append(i)
            max_gid = max(max_gid, gid)
        lengths = s.n_tokens
        for gid, idx in members.items():
            if any((path.name, i) in consumed for i in idx):
                continue
            if skip_uniform and len({float(s.reward[i]) for i in idx}) == 1:
                continue
            group = ReadyGroup(
                shard=path.name,
                indices=idx,
                prompt_id=int(s.prompt_id[idx[0]]),
                group_id=int(gid),
                n_tokens=int(sum(int(lengths[i]) for i in idx)),
                version_start=int(min(int(s.version_start[i]) for i in idx)),
            )
            groups.append((group, int(max(int(s.version_end[i]) for i in idx))))
    groups.sort(key=lambda g: (g[0].version_start, g[0].group_id))
    return groups, max_gid


def clean_temporaries(run_dir: Path) -> int:
    """Remove *.tmp files and tmp folders a killed run left behind (never complete data)."""
    found = RunDir(run_dir).temporaries()
    for p in found:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return len(found)
