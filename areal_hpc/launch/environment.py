"""The environment every launch gives the MPI ranks (mpirun here, srun under Slurm, the sbatch script)."""

from __future__ import annotations

import os

# Why each: no cross-memory attach in many containers (copy through shared memory instead); rank logs
# must show a line when it is printed, not when a buffer fills.
RANK_ENV = {
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "PYTHONUNBUFFERED": "1",
}
# mpirun on one host: as root (containers, CI) and with more ranks than cores.
LOCAL_MPIRUN_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def rank_env(local_mpirun: bool = False) -> dict[str, str]:
    """This process's environment plus the ranks' settings; a value the user set already wins."""
    env = dict(os.environ)
    for key, value in {**RANK_ENV, **(LOCAL_MPIRUN_ENV if local_mpirun else {})}.items():
        env.setdefault(key, value)
    return env


def slurm_job_id() -> str:
    """This job's id as squeue, sacct and scancel name it ('' outside Slurm): JOBID_TASK for a task of a job
    array, whose own SLURM_JOB_ID is a number of its own that the array's record does not know."""
    task, array = os.environ.get("SLURM_ARRAY_TASK_ID"), os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{task}" if task and array else os.environ.get("SLURM_JOB_ID", "")
