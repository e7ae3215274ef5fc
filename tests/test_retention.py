"""Checkpoint retention (trainer.keep_checkpoints) and the disk estimate, against a real run's checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load_config
from areal_hpc.disk_estimate import estimate_disk, model_shape
from areal_hpc.launch.local import launch
from areal_hpc.rundir import RunDir
from areal_hpc.rundir.actions import checkpoints_to_prune, prune_checkpoints
from areal_hpc.store import list_shards, read_shard_summary

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
VERSIONS = 5


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """5 versions of the demo, a checkpoint after every one, the newest 2 kept."""
    tmp = tmp_path_factory.mktemp("retention")
    cfg = load_config(
        DEMO,
        [
            f"store.run_dir={tmp / 'run'}",
            f"model.path={tmp / 'model'}",
            "logging.progress=false",
            "logging.trackers=[]",
            "logging.eval_prompts=20",
            "logging.eval_every=0",
            "rollout.batch_prompts=8",
            f"trainer.versions={VERSIONS}",
            "trainer.max_wall_s=0",
            "trainer.checkpoint_every=1",
            "trainer.keep_checkpoints=2",
        ],
    )
    summary = launch(cfg, progress=False)
    assert summary["versions"] == VERSIONS
    return RunDir(tmp / "run"), cfg


def test_a_run_keeps_the_newest_complete_checkpoints(demo_run):
    run, _ = demo_run
    assert run.complete_checkpoints() == [VERSIONS - 1, VERSIONS]
    # nothing else is left behind: no older folder, no state without its folder, no temporary
    names = sorted(p.name for p in run.checkpoints.iterdir())
    assert names == sorted(
        n for v in (VERSIONS - 1, VERSIONS) for n in (run.trainer_checkpoint(v).name, run.scheduler_state(v).name)
    )
    log = run.rank_log(0, "scheduler").read_text()
    assert "deleted checkpoints v0 (trainer.keep_checkpoints=2)" in log  # pruned as the run went, one at a time
    assert f"deleted checkpoints v{VERSIONS - 2} " in log


def test_pruning_never_touches_the_newest_complete_or_a_newer_one():
    # six complete: the newest two stay
    assert checkpoints_to_prune(range(6), range(6), 2) == [0, 1, 2, 3]
    # v4 is being written (folder, no state yet): it does not count, and v3, the newest complete, stays
    assert checkpoints_to_prune({1, 2, 3, 4}, {1, 2, 3}, 1) == [1, 2]
    # v5's state alone is newer than every complete one: kept, whatever it is
    assert checkpoints_to_prune({1, 2, 3}, {1, 2, 3, 5}, 1) == [1, 2]
    # a folder whose state a killed prune already deleted (v1), older than the newest complete: garbage
    assert checkpoints_to_prune({1, 2, 3}, {2, 3}, 2) == [1]
    assert checkpoints_to_prune({1, 2, 3}, {1, 2, 3}, 0) == []  # 0: keep all
    assert checkpoints_to_prune({1, 2, 3}, set(), 1) == []  # nothing complete: nothing is garbage yet
    assert checkpoints_to_prune({7}, {7}, 1) == []


def _fake_checkpoints(run: RunDir, folders, states) -> None:
    for v in folders:
        run.trainer_checkpoint(v).mkdir(parents=True)
        (run.trainer_checkpoint(v) / "model.safetensors").write_bytes(b"w" * 100)
    for v in states:
        run.scheduler_state(v).write_text("{}")


def test_a_kill_mid_prune_leaves_the_newest_complete_checkpoint_to_resume_from(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    _fake_checkpoints(run, folders=[1, 2, 3, 4], states=[1, 2, 3])  # v4: a newer checkpoint half written
    assert run.latest_checkpoint() == 3

    # killed between deleting v1's state and deleting its folder
    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt("killed mid-prune")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(run, 1)
    monkeypatch.undo()
    assert not run.scheduler_state(1).exists() and run.trainer_checkpoint(1).is_dir()  # half deleted ...
    assert run.complete_checkpoints() == [2, 3] and run.latest_checkpoint() == 3  # ... and never taken for whole

    # the next prune (after the next checkpoint) finishes the job; v3 and the half-written v4 survive
    assert prune_checkpoints(run, 1) == [1, 2]
    assert run.latest_checkpoint() == 3 and run.complete_checkpoints() == [3]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == sorted(
        [run.trainer_checkpoint(3).name, run.scheduler_state(3).name, run.trainer_checkpoint(4).name]
    )
    assert (run.trainer_checkpoint(4) / "model.safetensors").exists()

    # a folder torn halfway by rmtree (files gone, folder left) is just as harmless
    _fake_checkpoints(run, folders=[], states=[4])  # v4 completes
    (run.trainer_checkpoint(3) / "model.safetensors").unlink()
    run.scheduler_state(3).unlink()
    assert run.latest_checkpoint() == 4 and prune_checkpoints(run, 1) == [3]


def test_keep_checkpoints_is_checked_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["trainer.keep_checkpoints=-1"])
    assert str(err.value) == "config trainer.keep_checkpoints=-1 is out of range; it must be >= 0"
    assert load_config(DEMO, ["trainer.keep_checkpoints=0"]).trainer.keep_checkpoints == 0


def test_disk_estimate_matches_a_real_checkpoint(demo_run):
    """The estimate's checkpoint is the model's tensors and AdamW's moments; the files add their headers
    and the RNG states (~30 kB against ~6 MB here, 0.1-0.2% for a 4M-parameter model on every engine:
    docs/run-dir.md), so the real folder must be at most 5% larger and never smaller."""
    run, cfg = demo_run
    est = estimate_disk(cfg)  # the demo's model folder has its config.json
    actual = sum(p.stat().st_size for p in run.trainer_checkpoint(VERSIONS).rglob("*") if p.is_file())
    assert 1.0 <= actual / est.checkpoint_bytes < 1.05, (actual, est.checkpoint_bytes)
    assert est.checkpoints_kept == 2 and est.checkpoints_peak == 3 and est.weights_kept == 0
    assert est.upper_bound and "disk: checkpoints 2 x " in est.describe() and "<=" in est.describe()
    # the shards, given the run's real lengths and stored groups in place of the bound: what the files hold
    # beyond the estimate is HDF5's own structure (the superblock, 23 datasets' headers: ~15 kB per file)
    summaries = [read_shard_summary(p) for p in list_shards(run.rollouts)]
    n = sum(s.n_trajectories for s in summaries)
    prompt = sum(int(s.prompt_len.sum()) for s in summaries) / n
    answer = sum(int(s.gen_len.sum()) for s in summaries) / n
    est = estimate_disk(cfg, prompt_tokens=prompt, new_tokens=answer, groups_per_version=n / 8 / VERSIONS)
    files = sum(p.stat().st_size for p in list_shards(run.rollouts))
    assert 0 < files - est.rollouts_total < 24_000 * len(summaries), (files, est.rollouts_total, len(summaries))


def test_disk_estimate_counts_store_compression(demo_run, tmp_path):
    """The demo's own shards written again with each filter: the estimate at store.compression divides the token
    columns by the filter's worst-case ratio, an upper bound for what they take (the demo's ids compress
    better); the rest of each file is HDF5's structure, as uncompressed (above), plus the chunk index."""
    import dataclasses

    import h5py

    from areal_hpc.disk_estimate import COMPRESSION_RATIOS, TOKEN_BYTES, TRAJ_BYTES
    from areal_hpc.store.shard_schema import TOKEN_FIELDS
    from areal_hpc.store.shards import parse_shard_name, read_shard, write_shard

    def token_bytes(paths):  # what the token datasets take on disk, after the filter
        out = 0
        for p in paths:
            with h5py.File(p, "r") as f:
                out += sum(f[k].id.get_storage_size() for k in TOKEN_FIELDS)
        return out

    run, cfg = demo_run
    shards = list_shards(run.rollouts)
    summaries = [read_shard_summary(p) for p in shards]
    n = sum(s.n_trajectories for s in summaries)
    tokens = sum(int(s.prompt_len.sum() + s.gen_len.sum()) for s in summaries)
    assert token_bytes(shards) == tokens * TOKEN_BYTES
    lengths = dict(prompt_tokens=0, new_tokens=tokens / n, groups_per_version=n / 8 / VERSIONS)
    unpacked = estimate_disk(cfg, **lengths)
    for name in ("lzf", "gzip"):
        for p in shards:
            write_shard(tmp_path / name, read_shard(p), *parse_shard_name(p.name), compression=name)
        packed = list_shards(tmp_path / name)
        stored, files = token_bytes(packed), sum(p.stat().st_size for p in packed)
        cfg_packed = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, compression=name))
        est = estimate_disk(cfg_packed, **lengths)
        ratio = COMPRESSION_RATIOS[name]
        print(f"\n[disk] {name}: demo token columns {tokens * TOKEN_BYTES / stored:.2f}x smaller (estimate {ratio}x)")
        assert est.rollouts_total == pytest.approx(n * TRAJ_BYTES + tokens * TOKEN_BYTES / ratio, abs=VERSIONS)
        assert stored < est.rollouts_total - n * TRAJ_BYTES < unpacked.rollouts_total / 2
        assert 0 < files - est.rollouts_total < 30_000 * len(shards) and f"{VERSIONS}, {name})" in est.describe()


