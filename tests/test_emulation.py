"""Emulated engines (cost model instead of compute), the 16+5 emulated cluster run, and the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from areal_hpc.config import ConfigError, load_config
from areal_hpc.costmodel import PRESETS, ResponseLengths, train_tokens
from areal_hpc.engines import make_generation_engine
from areal_hpc.engines.base import generate
from areal_hpc.engines.emulated_train import EmulatedTrainEngine
from areal_hpc.launch.local import launch
from areal_hpc.simulate import calibrate, sim_config, simulate
from areal_hpc.store import Ledger, list_shards, load_trajectories, read_shard_summary
from areal_hpc.types import GenRequest, Trajectory

ROOT = Path(__file__).resolve().parents[1]
EMULATED = ROOT / "jobs" / "emulated_1p5b.yaml"
CLI = [sys.executable, "-m", "areal_hpc.cli"]


def test_presets_are_memory_bound_in_decode_and_near_arealss_generation_rate():
    m = PRESETS["1.5B"]
    # 256 sequences at 4k tokens of context each: reading the KV cache dominates, as on GPUs
    step = float(m.decode_step_s(256, 256 * 4096))
    assert step > 2 * float(m.decode_step_s(256, 256 * 512))
    # AReaL: 0.13 M tok/s generation on 8 GPUs for the 1.5B model, i.e. ~16k tok/s per GPU
    assert 8e3 < 256 / step < 3e4
    assert PRESETS["7B"].train_tokens_per_s < m.train_tokens_per_s / 4  # about 5x the parameters


def _engine(tiny_model_dir, **kw):
    return make_generation_engine(
        "emulated", model_path=str(tiny_model_dir), max_num_seqs=4, time_scale=1e-3, len_median=6, **kw
    )


def test_emulated_engine_keeps_the_step_contract(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    reqs = [GenRequest(f"0:{i}", [1, 2, 3], max_new_tokens=40) for i in range(6)]
    out = {}

    def step():
        for o in eng.step():
            out[o.request_id] = o
            assert o.request_id not in {s.request.request_id for s in eng.running}  # leaves in its step

    eng.add(reqs[:2])
    step()
    eng.add(reqs[2:])  # join mid-flight; those beyond the 4 slots wait
    assert eng.num_running + len(out) == 2 and eng.num_waiting == 4
    step()
    assert eng.num_running == 4 or eng.num_waiting == 0  # no slot stays free while a request waits
    while len(out) < 6:
        step()
    lengths = [len(o.output_ids) for o in out.values()]
    assert len(set(lengths)) > 1 and max(lengths) <= 40  # drawn, long-tailed, capped
    # the same request again has the same length; interrupted and resumed it still stops there
    again = _engine(tiny_model_dir)
    r = reqs[0]
    again.add([r])
    again.step()
    again.step()
    (partial,) = again.interrupt()
    again.pause()
    again.update_weights(again.state_dict(), 7)
    again.resume()
    (done,) = generate(again, [r.resumed(partial)])
    assert len(done.output_ids) == len(out[r.request_id].output_ids)
    assert done.output_versions[:2] == [0, 0] and set(done.output_versions[2:]) == {7}


def test_emulated_steps_take_the_cost_models_time(tiny_model_dir):
    eng = _engine(tiny_model_dir, cost_overrides={"step_overhead_s": 5.0}, len_sigma=0.0)
    took = {}
    for scale in (2e-3, 6e-3):  # 10 ms, then 30 ms per step
        eng.time_scale = scale
        eng.add([GenRequest(f"0:{scale}", [1], max_new_tokens=30)])
        t0 = time.monotonic()
        (o,) = [x for _ in range(6) for x in eng.step()]
        took[scale] = time.monotonic() - t0
        assert len(o.output_ids) == 6 and o.finish_reason == "stop"
    # a sleep never ends early; side by side, three times the cost takes clearly longer, whatever the load
    assert took[2e-3] > 0.055 and took[6e-3] > 0.175 and took[6e-3] > 1.5 * took[2e-3], took


def test_emulated_engines_go_together_and_bad_cost_fields_are_one_line():
    with pytest.raises(ConfigError, match="emulated engines go together"):
        load_config(EMULATED, ["trainer.engine=torch"])
    with pytest.raises(ConfigError, match="emulation.cost.flops is not a cost-model field"):
        load_config(EMULATED, ["emulation.cost={flops: 1}"])


@pytest.mark.slow
def test_emulated_cluster_of_16_generators_and_5_trainers_keeps_staleness_and_exactly_once(tmp_path):
    eta = 2
    cfg = load_config(
        EMULATED,
        [
            f"store.run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            f"rollout.eta={eta}",
            "rollout.max_new_tokens=48",
            "trainer.versions=5",
            "logging.progress=false",
        ],
    )
    s = launch(cfg, progress=False)
    assert s["versions"] == 5 and s["aborted_requests"] > 0  # new weights interrupted running requests
    run = tmp_path / "run"
    gens = {p.name.split("-")[0] for p in list_shards(run / "rollouts")}
    assert len(gens) == 16  # every generator rank wrote rollouts
    ledger = Ledger(run)  # raises on a trajectory consumed twice
    sizes = {p.name: read_shard_summary(p).n_trajectories for p in list_shards(run / "rollouts")}
    assert all(shard in sizes and i < sizes[shard] for shard, i in ledger.consumed())
    df = load_trajectories(run)
    eaten = df[df.consumed_version >= 0]
    assert len(eaten) == len(ledger.consumed()) == 5 * 85 * 16
    assert (eaten.consumed_version - eaten.version_start <= eta).all()
    assert (eaten.version_end <= eaten.consumed_version).all()
    # the emulated trainer counts the positions it computed (arithmetic prompts are below share_min_tokens)
    m = pd.read_csv(run / "metrics.csv")
    m = m[m.version > 0]
    assert m.train_tokens_unshared.between(1, m.tokens).all() and (m.train_tokens_computed <= m.tokens).all()
    # the simulator can be calibrated on an emulated run (its accuracy there: benchmarks/emulated_sweep.py)
    sim, measured = calibrate(run)
    assert sim.n_generators == 16 and sim.cost.sync_s == pytest.approx(4 * PRESETS["1.5B"].sync_s, rel=0.1)


def test_simulator_on_the_papers_shape_shows_the_eta_curve():
    cfg = load_config(EMULATED, ["trainer.versions=4", "rollout.max_new_tokens=2048"])
    sim = sim_config(cfg)
    rows = {eta: simulate(replace(sim, eta=eta)) for eta in (0, 1, 4)}
    tput = {eta: r.consumed_tokens_per_s for eta, r in rows.items()}
    assert tput[0] < tput[1] < tput[4]
    assert all(max(r.staleness) <= eta for eta, r in rows.items())
    assert rows[0].gen_busy < rows[4].gen_busy
    modes = {m: simulate(replace(sim, eta=4, weight_update=m)) for m in ("keep_kv", "recompute", "drain")}
    assert modes["recompute"].interrupted > 0 and modes["keep_kv"].interrupted == modes["drain"].interrupted == 0
    # recompute prefills the interrupted partials again; keep_kv and drain prefill each sequence once
    prefill = {m: r.prefill_tokens for m, r in modes.items()}
    assert prefill["recompute"] > 1.2 * prefill["keep_kv"], prefill
    assert ResponseLengths(100, 1.0, 400).quantile(0.999) == 400  # the tail is capped


def test_simulator_predicts_the_trainers_prefix_sharing():
    """An agent-shaped workload (a 4,000-token preamble, 8 answers of 300 tokens): sharing the preamble cuts the
    trainers' time per version by the ratio of the positions computed, 6,400 for 34,400; off, today's figures."""
    shape = ["trainer.versions=3", "rollout.n_samples=8", "rollout.max_new_tokens=300"]
    cfg = load_config(EMULATED, [*shape, "trainer.max_tokens_per_mb=8192"])
    sim = replace(sim_config(cfg, prompt_len=4000), lengths=ResponseLengths(300, 0.0, 300))
    on, off = simulate(sim), simulate(replace(sim, share_prefixes=False))
    assert off.train_tokens_computed == off.train_tokens_unshared == on.train_tokens_unshared == on.tokens_consumed
    assert on.train_tokens_computed / on.train_tokens_unshared == pytest.approx(6400 / 34400)
    assert on.train_s_per_version / off.train_s_per_version == pytest.approx(6400 / 34400)
    assert on.wall_s < off.wall_s / 2  # the trainers were the bottleneck
    # a group split across micro-batches keeps its prefix in each part: 4,000 + 13 answers fit in 8,192 tokens
    split = simulate(replace(sim, max_tokens_per_mb=4500))  # one answer per part: nothing saved
    assert split.train_tokens_computed == split.train_tokens_unshared
    assert train_tokens(4000, [300] * 8, mb_tokens=4600) == 4 * 4000 + 2400  # two answers per part
    assert train_tokens(31, [300] * 8) == 8 * 331 and train_tokens(32, [300] * 8, share=False) == 8 * 332
    # sharing off is a run where nothing is shared: the same figures as a prompt under the threshold
    cfg = load_config(EMULATED, ["trainer.versions=4", "rollout.max_new_tokens=2048"])
    off = simulate(replace(sim_config(cfg, prompt_len=64), share_prefixes=False))
    under = simulate(replace(sim_config(cfg, prompt_len=64), share_min_tokens=65))
    assert (off.wall_s, off.train_busy) == (under.wall_s, under.train_busy)
    assert simulate(sim_config(cfg, prompt_len=64)).wall_s < off.wall_s  # a 64-token prompt shared


def test_emulated_trainer_shares_each_groups_prefix():
    eng = EmulatedTrainEngine("unused", time_scale=0.0, max_tokens_per_mb=8192)
    rng = np.random.default_rng(0)
    preamble = rng.integers(0, 100, 4000)

    def traj(gid: int, prompt, answer: int) -> Trajectory:
        ids = np.concatenate([prompt, rng.integers(100, 200, answer)]).astype(np.int32)
        zeros = np.zeros(len(ids))
        return Trajectory(gid, gid, 0, ids, zeros, zeros, zeros, len(prompt))

    short = rng.integers(0, 100, 20)  # below trainer.share_min_tokens: computed per sequence
    trajs = [traj(0, preamble, 300) for _ in range(8)] + [traj(1, short, 50) for _ in range(4)]
    stats = eng.ppo_update(trajs, np.zeros(len(trajs)))
    assert stats["train_tokens_unshared"] == 8 * 4300 + 4 * 70
    assert stats["train_tokens_computed"] == 4000 + 8 * 300 + 4 * 70
    assert stats["emulated_train_s"] == pytest.approx(eng.cost.train_s(6400 + 280))
    off = EmulatedTrainEngine("unused", time_scale=0.0, share_prefixes=False).ppo_update(trajs, np.zeros(len(trajs)))
    assert off["train_tokens_computed"] == off["train_tokens_unshared"] == 8 * 4300 + 4 * 70


def test_simulate_cli_sweeps_and_refuses_bad_keys_in_one_line(tmp_path):
    r = subprocess.run(
        [
            *CLI,
            "simulate",
            str(EMULATED),
            "trainer.versions=3",
            "--sweep",
            "rollout.eta=0,2",
            "--plot",
            str(tmp_path / "s.png"),
            "--json",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "rollout.eta" in r.stdout and (tmp_path / "s.png").stat().st_size > 5000
    bad = subprocess.run(
        [*CLI, "simulate", str(EMULATED), "--sweep", "model.path=a,b"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--sweep" in bad.stderr
    # an agent-shaped workload: 4,000-token prompts shared by 8 answers of 300 tokens
    agent = [f"emulation.{k}" for k in ("len_median=300", "len_sigma=0")] + ["rollout.max_new_tokens=300"]
    shape = [*agent, "rollout.n_samples=8", "trainer.max_tokens_per_mb=8192", "trainer.versions=2"]
    r = subprocess.run(
        [*CLI, "simulate", str(EMULATED), *shape, "--prompt-tokens", "4000", "--json", str(tmp_path / "a.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "(81.4% saved by prefix sharing)" in r.stdout  # 6,400 of 34,400 positions
    result = json.loads((tmp_path / "a.json").read_text())["result"]
    assert result["train_tokens_computed"] * 34400 == result["train_tokens_unshared"] * 6400
    bad = subprocess.run(
        [*CLI, "simulate", str(EMULATED), "--prompt-tokens", "40", "--shared-prefix-tokens", "50"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--shared-prefix-tokens" in bad.stderr
