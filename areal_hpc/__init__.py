"""areal-hpc: Slurm-native, fully asynchronous RL for LLM reasoning."""
