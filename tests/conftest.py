"""Shared fixtures: a tiny model folder built once per session (no hub is reachable)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(2)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from areal_hpc.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    from areal_hpc.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def ppo_batch(tiny_model_dir):
    """16 sampled trajectories (4 groups of 4) with mixed rewards and spread advantages, for PPO steps."""
    import numpy as np
    from request_helpers import group_requests, output_trajectory

    from areal_hpc.engines.base import generate
    from areal_hpc.engines.torch_gen import TorchGenerationEngine
    from areal_hpc.model import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    gen = TorchGenerationEngine(str(tiny_model_dir), seed=3)
    reqs = [
        r
        for g, q in enumerate(["03+04=", "11+09=", "05+05=", "19+01="])
        for r in group_requests(tok.encode(q), g, 4, 6)
    ]
    trajs = [output_trajectory(o, 0, float(i % 3 == 0), gen_rank=1) for i, o in enumerate(generate(gen, reqs))]
    return trajs, np.linspace(-1, 1, len(trajs)).astype(np.float32)
