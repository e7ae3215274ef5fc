"""`areal-hpc export` from a torch checkpoint and from ZeRO-3 shards of 2 trainers: transformers loads the folder and
computes the trainer's logits, eval of the export equals eval of the checkpoint; `eval` takes the GPU recipe as
--config; bad input gets one line and nothing is written."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from areal_hpc.cli import main
from areal_hpc.config import load_config, save_config
from areal_hpc.data import arithmetic_problems
from areal_hpc.launch.environment import rank_env
from areal_hpc.rundir import RunDir
from areal_hpc.rundir.actions import create
from areal_hpc.runtime.sync_loop import run_sync

ROOT = Path(__file__).resolve().parents[1]
HF_FILES = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _ok(*args):
    res = _cli(*args)
    assert res.exit_code == 0, res.output
    return res


def _model(folder, weights=None):
    from transformers import AutoModelForCausalLM

    from areal_hpc.model import no_hf_progress_bars

    with no_hf_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model


def _logits(model) -> torch.Tensor:
    probe = torch.randint(4, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(probe).logits


def _run_of(ckpt: Path) -> RunDir:
    return RunDir(ckpt.parent.parent)


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory) -> Path:
    """The demo after its warm start and one RL version: right often enough (about 1 in 5) that equal
    accuracies mean something."""
    tmp = tmp_path_factory.mktemp("torchrun")
    overrides = [f"store.run_dir={tmp / 'run'}", f"model.path={tmp / 'model'}", "trainer.versions=1"]
    overrides += ["logging.eval_every=0", "logging.progress=false", "logging.trackers=[]"]
    done = run_sync(load_config(ROOT / "jobs" / "demo_sync.yaml", overrides))
    return RunDir(done.run_dir).trainer_checkpoint(1)


@pytest.fixture(scope="module")
def torch_export(torch_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "torch-v1"
    return out, _ok("export", torch_ckpt, out)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """40 held-out style sums as a jsonl file of question + answer rows."""
    f = tmp_path_factory.mktemp("data") / "sums.jsonl"
    f.write_text("".join(json.dumps(p.row) + "\n" for p in arithmetic_problems(40, 19, seed=10_000)))
    return f


@pytest.fixture(scope="module")
def zero3_ckpt(tiny_model_dir, ppo_batch, tmp_path_factory):
    """One PPO version by 2 DeepSpeed ZeRO-3 trainers, checkpointed into a run's folder; and their weights."""
    tmp = tmp_path_factory.mktemp("zero3")
    overrides = [f"model.path={tiny_model_dir}", "trainer.engine=deepspeed", "trainer.zero_stage=3"]
    cfg = load_config(ROOT / "jobs" / "demo.yaml", overrides)
    run = create(RunDir(tmp / "run"), cfg)
    with open(tmp / "batch.pkl", "wb") as f:
        pickle.dump(ppo_batch, f)
    script = ROOT / "tests" / "mpi" / "deepspeed_checkpoint.py"
    args = [tiny_model_dir, run, 3, tmp / "batch.pkl", tmp / "weights.pt"]
    cmd = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, script, *args]
    env = {**rank_env(local_mpirun=True), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run.trainer_checkpoint(1), torch.load(tmp / "weights.pt")


def test_torch_export_loads_in_transformers_with_the_trainers_weights(torch_ckpt, torch_export, tmp_path):
    out, res = torch_export
    base = Path(load_config(_run_of(torch_ckpt).config).model.path)
    assert {p.name for p in out.iterdir()} == HF_FILES | {"chat_template.jinja"}  # the base folder's, new weights
    assert res.stdout.count("\n") == 1 and res.stdout.startswith(f"wrote {out} (") and "version 1" in res.stdout
    trained = load_file(torch_ckpt / "model.safetensors")
    got = _logits(_model(out))
    torch.testing.assert_close(got, _logits(_model(base, trained)))
    assert not torch.allclose(got, _logits(_model(base)), atol=1e-3)  # the trained weights, not the base's
    from areal_hpc.model import load_tokenizer

    q = [{"role": "user", "content": "03+04="}]
    assert load_tokenizer(out).apply_chat_template(q) == load_tokenizer(base).apply_chat_template(q)

    # --dtype bfloat16: the weights cast, and config.json says so (transformers then loads them as bf16)
    half = tmp_path / "bf16"
    _ok("export", torch_ckpt, half, "--dtype", "bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    for k, v in load_file(half / "model.safetensors").items():
        assert torch.equal(v, trained[k].to(torch.bfloat16)), k


def test_eval_of_the_export_equals_eval_of_the_checkpoint(torch_ckpt, torch_export, data_file, tmp_path):
    out, _ = torch_export
    common = ["--data", data_file, "--engine", "torch", "--temperature", "0"]
    _ok("eval", torch_ckpt, *common, "--json", tmp_path / "ckpt.json")
    _ok("eval", out, *common, "--config", _run_of(torch_ckpt).config, "--json", tmp_path / "export.json")
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("ckpt.json", "export.json"))
    assert a["n_problems"] == b["n_problems"] == 40
    assert a["rewards"] == b["rewards"] and a["mean_response_tokens"] == b["mean_response_tokens"]
    assert 0 < a["avg_at_k"] < 1  # some right, some wrong: equal figures say the weights are the same


def test_eval_takes_the_gpu_recipe_as_config_for_a_checkpoint(torch_ckpt, data_file, tmp_path):
    """The documented command: the checkpoint gives the model, --data the data (the recipe leaves both unset)."""
    recipe = ROOT / "jobs" / "math_1p5b_gpu.yaml"
    args = ["eval", torch_ckpt, "--config", recipe, "--data", data_file, "--engine", "torch", "--max-new-tokens", 8]
    if not torch.cuda.is_available():  # the recipe's cluster.device=cuda is refused in one line, not a traceback
        res = _cli(*args)
        assert res.exit_code != 0 and "cluster.device=cuda" in res.output and res.output.count("\n") == 1
    _ok(*args, "--json", tmp_path / "recipe.json", "cluster.device=cpu")
    got = json.loads((tmp_path / "recipe.json").read_text())
    assert got["version"] == 1 and got["n_problems"] == 40 and got["model"] == str(torch_ckpt)


def test_zero3_export_runs_without_mpi_and_holds_the_trainers_weights(zero3_ckpt, tiny_model_dir, tmp_path):
    ckpt, weights = zero3_ckpt
    out = tmp_path / "zero3-v1"
    # as on a login node: no MPI environment, no accelerator named, and mpi4py never imported
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "DS_"))}
    code = (
        "import sys; from areal_hpc.cli import main\n"
        f"main(['export', {str(ckpt)!r}, {str(out)!r}], standalone_mode=False)\n"
        "assert 'mpi4py' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DeepSpeed ZeRO-3 shards of 2 trainers" in r.stdout and r.stdout.count("\n") == 1
    assert {p.name for p in out.iterdir()} >= HF_FILES
    exported = _model(out)
    for k, v in exported.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0, msg=k)
    got = _logits(exported)
    torch.testing.assert_close(got, _logits(_model(tiny_model_dir, weights)))
    assert not torch.allclose(got, _logits(_model(tiny_model_dir)), atol=1e-3)


