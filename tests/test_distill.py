"""On-policy distillation: the teacher's term against a direct computation, its refusals, an asynchronous run."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from areal_hpc.engines.teacher import DistillSpec
from areal_hpc.model.teacher import TeacherError, check_teacher, distill_spec

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo_distill.yaml"
T = 0.7  # a temperature other than 1: the teacher is read under softmax(logits / T), as the student is


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A wider teacher than the tiny student, with the same (arith) tokenizer."""
    from areal_hpc.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "wide", hidden_size=192, num_heads=4, seed=7)


def direct_teacher_logprobs(teacher: Path, seqs) -> list[np.ndarray]:
    """Each token's logprob from the teacher's full logits, one sequence at a time, unpacked (position 0: 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor(np.asarray(s))[None]
            logp = torch.log_softmax(model(ids).logits[0, :-1].float() / T, -1)
            out.append(np.concatenate([[0.0], logp.gather(1, ids[0, 1:, None])[:, 0].numpy()]))
    return out


def direct_advantage(adv: float, teacher: np.ndarray, t, coef: float) -> np.ndarray:
    """A_task + coef x (log p_teacher - log p_behaviour) on the loss tokens, the task advantage alone elsewhere."""
    return adv + coef * (teacher - t.behav_logprobs) * t.loss_mask


def test_teacher_logprobs_and_advantage_match_a_direct_computation_on_the_torch_trainer(
    tiny_model_dir, teacher_dir, ppo_batch
):
    from areal_hpc.algo.ppo import Objective
    from areal_hpc.engines.policy_step import PolicyStep
    from areal_hpc.engines.torch_train import TorchTrainEngine

    trajs, adv = ppo_batch
    seqs = [t.input_ids for t in trajs]
    want = direct_teacher_logprobs(teacher_dir, seqs)

    def engine(distill):
        kw = dict(optimizer="sgd", lr=0.1, weight_decay=0.0, grad_clip=0.0, n_minibatches=2, seed=0, temperature=T)
        kw |= dict(max_tokens_per_mb=40, logprob_chunk_tokens=7)  # packed micro-batches, 7 positions at a time
        return TorchTrainEngine(str(tiny_model_dir), distill=distill, **kw)

    eng = engine(DistillSpec(str(teacher_dir), 0.5))
    totals: dict = {}
    got = eng._teacher_logprobs(seqs, totals)
    assert totals["teacher_t_end"] >= totals["teacher_t_start"]  # the timeline's "teacher" span
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)

    idx = list(range(len(trajs)))
    step = PolicyStep(
        Objective(), True, trajs, adv, idx, [None] * len(trajs), [None] * len(trajs), dict.fromkeys(idx, 1.0), 0,
        torch.device("cpu"), teacher_all=want, distill_coef=0.5,
    )  # fmt: skip
    direct = np.concatenate([direct_advantage(float(a), w, t, 0.5) for a, w, t in zip(adv, want, trajs)])
    np.testing.assert_allclose(step.cat["adv"].numpy(), direct, rtol=1e-5, atol=1e-6)

    # the update trains on it: with every task advantage zero, the teacher's term alone moves the weights
    zero = np.zeros(len(trajs), np.float32)
    before = {k: v.clone() for k, v in eng.weights().items()}
    student = eng.compute_logprobs(seqs)  # the proximal recompute: the student the term compares with
    stats = eng.ppo_update(trajs, zero)
    assert any(not torch.equal(before[k], v) for k, v in eng.weights().items())
    gap = np.concatenate([(s - w)[t.loss_mask > 0] for s, w, t in zip(student, want, trajs)])
    assert stats["distill_kl"] == pytest.approx(gap.mean(), rel=1e-4)
    # the engine centres the term on the batch's mean gap: a constant baseline, which keeps the gradient's
    # expectation while the gap's mean (minus the reverse KL) stops pushing every sampled token down at once
    assert eng._distill_baseline == pytest.approx(-gap.mean(), rel=1e-5)
    centred = PolicyStep(
        Objective(), True, trajs, adv, idx, student, [None] * len(trajs), dict.fromkeys(idx, 1.0), 0,
        torch.device("cpu"), teacher_all=want, distill_coef=0.5, distill_baseline=-gap.mean(),
    )  # fmt: skip
    mask = np.concatenate([t.loss_mask for t in trajs])
    fresh = np.concatenate([a + 0.5 * (w - s) * t.loss_mask for a, w, s, t in zip(adv, want, student, trajs)])
    np.testing.assert_allclose(centred.cat["adv"].numpy(), fresh + 0.5 * gap.mean() * mask, rtol=1e-5, atol=1e-5)
    plain = engine(None)
    plain.ppo_update(trajs, zero)
    assert all(torch.equal(before[k], v) for k, v in plain.weights().items())  # nothing to learn without it
    assert "distill_kl" not in plain.ppo_update(trajs, zero)


@pytest.mark.slow
def test_deepspeed_zero3_trainers_compute_the_same_teacher_logprobs(tiny_model_dir, teacher_dir, ppo_batch, tmp_path):
    from areal_hpc.launch.environment import rank_env

    trajs, adv = ppo_batch
    with open(tmp_path / "batch.pkl", "wb") as f:
        pickle.dump((trajs, adv), f)
    cmd = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable]
    cmd += [str(ROOT / "tests" / "mpi" / "distill_teacher.py"), str(tiny_model_dir), str(teacher_dir), str(tmp_path)]
    env = {**rank_env(local_mpirun=True), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "ds.pkl", "rb") as f:
        ranks = pickle.load(f)
    assert [len(m) for m, _, _, _ in ranks] == [3, 2]
    both = [i for mine, _, _, _ in ranks for i in mine]
    seqs = [trajs[i].input_ids for i in both]
    # the student the term compares with: the trainers' proximal recompute, the student folder's own weights here
    student = dict(zip(both, direct_teacher_logprobs(tiny_model_dir, seqs)))
    whole = np.concatenate(
        [(w - student[i])[trajs[i].loss_mask > 0] for i, w in zip(both, direct_teacher_logprobs(teacher_dir, seqs))]
    )
    for _, _, _, baseline in ranks:  # the whole batch's mean gap on every trainer, not its own share's
        assert baseline == pytest.approx(whole.mean(), rel=1e-5)
    for mine, lps, kl, _ in ranks:
        want = direct_teacher_logprobs(teacher_dir, [trajs[i].input_ids for i in mine])
        for g, w in zip(lps, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        gap = np.concatenate([(student[i] - w)[trajs[i].loss_mask > 0] for i, w in zip(mine, want)])
        assert kl == pytest.approx(gap.mean(), rel=1e-4)


def test_a_teacher_with_another_tokenizer_or_a_smaller_vocabulary_is_refused_in_one_line(
    tiny_model_dir, teacher_dir, tmp_path
):
    from areal_hpc.model import build_arith_tokenizer, build_tiny_model

    check_teacher(str(teacher_dir), tiny_model_dir)  # same tokenizer, wider model: fine
    other = build_tiny_model(tmp_path / "tool", tokenizer=build_arith_tokenizer(vocab="arith_tool"), seed=1)
    with pytest.raises(TeacherError, match="another tokenizer than model.path") as err:
        check_teacher(str(other), tiny_model_dir)
    assert len(str(err.value).splitlines()) == 1
    small = tmp_path / "small"
    shutil.copytree(teacher_dir, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] - 1}))
    with pytest.raises(TeacherError, match="fewer than the"):
        check_teacher(str(small), tiny_model_dir)
    with pytest.raises(TeacherError, match="does not exist"):
        check_teacher(str(tmp_path / "gone"), tiny_model_dir)


def test_the_distillation_settings_refuse_contradictions_in_one_line():
    from areal_hpc.config import ConfigError, load_config

    for overrides, words in (
        (["distill.task_reward=false"], "needs distill.teacher"),
        (["distill.teacher=/t", "distill.task_reward=false"], "ppo.drop_uniform_groups=false"),
        (["distill.teacher=/t", "distill.coef=0"], "coefficient > 0"),
        (["distill.teacher=/t", "distill.estimator=exact"], "choose one of sample, full"),
        (
            ["distill.teacher=/t", "distill.estimator=full", "trainer.engine=deepspeed", "trainer.zero_stage=3"],
            "ZeRO-3",
        ),
    ):
        with pytest.raises(ConfigError, match=words):
            load_config(DEMO.parent / "demo.yaml", overrides)


def test_a_resume_keeps_the_same_teacher(teacher_dir, tiny_model_dir, tmp_path):
    from areal_hpc.model import build_tiny_model
    from areal_hpc.model.record import record_model, record_teacher, teacher_mismatch

    run = tmp_path / "run"
    run.mkdir()
    assert teacher_mismatch(run, str(teacher_dir)) is None  # a first start
    record_model(run, tiny_model_dir)
    record_teacher(run, str(teacher_dir))
    moved = tmp_path / "moved"
    shutil.copytree(teacher_dir, moved)
    assert teacher_mismatch(run, str(teacher_dir)) is None and teacher_mismatch(run, str(moved)) is None
    assert "another model: its config.json differs" in teacher_mismatch(run, str(tiny_model_dir))
    reseeded = build_tiny_model(tmp_path / "reseeded", hidden_size=192, num_heads=4, seed=8)
    assert "another model: its weights differ" in teacher_mismatch(run, str(reseeded))
    assert "distill.teacher is empty" in teacher_mismatch(run, "")
    assert "does not exist" in teacher_mismatch(run, str(tmp_path / "gone"))
    fresh = tmp_path / "plain"
    fresh.mkdir()
    record_model(fresh, tiny_model_dir)  # a run that started without a teacher
    assert "started without distillation" in teacher_mismatch(fresh, str(teacher_dir))


@pytest.mark.slow
def test_an_async_run_distilling_alone_logs_distill_kl_every_version(teacher_dir, tmp_path):
    """The demo's student, distilling alone from a wider teacher, asynchronously (eta 2, two generators, keep_kv):
    distill_kl in every version's row, the teacher's forward on the trainer's timeline, a checkpoint as a teacher,
    a resume naming another teacher refused before anything starts, and one naming the same teacher going on with
    the exact KL (distill.estimator=full)."""
    from safetensors.torch import load_file

    from areal_hpc.config import load_config
    from areal_hpc.engines.teacher import load_teacher
    from areal_hpc.launch.local import RunFailed, launch, prepare_run_dir

    overrides = [
        f"store.run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        f"distill.teacher={teacher_dir}",
        "distill.estimator=sample",  # the recipe's is full, which the resume below switches to
        "logging.progress=false",
        "logging.trackers=[]",
        "trainer.versions=4",
        "trainer.max_wall_s=0",
        "trainer.warm_start_steps=5",
        "trainer.checkpoint_every=2",
        "rollout.batch_prompts=8",
        "logging.eval_prompts=10",
        # groups that all score alike still teach here: the run-cannot-learn detector must not stop the run
        "trainer.max_uniform_batches=1",
    ]
    cfg = load_config(DEMO, overrides)
    assert not cfg.distill.task_reward and not cfg.ppo.drop_uniform_groups and cfg.rollout.n_samples == 1
    s = launch(cfg, progress=False)
    run = tmp_path / "run"
    m = pd.read_csv(run / "metrics.csv")
    trained = m[m["version"] >= 1]
    assert s["versions"] == 4 and len(trained) == 4
    assert trained["distill_kl"].notna().all() and np.isfinite(trained["distill_kl"]).all()
    tl = pd.concat(pd.read_csv(p) for p in (run / "timeline").glob("rank*.csv"))
    assert (tl["event"] == "teacher").sum() == 4
    assert json.loads((run / "teacher.json").read_text())["path"] == str(teacher_dir.resolve())

    # a checkpoint of this project as a teacher: its run's architecture, its weights
    ckpt = run / "checkpoints" / "v00000004"
    held = load_teacher(distill_spec(str(ckpt)), "float32", "cpu", packing=False).model.state_dict()
    for k, v in load_file(str(ckpt / "model.safetensors")).items():
        torch.testing.assert_close(held[k], v)
    with pytest.raises(RunFailed, match="another model"):
        prepare_run_dir(load_config(DEMO, [*overrides, f"distill.teacher={ckpt}", "trainer.versions=6"]), True)

    # the same teacher resumes, here with the exact KL (estimator full) asynchronously: its distill_kl is a KL, >= 0
    full = load_config(DEMO, [*overrides, "trainer.versions=6", "distill.estimator=full"])
    s = launch(full, resume=True, progress=False)
    assert load_config(run / "config.yaml").distill.estimator == "full"  # what the ranks ran with
    resumed = pd.read_csv(run / "metrics.csv").drop_duplicates("version", keep="last").set_index("version")
    assert s["versions"] == 6 and {5, 6} <= set(resumed.index)
    assert (resumed.loc[[5, 6], "distill_kl"] >= 0).all() and np.isfinite(resumed.loc[[5, 6], "distill_kl"]).all()


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared_prefixes"])
def test_the_full_estimator_loss_and_gradients_match_a_direct_computation(
    tiny_model_dir, teacher_dir, ppo_batch, share
):
    """distill.estimator=full on the fused head: the loss is the policy term plus coef x w_t x KL(student || teacher)
    over the whole vocabulary at each loss token (w_t: the token's aggregation weight), both under softmax(logits /
    T); its value and every gradient of the student equal those of full logits, one sequence at a time, unpacked."""
    from transformers import AutoModelForCausalLM

    from areal_hpc.algo.ppo import Objective, policy_loss, sequence_weights
    from areal_hpc.engines.torch_train import TorchTrainEngine
    from areal_hpc.store.columns import as_columns

    trajs, adv = ppo_batch
    coef, n = 0.5, len(trajs)
    kw = dict(optimizer="sgd", lr=0.1, weight_decay=0.0, grad_clip=0.0, n_minibatches=1, seed=0, temperature=T)
    # chunks of 7 head rows; several micro-batches; a group's prompt laid down once with share_prefixes
    kw |= dict(max_tokens_per_mb=64, logprob_chunk_tokens=7, share_prefixes=share, share_min_tokens=1)
    eng = TorchTrainEngine(str(tiny_model_dir), distill=DistillSpec(str(teacher_dir), coef, estimator="full"), **kw)
    eng.loss_agg = "seq_mean_token_mean"  # a weight that differs between sequences
    batch, seqs, none = as_columns(trajs), [t.input_ids for t in trajs], [None] * n
    totals: dict = {}
    eng._distill_version(batch, seqs, none, totals)
    assert eng._teacher_all is None and "teacher_t_start" not in totals  # no advantage term, no teacher pass
    loss_tokens = [int(t.loss_mask.sum()) for t in trajs]
    seq_weight = dict(enumerate(sequence_weights(loss_tokens, eng.loss_agg, sum(loss_tokens), n, 1)))
    eng.batching.reset()
    loss = 0.0
    for micro in eng.batching.plan(seqs):
        part = eng._ppo_micro(batch, adv, none, none, micro, seq_weight)[0]
        part.backward()
        loss += float(part.detach())
    counts = eng.batching.counts()
    if share:  # the prefix tree's shared head rows were exercised
        assert counts["train_tokens_computed"] < counts["train_tokens_unshared"]
    got = {k: p.grad.clone() for k, p in eng.model.named_parameters()}

    student = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    student.load_state_dict(eng.model.state_dict())
    direct, kls = torch.zeros(()), []
    for i, t in enumerate(trajs):
        ids = torch.as_tensor(t.input_ids)[None]
        ls = torch.log_softmax(student(ids).logits[0, :-1].float() / T, -1)
        with torch.no_grad():
            lt = torch.log_softmax(teacher(ids).logits[0, :-1].float() / T, -1)
        kl = (ls.exp() * (ls - lt)).sum(-1)
        logp = ls.gather(1, ids[0, 1:, None])[:, 0]
        behav, mask = torch.as_tensor(t.behav_logprobs[1:]), torch.as_tensor(t.loss_mask[1:]).float()
        w = torch.full_like(logp, seq_weight[i])
        pg, _ = policy_loss(Objective(), logp, behav, behav, torch.full_like(logp, float(adv[i])), mask, w)
        direct = direct + pg + coef * (w * mask * kl).sum()
        kls.append(kl.detach()[mask > 0])
    direct.backward()
    assert loss == pytest.approx(float(direct.detach()), rel=1e-5)
    for k, p in student.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-5, atol=1e-6, msg=k)
    assert eng._distill_stats()["distill_kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-5)

    # a whole version on the term alone (every task advantage zero): the weights move, distill_kl is logged
    before = {k: v.clone() for k, v in eng.weights().items()}
    stats = eng.ppo_update(trajs, np.zeros(n, np.float32))
    assert any(not torch.equal(before[k], v) for k, v in eng.weights().items())
    assert np.isfinite(stats["distill_kl"]) and stats["distill_kl"] > 0
