"""Algorithm core: pure torch/python functions with no I/O (loss, advantages, packing, staleness)."""