def _copy_run(ckpt: Path, dst: Path) -> Path:
    """The run's config and one checkpoint of it, in a run folder of their own."""
    run, copy = _run_of(ckpt), RunDir(dst)
    copy.checkpoints.mkdir(parents=True)
    shutil.copy(run.config, copy.config)
    return Path(shutil.copytree(ckpt, copy.checkpoints / ckpt.name))


def test_bad_input_gets_one_line_and_nothing_is_written(torch_ckpt, zero3_ckpt, tmp_path):
    no_weights = _copy_run(torch_ckpt, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    torn = _copy_run(torch_ckpt, tmp_path / "torn")
    (torn / "model.safetensors").write_bytes((torch_ckpt / "model.safetensors").read_bytes()[:4096])
    one_shard = _copy_run(zero3_ckpt[0], tmp_path / "one-shard")
    next((one_shard / "ds").glob("*rank_1_*optim_states.pt")).unlink()
    no_model = _copy_run(torch_ckpt, tmp_path / "no-model")
    run = _run_of(no_model)
    save_config(load_config(run.config, [f"model.path={tmp_path / 'gone'}"]), run.config)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases = [
        (torch_ckpt.parent.parent, None, "is not a run's checkpoint folder"),
        (tmp_path / "missing", None, "is not a run's checkpoint folder"),
        (no_weights, None, "is incomplete: no model.safetensors"),
        (one_shard, None, "is incomplete: ds/ holds 1 optimizer and 2 model shards of the 2 ZeRO-3 trainers"),
        (no_model, None, f"model folder '{tmp_path / 'gone'}' (model.path in {run.config}) is gone"),
        (torch_ckpt, full, "exists and is not empty"),
        (torn, None, "cannot be read"),
    ]
    for ckpt, out, says in cases:
        out = out or tmp_path / "out"
        before = sorted(out.parent.iterdir())
        res = _cli("export", ckpt, out)
        assert res.exit_code != 0, (ckpt, res.output)
        lines = res.stderr.splitlines()  # one line; a file found damaged only when read: after the progress line
        assert len(lines) == (2 if ckpt == torn else 1) and lines[-1].startswith("Error: "), res.stderr
        assert says in lines[-1], res.stderr
        assert sorted(out.parent.iterdir()) == before  # no OUT_DIR, no temporary left beside it
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