def test_qwen2p5_1p5b_shape_and_the_recipe_estimate():
    qwen = {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    shape = model_shape(qwen)
    assert shape.params == 1_543_714_304 and shape.tied == 151936 * 1536  # Qwen2.5-1.5B: 1.54B
    cfg = load_config(ROOT / "jobs" / "math_1p5b_gpu.yaml", ["model.path=/absent", "data.path=/absent.jsonl"])
    est = estimate_disk(cfg, shape)
    # DeepSpeed ZeRO-2 with bf16: module bf16 (2) + fp32 master copy (4) + Adam moments (8) bytes per parameter
    assert est.checkpoint_bytes == 14 * shape.params
    # 512 groups x 16 answers x (1024 + 16384) tokens x 13 bytes + 128 bytes per answer (88 of its own, 40 for its
    # episode's row in the shard's episode table)
    assert est.rollout_bytes_per_version == 512 * 16 * ((1024 + 16384) * 13 + 128)
    # the LoRA recipe: rank 32 x 28 layers x (q 1536+1536, k and v 1536+256, o 1536+1536, gate and up 1536+8960,
    # down 8960+1536); its checkpoint is the adapter's bf16 module, fp32 copy, moments and adapter.safetensors
    lora = load_config(ROOT / "jobs" / "math_1p5b_gpu_lora.yaml", ["model.path=/absent", "data.path=/absent.jsonl"])
    n = 32 * 28 * 41216
    assert shape.adapter(32) == n == 36_929_536
    assert estimate_disk(lora, shape).checkpoint_bytes == 18 * n
    with pytest.raises(ValueError, match="config.json"):
        estimate_disk(cfg)  # no model folder here, and no count given
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_shape({k: v for k, v in qwen.items() if k != "num_hidden_layers"})
