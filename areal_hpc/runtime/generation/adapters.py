"""A generator's side of LoRA: receive buffers for the adapter, the base weights checked once, adapters merged."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areal_hpc.engines import GenerationEngine
from areal_hpc.engines.lora import AdapterMerger, LoraSpec, adapter_shapes
from areal_hpc.model import DTYPES, load_causal_lm
from areal_hpc.rundir import RunDir


class BaseMismatch(ValueError):
    """A generator holds other base weights than the trainers: every merged adapter would be wrong."""


class AdapterLoader:
    """Turns each published adapter into the full weights of the adapted layers, for `engine.update_weights`.

    At the first adapter it reads trainer 0's contract (RunDir.lora_contract): loads the base folder into the
    engine if it is not the one the engine started from (a warm-started base), checks that the engine's
    weights have the trainers' base checksum (BaseMismatch, one line, if not), and keeps the adapted layers'
    base weights for merging. The engine then decodes plain matrices: no LoRA kernel, full-weight speed.
    """

    def __init__(self, spec: LoraSpec, run_dir: RunDir, model_dir: Path, dtype: str):
        self.spec, self.run_dir, self.model_dir, self.dtype = spec, run_dir, Path(model_dir), dtype
        self.merger: AdapterMerger | None = None

    def template(self) -> dict[str, torch.Tensor]:
        """The adapter as trainer 0 publishes it (names, shapes, model.dtype): the receive buffers' layout."""
        dt = DTYPES[self.dtype]
        return {k: torch.zeros(s, dtype=dt) for k, s in adapter_shapes(self.model_dir, self.spec).items()}

    def merged(self, engine: GenerationEngine, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.merger is None:
            self.merger = self._start(engine)
        return self.merger.merged(adapter)

    def _start(self, engine: GenerationEngine) -> AdapterMerger:
        contract = json.loads(self.run_dir.lora_contract.read_text())
        base_dir = Path(contract["base_dir"])
        base = load_causal_lm(base_dir, self.dtype).state_dict()
        if base_dir.resolve() != self.model_dir.resolve():  # loaded once, the same way as any new weights
            engine.update_weights(base, engine.version)
        crc = engine.weights_checksum()
        if crc != contract["base_checksum"]:
            raise BaseMismatch(
                f"this generator's base weights (checksum {crc}) differ from the trainers' "
                f"({contract['base_checksum']}, {base_dir}); both must load the same model folder and model.dtype"
            )
        # the adapted layers' base weights, kept to merge each adapter into (the engine may hold no copy: vLLM)
        return AdapterMerger(base, contract["layers"], contract["alpha"] / contract["rank"])
