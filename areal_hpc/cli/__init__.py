"""The `areal-hpc` command line: configs, local runs, Slurm render/submit/sweep/status, evaluation, analysis."""

from areal_hpc.cli.main import main

__all__ = ["main"]
