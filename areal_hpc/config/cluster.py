"""Where a run runs, as config sections: its ranks and devices, its Slurm job, and the emulated cluster."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterConfig:
    """The ranks: how many generators and trainers, their threads and device, and when a rank counts as hung."""

    n_generators: int = 1  # generator ranks
    # devices per generator: one vLLM engine over this many devices, tensor parallel (GPUs of one node on cuda;
    # worker processes on cpu). rollout.engine=vllm (or emulated, which models it); the model's attention
    # heads must divide by it
    devices_per_generator: int = 1
    n_trainers: int = 1  # trainer ranks, data parallel (one GPU each on cuda)
    # torch CPU threads per rank (torch.set_num_threads); under Slurm give each rank as many CPUs
    # (slurm.cpus_per_task)
    threads_per_rank: int = 1
    # a rank that sends rank 0 nothing for this long is hung (stopped, or deadlocked outside its loop):
    # the run ends with one line naming it, and the job script restarts it. Longer than any one step
    # of work (a PPO version, a weight load); 0: off
    hang_timeout_s: float = 600.0
    device: str = "cpu"  # cpu | cuda
    mpirun: str = "mpirun"  # local launcher: the mpirun binary
    # local runs on one host: generators on half its cores, the scheduler, trainers and reward workers on
    # the other half, as generation has its own GPUs on a cluster (benchmarks). Off: every rank may run on
    # every core. Under Slurm srun binds each component's ranks, and this is ignored
    pin_roles: bool = False


@dataclass
class SlurmConfig:
    """How `areal-hpc render` / `submit` ask Slurm for the heterogeneous job (training + generation)."""

    partition: str = ""  # partition the job runs in (--partition; "" = the cluster's default)
    account: str = ""  # account the job is charged to (--account; "" = your default)
    qos: str = ""  # quality of service (--qos; "" = the account's default)
    time: str = "01:00:00"  # time limit per start of the job (--time): minutes, M:S, H:M:S or D-H[:M[:S]]
    constraint: str = ""  # node features the job needs (--constraint, e.g. h100; "" = any node)
    train_nodes: int = 1  # nodes of component 0: the scheduler (rank 0) and the trainers
    gen_nodes: int = 1  # nodes of component 1: the generators
    gpus_per_node: int = 0  # GPUs per node in both components (--gpus-per-node; 0 = none)
    cpus_per_task: int = 1  # CPUs per rank (--cpus-per-task; one task per rank): at least cluster.threads_per_rank
    mem: str = ""  # memory per node (--mem, e.g. 64G; "" = the partition's default)
    # seconds before the time limit at which Slurm sends USR1 (with slurm.requeue): rank 0 checkpoints, every
    # rank stops, the job requeues. It must cover the version in flight and a checkpoint: render checks it
    # against the simulator for GPU configs, and rank 0 warns when a run measures more
    signal_s: int = 120
    # true: the rendered job asks for --requeue and the slurm.signal_s warning, so at its time limit or on
    # preemption it goes back in the queue and resumes from the newest checkpoint; false: it ends there.
    # `submit` (submitit) always requeues
    requeue: bool = True
    mpi: str = "pmix"  # srun --mpi=: pmix (Open MPI's usual launch under Slurm) | pmi2
    # a world that dies (a rank killed, hung, crashed) is started again from the newest complete
    # checkpoint inside the same allocation, this many times, before the job fails
    max_restarts: int = 2
    # virtual environment the job activates on every node (a folder with bin/activate; "" = the one running
    # areal-hpc render / submit, or none outside a venv)
    venv: str = ""
    setup: list[str] = field(default_factory=list)  # shell lines the job runs before starting the ranks (module load)
    # more sbatch options, each repeated for both components: "--key=value" or a flag, e.g. "--exclusive"
    extra_sbatch: list[str] = field(default_factory=list)


@dataclass
class EmulationConfig:
    """rollout.engine=emulated / trainer.engine=emulated: compute replaced by a cost model (docs/emulation.md)."""

    preset: str = "1.5B"  # cost model: 1.5B | 7B (DeepSeek-R1-Distill-Qwen shapes on an H800)
    cost: dict[str, float] = field(default_factory=dict)  # cost-model fields replaced (e.g. a calibration's fit)
    time_scale: float = 1.0  # wall seconds per modelled second (0.1 runs ten times faster than the GPUs would)
    len_median: float = 0.0  # median response length in tokens (0 = rollout.max_new_tokens / 4), log-normal
    len_sigma: float = 1.0  # spread of log length: 1.0 gives a long tail, capped at rollout.max_new_tokens
    payload_mb: float = 1.0  # bytes really broadcast per version; the cost model's sync_s stands for the rest
    p_correct: float = 0.5  # mean chance an emulated answer is rewarded (each prompt gets its own difficulty)
