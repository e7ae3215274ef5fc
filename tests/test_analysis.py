"""areal_hpc.analysis and the simulator on two real runs (eta=0 and eta=2 under mpirun)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from areal_hpc import analysis
from areal_hpc.config import load_config
from areal_hpc.launch.local import launch
from areal_hpc.rundir import RunDirError
from areal_hpc.store import load_trajectories

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A synchronous and an asynchronous run of the same short workload, evaluated every 2 versions."""
    root = tmp_path_factory.mktemp("analysis")
    paths = []
    for eta in (0, 2):
        cfg = load_config(
            ROOT / "jobs" / "demo.yaml",
            [
                f"store.run_dir={root / f'eta{eta}'}",
                f"model.path={root / 'model'}",
                f"run_name=eta{eta}",
                f"rollout.eta={eta}",
                "cluster.n_generators=1",
                "rollout.batch_prompts=16",  # versions long enough that rank 0's relay latencies weigh little
                "trainer.warm_start_steps=20",
                "trainer.versions=16",  # shorter runs vary by up to 17% between two runs of one config
                "trainer.max_wall_s=0",
                "logging.eval_every=2",
                "logging.eval_prompts=20",
                # every group trains (no refill rounds of rejected ones): the simulator test's workload
                "ppo.drop_uniform_groups=false",
                "logging.progress=false",
                "logging.trackers=[]",
            ],
        )
        launch(cfg, progress=False)
        paths.append(root / f"eta{eta}")
    return paths


def test_loaders_give_one_tidy_table_with_the_differing_parameters(two_runs, tmp_path):
    runs = [analysis.load_run(p) for p in two_runs]
    tidy = analysis.load_runs(runs)
    assert analysis.varying(runs) == ["rollout.eta"]  # run_name and run_dir differ by construction
    assert len(tidy) == sum(len(r.metrics) for r in runs)
    assert tidy.groupby("run")["rollout.eta"].first().to_dict() == {"eta0": 0, "eta2": 2}
    assert {"version", "wall_s", "reward_mean", "heldout_acc"} <= set(tidy.columns)
    # a sweep directory's record names its points; the grid's key is the parameter column
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    points = [{"params": {"rollout.eta": e}, "run_dir": str(p), "job_id": "0"} for e, p in zip((0, 2), two_runs)]
    (sweep / "sweep.json").write_text(json.dumps({"points": points}))
    swept = analysis.load_sweep(sweep)
    assert set(swept["run"]) == {"eta0", "eta2"} and len(swept) == len(tidy)
    with pytest.raises(RunDirError, match="not a run directory"):
        analysis.load_run(tmp_path)
    with pytest.raises(RunDirError, match="not a sweep directory"):
        analysis.load_sweep(tmp_path)


def test_speedup_staleness_utilisation_and_curves_agree_with_the_raw_files(two_runs):
    sync, asyn = (analysis.load_run(p) for p in two_runs)
    target = float(np.nanmin([sync.metrics["heldout_acc"].max(), asyn.metrics["heldout_acc"].max()]))
    table = analysis.speedup_table([sync, asyn], baseline=two_runs[0], target_acc=target)
    assert table.loc["eta0", "throughput_speedup"] == 1.0
    ratio = asyn.summary["consumed_tokens_per_s"] / sync.summary["consumed_tokens_per_s"]
    assert table.loc["eta2", "throughput_speedup"] == pytest.approx(ratio)
    m = pd.read_csv(two_runs[1] / "metrics.csv")
    assert table.loc["eta2", "time_to_target_s"] == m.loc[m.heldout_acc >= target, "wall_s"].iloc[0]
    with pytest.raises(ValueError, match="is none of the runs"):
        analysis.speedup_table([sync, asyn], baseline="nope")

    dist = analysis.staleness_distribution([sync, asyn])
    for run, path in zip(("eta0", "eta2"), two_runs):
        t = load_trajectories(path)
        d = dist[dist.run == run]
        assert d.trajectories.sum() == (t.consumed_version >= 0).sum() and d.share.sum() == pytest.approx(1)
    assert set(dist[dist.run == "eta0"].staleness) == {0} and dist[dist.run == "eta2"].staleness.max() <= 2

    u = analysis.utilisation(asyn, bin_s=0.5)
    assert u.busy.between(0, 1 + 1e-9).all() and set(u.role) == {"generator", "trainer"}
    for role, event in (("generator", "generate"), ("trainer", "train")):
        spans = asyn.timeline[(asyn.timeline.role == role) & (asyn.timeline.event == event)]
        r = u[u.role == role]
        assert (r.busy * 0.5 * r.ranks).sum() == pytest.approx(spans.duration.sum(), rel=1e-6)

    curves = analysis.learning_curves([sync, asyn])
    assert len(curves) == len(sync.metrics) + len(asyn.metrics)
    assert (
        curves.heldout_acc.notna().sum()
        == sync.metrics.heldout_acc.notna().sum() + asyn.metrics.heldout_acc.notna().sum()
    )


