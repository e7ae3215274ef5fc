"""Launchers over one run dir: local mpirun, the sbatch script, submitit jobs and job-array sweeps."""
