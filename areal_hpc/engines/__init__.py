"""Generation and training engines behind small interfaces, selected by name from the config."""

from areal_hpc.engines.base import GenerationEngine, TrainEngine


def make_generation_engine(name: str, **kwargs) -> GenerationEngine:
    if name == "torch":
        from areal_hpc.engines.torch_gen import TorchGenerationEngine

        return TorchGenerationEngine(**kwargs)
    raise ValueError(f"generation engine {name!r} is not available; choose 'torch'")


def make_train_engine(name: str, **kwargs) -> TrainEngine:
    deepspeed_only = {k: kwargs.pop(k) for k in ("zero_stage", "bf16", "device") if k in kwargs}
    if name == "torch":
        from areal_hpc.engines.torch_train import TorchTrainEngine

        return TorchTrainEngine(**kwargs)
    if name == "deepspeed":
        from areal_hpc.engines.deepspeed_train import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(**kwargs, **deepspeed_only)
    raise ValueError(f"training engine {name!r} is not available; choose 'torch' or 'deepspeed'")


__all__ = ["GenerationEngine", "TrainEngine", "make_generation_engine", "make_train_engine"]
