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
