"""Analysis of run directories with pandas: loaders and comparisons (speedup, staleness, utilisation, curves, gaps).

Schemas of what the loaders return are in docs/analysis.md.
"""

from areal_hpc.analysis.runs import Run, flatten, load_run, load_runs, load_sweep, sweep_runs, varying
from areal_hpc.analysis.tables import (
    learning_curves,
    mismatch_curves,
    prefix_sharing,
    speedup_table,
    staleness_distribution,
    time_to_accuracy,
    utilisation,
)

__all__ = [
    "Run",
    "flatten",
    "learning_curves",
    "load_run",
    "load_runs",
    "load_sweep",
    "mismatch_curves",
    "prefix_sharing",
    "speedup_table",
    "staleness_distribution",
    "sweep_runs",
    "time_to_accuracy",
    "utilisation",
    "varying",
]
