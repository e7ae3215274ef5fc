"""Launchers: local mpirun today; Slurm (sbatch templates, submitit) builds on the same run dir."""
