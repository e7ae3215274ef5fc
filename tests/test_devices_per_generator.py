"""A generator over N devices (cluster.devices_per_generator, tensor parallel) counts N devices: the config
check, the rendered job and render's checks, the submitit step, the cost model, the simulator's GPUs, the
local launcher's core split and the GPUs a rank takes."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load_config
from areal_hpc.costmodel import PRESETS, SHAPES, TP_EFFICIENCY, RunSettings, for_run, settings_of, tensor_parallel
from areal_hpc.launch.local import crowded_generation
from areal_hpc.launch.sizing import gpu_problems
from areal_hpc.launch.slurm import PartitionInfo, render_sbatch, request_problems
from areal_hpc.launch.submit import srun_command
from areal_hpc.simulate import sim_config, simulate

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"
GPU = ROOT / "jobs" / "math_1p5b_gpu.yaml"  # 24 generators on 3 nodes of 8 GPUs, 8 trainers
EMULATED = ROOT / "jobs" / "emulated_1p5b.yaml"


def _gpu(tmp_path, *overrides):
    where = [f"model.path={tmp_path / 'm'}", f"data.path={tmp_path / 'd.jsonl'}", f"store.run_dir={tmp_path / 'r'}"]
    return load_config(GPU, [*where, *overrides])


def test_more_than_one_device_needs_an_engine_that_splits_one():
    with pytest.raises(ConfigError, match=r"devices_per_generator=2 needs rollout.engine=vllm \(or emulated\); got"):
        load_config(DEMO, ["cluster.devices_per_generator=2"])  # the demo's torch engine
    with pytest.raises(ConfigError, match="cluster.devices_per_generator=0 is out of range"):
        load_config(DEMO, ["cluster.devices_per_generator=0", "rollout.engine=vllm"])
    for engine in ("vllm", "emulated"):
        both = [f"rollout.engine={engine}", f"trainer.engine={'emulated' if engine == 'emulated' else 'torch'}"]
        assert load_config(DEMO, ["cluster.devices_per_generator=2", *both]).cluster.devices_per_generator == 2


def test_the_rendered_job_gives_each_generator_cpus_for_its_workers_and_gpus_by_the_node(tmp_path):
    one = render_sbatch(_gpu(tmp_path))
    two = render_sbatch(_gpu(tmp_path, "cluster.n_generators=12", "cluster.devices_per_generator=2"))
    train, gen = two.split("#SBATCH hetjob")
    assert "#SBATCH --cpus-per-task=6\n#SBATCH --gpus-per-node=8" in train  # trainers: as with one device
    assert "#SBATCH --ntasks=12\n#SBATCH --cpus-per-task=12\n#SBATCH --gpus-per-node=8" in gen
    assert "generator k of a node drives its GPUs k x 2 to k x 2 + 1" in gen
    assert "each one vLLM engine\n#                             over 2 GPUs of its node (tensor parallel)" in train
    # one device: the script as before (no word of tensor parallelism, the same CPUs per task)
    assert "tensor parallel" not in one and one.count("--cpus-per-task=6") == 2
    cpu = render_sbatch(load_config(DEMO, ["cluster.devices_per_generator=2", "rollout.engine=vllm"]))
    assert "over 2 worker processes (tensor parallel)" in cpu and "GPUs k x" not in cpu
    assert cpu.split("#SBATCH hetjob")[1].count("--cpus-per-task=2") == 1


def test_render_refuses_generators_whose_gpus_do_not_fit_or_span_nodes(tmp_path):
    assert gpu_problems(_gpu(tmp_path, "cluster.n_generators=12", "cluster.devices_per_generator=2")) == []
    span = gpu_problems(_gpu(tmp_path, "cluster.n_generators=3", "cluster.devices_per_generator=16"))
    assert span == [
        "cluster.devices_per_generator=16 but slurm.gpus_per_node=8: a generator's GPUs would span nodes; use "
        "nodes with 16 GPUs or fewer devices per generator"
    ]
    (full,) = gpu_problems(_gpu(tmp_path, "cluster.devices_per_generator=2"))  # 24 x 2 on 3 x 8
    assert full.startswith("cluster.n_generators=24 x cluster.devices_per_generator=2 need 48 GPUs but ")
    assert "slurm.gen_nodes=3 x slurm.gpus_per_node=8 hold 24" in full
    # the total fits (3 x 4 on 2 x 6), but block distribution puts two generators, 8 GPUs, on the first node
    shape = ["cluster.n_generators=3", "cluster.devices_per_generator=4", "slurm.gen_nodes=2", "slurm.gpus_per_node=6"]
    (uneven,) = gpu_problems(_gpu(tmp_path, *shape, "cluster.n_trainers=5"))
    assert "cluster.n_generators=3 x cluster.devices_per_generator=4 on slurm.gen_nodes=2 puts 2 GPU ranks" in uneven
    # one device each: the message it always gave
    (one,) = gpu_problems(_gpu(tmp_path, "cluster.n_generators=25"))
    assert one.startswith("cluster.n_generators=25 on slurm.gen_nodes=3 puts 9 GPU ranks on a node")
    assert gpu_problems(_gpu(tmp_path, "cluster.device=cpu", "cluster.devices_per_generator=16")) == []


def test_the_cluster_check_counts_a_generators_cpus_for_each_device(monkeypatch, tmp_path):
    here = {socket.gethostname(), os.uname().nodename}
    monkeypatch.setattr("areal_hpc.launch.slurm.partition_info", lambda _: PartitionInfo("p", 4, 8, 0, here))
    shape = ["cluster.devices_per_generator=4", "rollout.engine=vllm", "cluster.n_generators=3"]
    cfg = load_config(DEMO, [*shape, f"store.run_dir={tmp_path}"])
    lines = [p for p in request_problems(cfg)[1] if "component needs" in p]
    assert lines == [
        "the generation component needs 3 tasks x slurm.cpus_per_task=1 x cluster.devices_per_generator=4 CPUs "
        "but 1 node(s) of 'p' (8 CPUs each) fit 2 such tasks"
    ]
    cfg.cluster.n_generators = 2
    assert not [p for p in request_problems(cfg)[1] if "component needs" in p]
    # one allocation for every rank (a sweep's point): each of the 4 tasks as large as a generator's, 4 x 4 > 2 x 8
    cfg.cluster.n_generators = 3
    (job,) = [p for p in request_problems(cfg, het=False)[1] if "component needs" in p]
    assert job.startswith("the job component needs 5 tasks x slurm.cpus_per_task=1 x cluster.devices_per_generator=4")


def test_the_submitit_step_gives_generators_cpus_for_each_device(tmp_path):
    cfg = load_config(DEMO, ["cluster.devices_per_generator=2", "rollout.engine=vllm", "slurm.cpus_per_task=3"])
    cmd = srun_command(cfg, tmp_path, python="python")
    train, gen = " ".join(cmd).split(" : ")
    assert "--cpus-per-task=3 " in train and "--cpus-per-task=6 " in gen
    assert "--cpus-per-task=6 " in " ".join(srun_command(cfg, tmp_path, het=False, python="python"))


def test_a_generator_over_n_devices_steps_faster_by_the_stated_efficiency():
    cost = PRESETS["7B"]
    assert tensor_parallel(cost, 1) is cost
    tp2 = tensor_parallel(cost, 2)
    work = cost.decode_step_s(1, 0) - cost.step_overhead_s
    assert tp2.decode_step_s(1, 0) - tp2.step_overhead_s == pytest.approx(work / (2 * TP_EFFICIENCY))
    assert tp2.prefill_s(1000) == pytest.approx(cost.prefill_s(1000) / (2 * TP_EFFICIENCY))
    assert (tp2.sync_s, tp2.train_tokens_per_s, tp2.step_overhead_s) == (
        cost.sync_s,
        cost.train_tokens_per_s,
        cost.step_overhead_s,
    )
    assert for_run(cost, SHAPES["7B"], RunSettings(gen_devices=2)) == for_run(tp2, SHAPES["7B"], RunSettings())
    cfg = load_config(EMULATED, ["cluster.devices_per_generator=2"])
    assert settings_of(cfg).gen_devices == 2


def test_the_simulator_counts_each_generators_devices_and_their_speed():
    cfg = load_config(EMULATED, ["trainer.versions=3", "rollout.max_new_tokens=2048", "cluster.n_generators=4"])
    one = sim_config(cfg)
    cfg.cluster.devices_per_generator = 2
    two = sim_config(cfg)
    assert (one.gpus, two.gpus) == (4 + 5, 4 * 2 + 5)
    r1, r2 = simulate(one), simulate(two)
    assert (r1.gpus, r2.gpus) == (9, 13) and r2.row()["gpus"] == 13
    assert r2.gen_tokens_per_s > r1.gen_tokens_per_s  # 4 generators, twice the devices: faster generation
    assert r2.consumed_tokens_per_gpu_s == pytest.approx(r2.consumed_tokens_per_s / 13)


def test_pinned_roles_warn_when_a_generators_workers_crowd_its_cores():
    cfg = load_config(DEMO, ["cluster.devices_per_generator=2", "rollout.engine=vllm", "cluster.pin_roles=true"])
    cfg.cluster.n_generators = 1
    assert "gives generation 1 of 2 cores" in crowded_generation(cfg, 2)
    assert crowded_generation(cfg, 8) is None  # 4 cores for 2 workers of 1 thread
    cfg.cluster.pin_roles = False
    assert crowded_generation(cfg, 2) is None  # nothing pinned: nothing changes
    cfg.cluster.pin_roles, cfg.cluster.devices_per_generator = True, 1
    assert crowded_generation(cfg, 2) is None


def test_a_generator_rank_takes_its_n_gpus_of_the_node_by_local_rank(monkeypatch):
    from areal_hpc.runtime.worker import _pin_gpus

    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(key, "")
    seen = {}
    for local, count in ((0, 1), (3, 1), (1, 2), (2, 2), (1, 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", str(local))
        _pin_gpus(count)
        seen[local, count] = os.environ["CUDA_VISIBLE_DEVICES"]
    assert seen == {(0, 1): "0", (3, 1): "3", (1, 2): "2,3", (2, 2): "4,5", (1, 4): "4,5,6,7"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="needs GPUs 2 to 3 but this node shows 3"):
        _pin_gpus(2)
