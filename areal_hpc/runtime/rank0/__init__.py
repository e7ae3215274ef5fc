"""Rank 0: the scheduler, its pure core and phases, the prompt count, resume from a checkpoint."""
