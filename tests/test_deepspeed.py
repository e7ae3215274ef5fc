"""DeepSpeed ZeRO 1/2/3 trainers over 2 processes (CPU accelerator, gloo) against the torch engine."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_hpc.launch.environment import rank_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def batch(ppo_batch):
    return ppo_batch


# each stage also takes one loss aggregation and objective: ZeRO-1 holds a KL reference (saved in its
# checkpoint, so the resume below covers it); ZeRO-2 and ZeRO-3 train a LoRA adapter (ZeRO-2's KL reference is
# the base with the adapter off), ZeRO-3 takes GSPO's sequence ratio on its checkpointed head path
OBJECTIVES = {
    1: ("token_mean", {"kl_coef": 0.1}, None),
    2: ("seq_mean_token_mean", {"kl_coef": 0.1}, [4, 8.0]),
    3: ("seq_mean_token_sum_norm", {"importance": "sequence", "eps_clip": 0.05, "entropy_coef": 0.01}, [2, 4.0]),
}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_update_matches_torch_engine_and_checkpoint_resumes(stage, tiny_model_dir, batch, tmp_path):
    from areal_hpc.algo.mismatch import row_columns
    from areal_hpc.algo.ppo import Objective
    from areal_hpc.engines.lora import LoraSpec
    from areal_hpc.engines.torch_train import TorchTrainEngine

    agg, objective, lora = OBJECTIVES[stage]

    trajs, adv = batch
    with open(tmp_path / "batch.pkl", "wb") as f:
        pickle.dump((trajs, adv), f)
    cmd = [
        "mpirun",
        "-n",
        "2",
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        str(ROOT / "tests" / "mpi" / "deepspeed_update.py"),
        str(tiny_model_dir),
        str(tmp_path),
        str(stage),
        agg,
        json.dumps(objective),
        json.dumps(lora),
    ]
    r = subprocess.run(
        cmd, env={**rank_env(local_mpirun=True), "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = torch.load(tmp_path / "ds.pt", weights_only=False)

    ref = TorchTrainEngine(
        str(tiny_model_dir),
        lr=0.1,
        optimizer="sgd",
        weight_decay=0.0,
        grad_clip=0.0,
        n_minibatches=2,
        seed=0,
        loss_agg=agg,
        loss_norm_tokens=6,
        objective=Objective(**objective),
        lora=LoraSpec(*lora) if lora else None,
        share_prefixes=False,  # the trainers lay each group's prompt down once: the same update
    )
    start = {k: v.clone() for k, v in ref.weights().items()}
    ref_stats = ref.ppo_update(trajs, adv)  # one trainer, the whole batch, the same minibatch split
    for k, v in ref.weights().items():
        torch.testing.assert_close(got["sgd_step"][k], v, rtol=1e-4, atol=1e-5, msg=f"ZeRO-{stage} {k}")
    assert any(not torch.equal(start[k], v) for k, v in ref.weights().items())
    # each group's prompt was computed once on the trainers (and every token by the single unshared one)
    computed, unshared = (sum(x[k] for x in got["stats"]) for k in ("train_tokens_computed", "train_tokens_unshared"))
    assert computed < unshared and ref_stats["train_tokens_computed"] == ref_stats["train_tokens_unshared"]
    # the two trainers' mismatch sums merge into the single trainer's figures (ZeRO-3: empty micro-batches add none)
    gaps, ref_gaps = row_columns(got["stats"]), row_columns([ref_stats])
    assert gaps.keys() == ref_gaps.keys() and gaps["offpolicy_tokens"] == sum(int(t.loss_mask.sum()) for t in trajs)
    for k, v in ref_gaps.items():
        assert gaps[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    # checkpoint, restore into a fresh engine, continue: the same next step as never stopping
    assert got["version"] == 2
    for k, v in got["continued"].items():
        torch.testing.assert_close(got["restored"][k], v, rtol=1e-5, atol=1e-6, msg=f"ZeRO-{stage} resume {k}")
    # the Hugging Face export holds the trained weights (gathered under ZeRO-3; with LoRA merged into the base)
    from areal_hpc.model import load_causal_lm

    exported = load_causal_lm(tmp_path / "export").state_dict()
    for k, v in got["merged"].items():
        torch.testing.assert_close(exported[k], v, rtol=0, atol=0, msg=f"ZeRO-{stage} export {k}")
    for k, v in ref.full_weights().items():
        torch.testing.assert_close(got["merged"][k], v, rtol=1e-4, atol=1e-5, msg=f"ZeRO-{stage} merged {k}")
    if lora:  # the adapter alone was trained and checkpointed: the frozen base stays out of the shards
        assert set(got["sgd_step"]) == {k for k in got["sgd_step"] if ".lora_" in k}
        ckpt_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
        base_bytes = sum(v.numel() * 4 for v in exported.values())
        assert ckpt_bytes < 0.5 * base_bytes, (ckpt_bytes, base_bytes)
