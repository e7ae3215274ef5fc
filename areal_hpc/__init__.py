"""areal-hpc: Slurm-native, fully asynchronous RL for LLM reasoning (an open implementation of AReaL)."""


def sweep(*args, **kwargs):
    """Submit a config grid as a Slurm job array; see areal_hpc.launch.sweep.sweep."""
    from areal_hpc.launch.sweep import sweep as _sweep

    return _sweep(*args, **kwargs)


def collect(sweep_dir):
    """One row per sweep point (parameters, status, throughput, accuracy, wall time)."""
    from areal_hpc.launch.sweep import collect as _collect

    return _collect(sweep_dir)
