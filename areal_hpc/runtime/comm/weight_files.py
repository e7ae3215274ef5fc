"""The disk route of weight sync: each published version a safetensors folder in the run dir, the oldest pruned."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from areal_hpc.rundir import RunDir
from areal_hpc.utils import atomic_publish_dir, new_tmp_dir_beside


def save_weights(run_dir: Path, state_dict: dict[str, torch.Tensor], version: int) -> int:
    """RUN_DIR/weights/v{N}/model.safetensors, published by an atomic directory rename."""
    rd = RunDir(run_dir)
    final = rd.weights_version(version)
    if final.exists():  # a resumed run republishing the checkpoint's version
        shutil.rmtree(final)
    tmp = new_tmp_dir_beside(final)
    # clones: safetensors refuses tensors that share storage (ZeRO-1/2's views into one flat buffer)
    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    save_file(sd, str(tmp / rd.weights_file(version).name))
    atomic_publish_dir(tmp, final)
    return sum(t.numel() * t.element_size() for t in sd.values())


def prune_weights(run_dir: Path, keep: int) -> None:
    """All but the newest `keep` published versions removed."""
    for old in RunDir(run_dir).published_weights()[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
