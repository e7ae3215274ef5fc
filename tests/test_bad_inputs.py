"""Bad-input sweep: every config key with a wrong type or an out-of-range value, bad dataset rows, broken
model folders, damaged checkpoints and unknown sweep keys. Each gives one clear line and a non-zero exit
through the CLI, writes nothing outside the run directory and changes nothing inside an existing one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from areal_hpc.config import Config, ConfigError, load_config
from areal_hpc.config.checks import _CHOICES, _LOWER
from areal_hpc.data import load_math_dataset
from areal_hpc.model import ModelFolderError, check_model_folder
from areal_hpc.runtime.rank0.resume import CheckpointError, check_resumable

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
CLI = [sys.executable, "-m", "areal_hpc.cli"]


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, types.UnionType):  # an optional key (`bool | None`): a wrong value is of the other type
            (t,) = [a for a in typing.get_args(t) if a is not type(None)]
        if dataclasses.is_dataclass(t):
            yield from _leaves(t, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", typing.get_origin(t) or t


# a value of the wrong type for each kind of key
_WRONG = {
    int: "abc",
    float: "abc",
    bool: "maybe",
    str: "[1, 2]",
    list: "abc",
    dict: "abc",
    tuple: "abc",
    typing.Any: "{a: 1}",
}
WRONG_TYPE = [(k, _WRONG[t]) for k, t in _leaves(Config)]
OUT_OF_RANGE = [(k, low - 1 if inclusive else low) for k, (low, inclusive) in _LOWER.items()]
OUT_OF_RANGE += [(k, "bogus") for k in _CHOICES]
OUT_OF_RANGE += [(k, "nan") for k, _ in list(_LOWER.items())[:3]] + [("rollout.top_p", 1.5), ("trainer.betas", "[0.9]")]


@pytest.mark.parametrize(("key", "value"), WRONG_TYPE + OUT_OF_RANGE, ids=lambda x: str(x))
def test_every_bad_config_value_is_one_line_naming_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [f"{key}={value}", "model.path=/nonexistent"])
    msg = str(err.value)
    assert "\n" not in msg and key.split(".")[-1] in msg, msg


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["ppo.eps_clip_high=0.1"], "eps_clip_high"),  # below eps_clip (0.2)
        (["ppo.dual_clip=0.5"], "dual_clip"),
        (["ppo.kl_coef=0.1", "trainer.engine=deepspeed", "trainer.zero_stage=3"], "kl_coef"),
        (["reward.overlong_buffer=8", "rollout.max_new_tokens=8"], "overlong_buffer"),
        (["trainer.warmup_versions=50", "trainer.versions=50"], "warmup_versions"),
        (["ppo.objective=cispo", "ppo.importance=sequence"], "importance=token"),
        (["ppo.objective=cispo", "ppo.dual_clip=3"], "dual_clip"),
        (["ppo.seq_reject_low=1.2"], "seq_reject_low"),  # the band must hold 1, an on-policy sequence
        (["ppo.seq_reject_high=0.8"], "seq_reject_high"),
        (["ppo.seq_reject_high=2", "ppo.decoupled=false"], "decoupled=true"),  # no proximal policy to compare
        (["rollout.weight_bits=1"], "weight_bits"),
        (["rollout.weight_bits=4", "rollout.engine=vllm"], "rollout.engine=torch"),
    ],
)
def test_objective_combinations_that_cannot_work_are_one_line(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [*overrides, "model.path=/nonexistent"])
    assert "\n" not in str(err.value) and named in str(err.value), err.value


def test_cispo_may_bound_the_upper_side_alone():
    cfg = load_config(DEMO, ["ppo.objective=cispo", "ppo.eps_clip=1", "ppo.eps_clip_high=0.28", "model.path=/x"])
    assert (cfg.ppo.eps_clip, cfg.ppo.eps_clip_high) == (1, 0.28)  # MiniMax-M1's: no lower bound on the weight


def test_gspo_with_the_token_mean_is_warned_once_in_one_line_naming_the_per_sequence_mean(caplog):
    from areal_hpc.config import objective as objective_checks

    objective_checks._warned.clear()
    with caplog.at_level(logging.WARNING, logger="areal_hpc"):
        for agg in ("token_mean", "token_mean", "seq_mean_token_mean"):  # warned once per process, and only then
            load_config(DEMO, ["ppo.importance=sequence", f"ppo.loss_agg={agg}", "model.path=/nonexistent"])
        load_config(DEMO, ["model.path=/nonexistent"])  # token-level ratios: nothing to say
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "importance=sequence" in said[0] and "loss_agg=seq_mean_token_mean" in said[0]


def test_distilling_while_dropping_uniform_groups_is_warned_in_one_line(caplog):
    from areal_hpc.config import objective as objective_checks

    objective_checks._warned.clear()
    with caplog.at_level(logging.WARNING, logger="areal_hpc"):
        load_config(DEMO, ["distill.teacher=/t", "model.path=/nonexistent"])  # the demo drops uniform groups
        load_config(DEMO, ["distill.teacher=/t", "ppo.drop_uniform_groups=false", "model.path=/nonexistent"])
        load_config(DEMO, ["model.path=/nonexistent"])  # no teacher: a uniform group teaches nothing
        with pytest.raises(ConfigError, match="drop_uniform_groups=false"):  # refused, so not warned as well
            load_config(DEMO, ["distill.teacher=/u", "distill.task_reward=false", "model.path=/nonexistent"])
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "distill.teacher" in said[0] and "ppo.drop_uniform_groups=false" in said[0]


def test_one_answer_per_prompt_with_a_task_reward_that_cannot_train_is_warned_in_one_line(caplog):
    from areal_hpc.config import objective as objective_checks

    objective_checks._warned.clear()
    one = ["rollout.n_samples=1", "model.path=/nonexistent", "ppo.drop_uniform_groups=false"]
    with caplog.at_level(logging.WARNING, logger="areal_hpc"):
        load_config(DEMO, one)  # RL: a one-answer group's advantage is 0
        load_config(DEMO, [*one, "distill.teacher=/t"])  # distilling with the task reward: the same line, once
        load_config(DEMO, [*one, "distill.teacher=/t", "distill.task_reward=false"])  # the teacher alone trains
        load_config(DEMO, [*one, "ppo.adv_scope=batch"])  # the batch's mean is the baseline
        load_config(DEMO, [*one, "ppo.adv_norm=none"])  # the reward itself is the advantage
        load_config(DEMO, ["rollout.n_samples=2", "model.path=/nonexistent"])
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "rollout.n_samples=1" in said[0] and "distill.task_reward=false" in said[0]


def test_lora_settings_that_cannot_work_are_one_line_before_any_rank_starts(tiny_model_dir, tmp_path):
    # rank and alpha are in the sweeps above; layers that the model lacks need the model folder
    base = [f"model.path={tiny_model_dir}", "model.build_tiny=false", f"store.run_dir={tmp_path / 'r'}"]
    line = _refused(["run", str(DEMO), *base, "trainer.lora_rank=4", "trainer.lora_targets=[q_proj,qkv]"], tmp_path)
    assert "lora_targets" in line and "qkv" in line and "down_proj" in line, line  # names what the model has
    assert not (tmp_path / "r" / "ledger").exists()
    # LoRA with a KL under ZeRO-3 is allowed: the reference is the base with the adapter off, no copy
    load_config(DEMO, ["trainer.lora_rank=4", "ppo.kl_coef=0.1", "trainer.engine=deepspeed", "trainer.zero_stage=3"])


def test_the_sweep_covers_every_key():
    assert len(WRONG_TYPE) == len(list(_leaves(Config))) > 90
    print(f"\n[bad inputs] config: {len(WRONG_TYPE)} wrong-type and {len(OUT_OF_RANGE)} out-of-range cases")


def _tree(root: Path, but: str = "r") -> dict[str, str]:
    """Every file under `root` with its hash, except those in the run directory `but` a command may create."""
    files = (p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] != but)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _refused(args, cwd: Path) -> str:
    """Run the CLI in `cwd`; it must fail with exactly one line on stderr. Returns the line."""
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith(("Warning", "  warn"))]
    assert r.returncode != 0 and len(lines) == 1, r.stdout + r.stderr
    return lines[0]


def _rows(tmp_path: Path, name: str, lines: list[bytes]) -> Path:
    p = tmp_path / name
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


def test_bad_dataset_rows_are_skipped_and_counted_and_a_file_with_none_left_is_refused(tmp_path):
    good = [json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}).encode() for i in range(5)]
    bad = [
        b"{not json",  # malformed
        b'{"question": "caf\xe9 \xff?", "answer": "1"}',  # not UTF-8
        json.dumps({"question": "x" * 2_000_000, "answer": "1"}).encode(),  # huge
        json.dumps({"question": "no answer"}).encode(),  # missing field
        json.dumps({"answer": "3"}).encode(),
        json.dumps(["a", "list"]).encode(),
    ]
    path = _rows(tmp_path, "mixed.jsonl", good + bad)
    with pytest.warns(UserWarning, match=r"skipped 6 malformed rows"):
        ds = load_math_dataset(path, "jsonl", "question", "answer", "{question}", 1, 0)
    assert len(ds.train) + len(ds.heldout) == len(good)
    empty = _rows(tmp_path, "none.jsonl", bad)
    before = _tree(tmp_path)
    args = ["model.path=/x", "data.kind=jsonl", f"data.path={empty}", f"store.run_dir={tmp_path / 'r'}"]
    line = _refused(["train-sync", str(DEMO), *args], tmp_path)
    assert "none.jsonl" in line and _tree(tmp_path) == before, line


def test_model_folders_without_weights_or_tokenizer_are_refused(tiny_model_dir, tmp_path):
    cases = {"weights": ("*.safetensors", "no weights"), "tokenizer": ("tokenizer*", "no tokenizer")}
    for name, (pattern, needle) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        for f in tiny_model_dir.iterdir():
            if not f.match(pattern):
                (folder / f.name).write_bytes(f.read_bytes())
        with pytest.raises(ModelFolderError, match=needle):
            check_model_folder(folder)
        before = _tree(tmp_path)
        line = _refused(["run", str(DEMO), f"model.path={folder}", f"store.run_dir={tmp_path / 'r'}"], tmp_path)
        assert needle in line and _tree(tmp_path) == before, line


def _fake_run(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A run directory with one checkpoint (v2) in the torch engine's format."""
    run = tmp_path / "run"
    cfg_text = (ROOT / "jobs" / "demo.yaml").read_text()
    (run / "checkpoints" / "v00000002").mkdir(parents=True)
    (run / "config.yaml").write_text(cfg_text)
    ck = run / "checkpoints" / "v00000002"
    (ck / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
    (ck / "meta.json").write_text(json.dumps({"version": 2}))
    (run / "checkpoints" / "v00000002.scheduler.json").write_text(json.dumps({"version": 2}))
    return run


def test_damaged_or_partial_checkpoints_are_refused_before_any_rank_starts(tiny_model_dir, tmp_path):
    run = _fake_run(tmp_path, tiny_model_dir)
    assert check_resumable(run) == 2
    ck = run / "checkpoints" / "v00000002"
    damaged = {
        "truncated weights": lambda: (ck / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{"),
        "bad rank-0 state": lambda: (run / "checkpoints" / "v00000002.scheduler.json").write_text("{half"),
    }
    for name, damage in damaged.items():
        run = _fake_run(tmp_path / name.replace(" ", "_"), tiny_model_dir)
        ck = run / "checkpoints" / "v00000002"
        damage()
        with pytest.raises(CheckpointError, match="damaged"):
            check_resumable(run)
        before = _tree(run)
        line = _refused(["run", "--resume", str(run), f"model.path={tiny_model_dir}"], tmp_path)
        assert "checkpoint v2" in line and _tree(run) == before, line
    # partial: the trainers' folder without rank 0's state is not a complete checkpoint
    run = _fake_run(tmp_path / "partial", tiny_model_dir)
    (run / "checkpoints" / "v00000002.scheduler.json").unlink()
    before = _tree(run)
    line = _refused(["run", "--resume", str(run), f"model.path={tiny_model_dir}"], tmp_path)
    assert "no complete checkpoint" in line and _tree(run) == before, line


def test_a_lora_resume_after_a_warm_start_needs_its_base_model_folder(tiny_model_dir, tmp_path):
    run = _fake_run(tmp_path, tiny_model_dir)
    lora = load_config(run / "config.yaml", ["trainer.lora_rank=8", "trainer.warm_start_steps=50"])
    assert check_resumable(run, load_config(run / "config.yaml", ["trainer.warm_start_steps=50"])) == 2
    with pytest.raises(CheckpointError) as err:
        check_resumable(run, lora)
    line = str(err.value)
    assert "\n" not in line and str(run / "base_model") in line and "restore that folder" in line
    (run / "base_model").mkdir()
    assert check_resumable(run, lora) == 2


def test_a_sweep_grid_with_an_unknown_key_is_refused_before_anything_is_written(tmp_path):
    line = _refused(
        ["sweep", str(DEMO), "--grid", "rollout.etaa=0,1", "--sweep-dir", str(tmp_path / "sw"), "model.path=/x"],
        tmp_path,
    )
    assert "etaa" in line and not (tmp_path / "sw").exists(), line
