"""Rank 0's account of the run: per-version rows, run totals, metrics and trackers, throughput, signal."""
