"""Config loading/validation, dataset loaders, model folders and the CLI's one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from areal_hpc.config import ConfigError, load_config, to_yaml
from areal_hpc.data import arithmetic_dataset, load_math_dataset
from areal_hpc.model import ModelFolderError, check_model_folder

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo_sync.yaml"


def test_demo_config_loads_with_overrides():
    cfg = load_config(DEMO, ["rollout.eta=2", "trainer.lr=3e-4", "run_name=x"])
    assert cfg.rollout.eta == 2 and cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.store.run_dir == os.path.abspath("runs/x")  # interpolation resolved, made absolute where typed
    assert cfg.model.path == os.path.abspath("runs/models/tiny-arith-llama") and cfg.data.path == ""
    assert "eta: 2" in to_yaml(cfg)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("rollout.eta=abc", "rollout.eta"),
        ("rollout.eta=-1", "rollout.eta=-1 is out of range"),
        ("ppo.prox=exact", "choose one of recompute, loglinear"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("model.arch=gpt2", "model.arch"),
        ("nope.key=1", "nope"),
        ("rollout.eta", "must look like key=value"),
        ("model.num_heads=3", "divisible"),
        ("data.kind=jsonl", "data.path"),
        ("rollout.top_p=0.9", "rollout.top_p=0.9 is not supported"),  # both engines: logprobs of the full softmax
        ("rollout.weight_update=pause", "choose one of keep_kv, recompute, drain"),
        ("workflow.max_failure_share=0", "workflow.max_failure_share=0.0 must be in (0, 1]"),
        ("workflow.max_failure_share=1.5", "workflow.max_failure_share=1.5 must be in (0, 1]"),
        ("workflow.failure_window=0", "workflow.failure_window=0 is out of range; it must be >= 1"),
    ],
)
def test_bad_values_give_one_clear_line(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [override])
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


def test_the_old_interrupt_key_maps_to_a_weight_update_mode_with_one_line(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  path: m\nrollout:\n  interrupt: false\n")  # a config from before weight_update
    cfg = load_config(old)
    assert (cfg.rollout.weight_update, cfg.rollout.interrupt) == ("drain", None)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["areal-hpc: config rollout.interrupt=false is deprecated; it means rollout.weight_update=drain"]
    assert load_config(DEMO, ["rollout.interrupt=true"]).rollout.weight_update == "recompute"
    written = to_yaml(cfg)  # a run directory's config.yaml holds the mode, not the old key
    assert "weight_update: drain" in written and "interrupt" not in written
    with pytest.raises(ConfigError, match="contradicts rollout.weight_update=keep_kv") as e:
        load_config(old, ["rollout.weight_update=keep_kv"])
    assert "\n" not in str(e.value)
    assert load_config(None, ["model.path=m"]).rollout.weight_update == "keep_kv"  # the default


def test_the_reward_sandbox_keys_reach_tool_calls_as_the_workflow_keys_with_one_line(capsys):
    tool = ROOT / "jobs" / "demo_tool.yaml"
    cfg = load_config(tool, ["model.path=m", "reward.sandbox=auto", "reward.code_memory_mb=2048"])
    assert (cfg.workflow.tool_sandbox, cfg.workflow.tool_memory_mb, cfg.reward.sandbox) == ("auto", 2048, "auto")
    assert capsys.readouterr().err.strip().splitlines() == [
        "areal-hpc: config reward.sandbox=auto for tool calls is deprecated; it means workflow.tool_sandbox=auto",
        "areal-hpc: config reward.code_memory_mb=2048 for tool calls is deprecated; it means "
        "workflow.tool_memory_mb=2048",
    ]
    both = load_config(tool, ["model.path=m", "reward.sandbox=auto", "workflow.tool_sandbox=none"])
    assert both.workflow.tool_sandbox == "none" and not capsys.readouterr().err  # the new key wins, silently
    assert load_config(DEMO, ["model.path=m", "reward.sandbox=auto"]).workflow.tool_sandbox == "bwrap"  # no tools
    with pytest.raises(ConfigError, match="workflow.tool_sandbox='docker' is not allowed; choose one of bwrap"):
        load_config(tool, ["model.path=m", "workflow.tool_sandbox=docker"])


@pytest.mark.parametrize("text,needle", [("model: [\n", "not valid YAML"), ("- 1\n- 2\n", "must hold a mapping")])
def test_malformed_yaml_gives_one_line(tmp_path, text, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(DEMO, ["rollout.eta=[1"])
    with pytest.raises(ConfigError, match="finite"):
        load_config(DEMO, ["rollout.temperature=nan"])


def test_missing_file_and_required_key(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(None, [])


def test_cli_config_and_error(tmp_path):
    exe = [sys.executable, "-m", "areal_hpc.cli"]
    out = subprocess.run(exe + ["config", str(DEMO), "rollout.eta=3"], capture_output=True, text=True, check=True)
    assert "eta: 3" in out.stdout
    bad = subprocess.run(exe + ["config", str(DEMO), "rollout.eta=x"], capture_output=True, text=True)
    assert bad.returncode != 0
    assert bad.stderr.strip().count("\n") == 0 and "rollout.eta" in bad.stderr


def test_arithmetic_dataset_is_disjoint_and_correct():
    ds = arithmetic_dataset(300, 100, 19, seed=0)
    assert len(ds.train) == 300 and len(ds.heldout) == 100
    assert not {p.prompt for p in ds.train} & {p.prompt for p in ds.heldout}
    for p in ds.train[:50]:
        a, b = p.prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(p.answer) and len(a) == 2
    with pytest.raises(ValueError, match="distinct problems"):
        arithmetic_dataset(400, 100, 19, seed=0)


def test_jsonl_loader_skips_and_counts_malformed_rows(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [
        json.dumps({"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}),
        "{not json",
        json.dumps({"question": "", "answer": "1"}),
        json.dumps({"answer": "3"}),
        json.dumps({"question": "Half of 1?", "answer": "\\frac{1}{2}"}),
        json.dumps([1, 2]),
        json.dumps({"question": "Seven?", "answer": 7}),
        json.dumps({"question": "x", "answer": None}),
    ]
    path.write_text("\n".join(rows) + "\n")
    with pytest.warns(UserWarning, match="skipped 5 malformed rows"):
        ds = load_math_dataset(path, "jsonl", prompt_template="Q: {question}\nA:", heldout_size=1)
    probs = sorted(ds.train + ds.heldout, key=lambda p: p.prompt_id)
    assert [p.answer for p in probs] == ["4", "\\frac{1}{2}", "7"]
    assert probs[0].prompt == "Q: What is 2+2?\nA:"
    assert ds.skipped_rows == 5 and len(ds.heldout) == 1


def test_parquet_loader_with_custom_keys(tmp_path):
    path = tmp_path / "math.parquet"
    pd.DataFrame({"problem": ["1+1?", "2*3?", None, "5-5?"], "solution": [2.0, 6.5, 0.0, float("nan")]}).to_parquet(
        path
    )
    with pytest.warns(UserWarning, match="skipped 2"):
        ds = load_math_dataset(path, "parquet", question_key="problem", answer_key="solution", heldout_size=1)
    assert sorted(p.answer for p in ds.train + ds.heldout) == ["2", "6.5"]
    with pytest.raises(ValueError, match="no usable rows"):
        load_math_dataset(path, "parquet", question_key="nope")


def test_model_folder_checks(tiny_model_dir, tmp_path):
    assert check_model_folder(tiny_model_dir) == tiny_model_dir
    with pytest.raises(ModelFolderError, match="does not exist"):
        check_model_folder(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFolderError, match="no config.json"):
        check_model_folder(empty)
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelFolderError, match="no weights"):
        check_model_folder(empty)
    # build_tiny never replaces a folder a user filled, even one that is not a model
    from areal_hpc.config import ModelConfig
    from areal_hpc.model import ensure_model

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ModelFolderError, match="no config.json"):
        ensure_model(ModelConfig(path=str(mine), build_tiny=True))
    assert (mine / "notes.txt").read_text() == "keep me"


def test_tiny_model_folder_loads_in_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tok.encode("07+35=")
    assert tok.convert_ids_to_tokens(ids) == ["0", "7", "+", "3", "5", "="]
    assert tok.decode(tok.encode("\\boxed{42}") + [tok.eos_token_id], skip_special_tokens=True) == "\\boxed{42}"
    assert model.config.vocab_size == len(tok)


def test_cli_train_sync_bad_inputs_one_line(tmp_path):
    exe = [sys.executable, "-m", "areal_hpc.cli", "train-sync", str(DEMO), f"store.run_dir={tmp_path / 'run'}"]
    missing = subprocess.run(
        exe + [f"model.path={tmp_path / 'nope'}", "model.build_tiny=false"], capture_output=True, text=True
    )
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    assert missing.stderr.strip().count("\n") == 0
    (tmp_path / "run" / "rollouts").mkdir(parents=True)
    reused = subprocess.run(exe + [f"model.path={tmp_path / 'nope'}"], capture_output=True, text=True)
    assert reused.returncode != 0 and "already holds a run" in reused.stderr
    assert reused.stderr.strip().count("\n") == 0


def test_a_model_folder_built_by_two_jobs_at_once_is_published_once(tmp_path):
    # array tasks sharing model.path: the first folder published wins, the second build is discarded
    from areal_hpc.model import build_tiny_model

    first = build_tiny_model(tmp_path / "model", seed=0, if_absent=True)
    weights = first / "model.safetensors"
    stamp = (weights.stat().st_ino, weights.read_bytes())
    again = build_tiny_model(tmp_path / "model", seed=1, if_absent=True)  # lost the race
    assert again == first and (weights.stat().st_ino, weights.read_bytes()) == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # its temp folder is gone


def test_a_recipe_varies_its_base_and_a_base_loop_is_one_line(tmp_path):
    root = Path(__file__).resolve().parents[1] / "jobs"
    base = load_config(root / "math_1p5b_gpu.yaml", ["model.path=/m", "data.path=/d.jsonl"])
    dapo = load_config(root / "math_1p5b_gpu_dapo.yaml", ["model.path=/m", "data.path=/d.jsonl"])
    gspo = load_config(root / "math_1p5b_gpu_gspo.yaml", ["model.path=/m", "data.path=/d.jsonl"])
    assert (dapo.ppo.eps_clip_high, dapo.reward.overlong_buffer, dapo.rollout.max_new_tokens) == (0.28, 4096, 20480)
    assert (gspo.ppo.importance, gspo.ppo.eps_clip, gspo.ppo.loss_agg) == ("sequence", 3e-4, "seq_mean_token_mean")
    for variant in (dapo, gspo):  # everything else is the base's
        assert variant.slurm == base.slurm and variant.cluster == base.cluster and variant.trainer.lr == base.trainer.lr
    lora = load_config(root / "math_1p5b_gpu_lora.yaml", ["model.path=/m", "data.path=/d.jsonl"])
    assert (lora.trainer.lora_rank, lora.trainer.lr, lora.ppo) == (32, 10 * base.trainer.lr, base.ppo)
    demo_lora = load_config(root / "demo_lora.yaml")
    assert demo_lora.trainer.lora_rank == 8 and demo_lora.rollout == load_config(root / "demo.yaml").rollout
    (tmp_path / "a.yaml").write_text("base: b.yaml\nrollout:\n  eta: 1\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="base: files form a loop"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml' does not exist"):
        load_config(tmp_path / "c.yaml")