def test_the_gap_is_measured_every_version_with_staleness_kept_apart(two_runs):
    sync, asyn = (analysis.load_run(p) for p in two_runs)
    for r in (sync, asyn):  # the recompute measures every loss token of every version
        trained = r.metrics[r.metrics.version > 0]
        assert trained["offpolicy_k3"].notna().all() and (trained["offpolicy_tokens"] == trained["gen_tokens"]).all()
    s = sync.metrics[sync.metrics.version > 0]
    assert (s["mismatch_tokens"] == s["offpolicy_tokens"]).all() and s["mismatch_k3"].notna().all()
    assert s["mismatch_k3"].lt(1e-6).all()  # torch fp32 generation against torch fp32 training: float rounding
    a = asyn.metrics[asyn.metrics.version > 0]
    assert (a["mismatch_tokens"] < a["offpolicy_tokens"]).any()  # stale tokens are left out of mismatch_*
    assert a["mismatch_tokens"].gt(0).any() and (a["mismatch_k3"].notna() == a["mismatch_tokens"].gt(0)).all()
    assert a["offpolicy_k3"].max() > 100 * a["mismatch_k3"].max()  # staleness dwarfs the numeric mismatch
    curves = analysis.mismatch_curves([sync, asyn])
    assert len(curves) == 2 * (len(s) + len(a)) and set(curves.tokens) == {"mismatch", "offpolicy"}
    got = curves[(curves.run == "eta2") & (curves.tokens == "offpolicy")].set_index("version")["k3"]
    assert got.to_dict() == a.set_index("version")["offpolicy_k3"].to_dict()


NOTEBOOK_FIGURES = {
    "speedup": {"speedup.png", "learning_wall.png", "learning_version.png"},
    "staleness": {"staleness.png"},
    "utilisation": {"utilisation_0.png", "utilisation_1.png"},
}


def test_notebooks_run_on_real_runs_and_write_every_figure(two_runs, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    for name, expected in NOTEBOOK_FIGURES.items():
        nb = nbformat.read(ROOT / "analysis" / f"{name}.ipynb", as_version=4)
        params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        figs = tmp_path / name
        params.source = (
            f"RUNS = {[str(p) for p in two_runs]!r}\nSWEEP = None\nBASELINE = None\nTARGET_ACC = 0.0\n"
            f"FIGURES = {str(figs)!r}\n"
        )
        client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
        client.execute()
        assert {p.name for p in figs.iterdir()} == expected, name
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in figs.iterdir())
        sources = "".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "import pandas" not in sources and "read_csv" not in sources  # only areal_hpc.analysis


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_hpc.cli", "report", *args], capture_output=True, text=True, timeout=300
    )


def test_report_compares_runs_or_a_sweep_in_one_html_file(two_runs, tmp_path):
    out = tmp_path / "report.html"
    r = _report(str(two_runs[1]), "--baseline", str(two_runs[0]), "--target-acc", "0", "-o", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    # speedup, two learning-curve figures, staleness, prefix sharing, the training-inference gap, one utilisation
    # figure per run
    assert text.count('src="data:image/png;base64,') == 8 and "Training-inference gap" in text
    shared = analysis.prefix_sharing(two_runs)  # the trainers' counts of positions computed, summed per version
    for run, path in zip(("eta0", "eta2"), two_runs):
        m = pd.read_csv(path / "metrics.csv").dropna(subset=["train_tokens_computed"])
        assert len(m) == len(shared[shared.run == run]) == m.version.gt(0).sum() > 0
        assert (m.train_tokens_computed <= m.train_tokens_unshared).all()
        assert (m.train_tokens_unshared >= m.tokens).all()  # every forward over every token, at least one
        computed, unshared = int(m.train_tokens_computed.sum()), int(m.train_tokens_unshared.sum())
        assert f"{run}: the trainers computed {computed:,} of the {unshared:,} token positions they stand for" in text
    assert "throughput_speedup" in text and "time_to_target_s" in text
    assert "<tr class=differs><td>rollout.eta</td><td>0</td><td>2</td></tr>" in text  # the baseline joins first
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    points = [{"params": {"rollout.eta": e}, "run_dir": str(p), "job_id": "0"} for e, p in zip((0, 2), two_runs)]
    (sweep / "sweep.json").write_text(json.dumps({"points": points}))
    r = _report(str(sweep), "-o", str(tmp_path / "sweep.html"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "sweep.html").read_text().count('src="data:image/png;base64,') == 8
    r = _report(str(tmp_path / "sweep" / ".."), "-o", str(tmp_path / "bad.html"))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "not a run directory" in r.stderr
    assert not (tmp_path / "bad.html").exists()


def _trainer_busy_share(run_dir: Path) -> float:
    """The share of the span the simulator models (first weights published to the last version trained) that
    the run's trainer spent loading and training (metrics.csv t_train)."""
    from areal_hpc.rundir import RunDir

    run = RunDir(run_dir)
    summary = json.loads(run.summary.read_text())
    m = pd.read_csv(run.metrics).drop_duplicates("version", keep="last")
    m = m[m["version"] > summary.get("start_version", 0)]
    span = float(m["wall_s"].iloc[-1]) - (float(summary["wall_s"]) - float(summary["rl_wall_s"]))
    return float(m["t_train"].sum() / span)


def test_simulator_calibrated_on_the_async_run_predicts_the_sync_run(two_runs):
    """Fitted to the eta=2 run's timeline, the model of the loop keeps what the two runs show whatever the host's
    speed: the share of each run's time its trainer was busy, and how much faster (or slower) the async run went.

    This direction because the asynchronous run shows how its roles share the 2 cores (they overlap), so
    the fit can take the sharing out of the costs; the synchronous run's roles never overlap. Tokens/s alone
    are a figure of the host's speed in each sitting: under load a run and its own simulation parted by 18%,
    then by 60% (load 16 on the 2 cores), while the shares below held within 0.05 and the ratio within 20%."""
    from areal_hpc.simulate import calibrate, simulate
    from areal_hpc.simulate.calibrate import trained_span_tokens_per_s

    sim, measured = calibrate(two_runs[1])  # measured costs and latencies; nothing tuned to the result
    itself = simulate(sim)
    assert 0 < measured["core_sharing"]["train_share"] <= 1 and measured["core_sharing"]["train_slowdown"] >= 0
    predicted = simulate(calibrate(two_runs[1], ["rollout.eta=0"])[0])
    assert max(predicted.staleness) == 0 and predicted.gen_busy < itself.gen_busy  # eta=0: generators wait
    # shares of time: overlapped, the trainer is busy most of the async run; at eta=0 it waits for each batch
    assert itself.train_busy == pytest.approx(_trainer_busy_share(two_runs[1]), abs=0.1)
    assert predicted.train_busy == pytest.approx(_trainer_busy_share(two_runs[0]), abs=0.1)
    # the order and the size of the async gain: the model's ratio comes from one calibration, so the host's speed
    # cancels in it; the runs' spans two sittings, hence a factor: eight quiet pairs of runs parted by -19% to
    # +13% (docs/emulation.md), a pair at load 16 by -19%
    ran_ratio = measured["consumed_tokens_per_s"] / trained_span_tokens_per_s(two_runs[0])
    model_ratio = itself.consumed_tokens_per_s / predicted.consumed_tokens_per_s
    assert 1 / 1.5 < model_ratio / ran_ratio < 1.5, (model_ratio, ran_ratio)
