"""A torch trainer's weights and files: what it publishes, its checkpoints (model or adapter, optimizer, RNG,
version) and its Hugging Face export."""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from areal_hpc.engines import lora as lora_lib
from areal_hpc.engines.reference import ReferencePolicy
from areal_hpc.model import load_tokenizer, no_hf_progress_bars
from areal_hpc.rundir import ADAPTER_FILE, CHECKPOINT_META, TRAINER_STATE, WEIGHTS_FILE
from areal_hpc.utils import atomic_publish_dir, new_tmp_dir_beside


class TorchEngineFiles:
    """The weights and checkpoint half of TorchTrainEngine (which holds `model`, `optimizer`, `lora`, `version`,
    `objective`, `reference` and `device`); the DeepSpeed engine overrides what its shards do differently."""

    def weights(self) -> dict[str, torch.Tensor]:
        """What trainer 0 publishes: every weight, or with LoRA the adapter alone."""
        if self.lora is not None:
            return {k: v.detach() for k, v in lora_lib.adapter_params(self.model).items()}
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def base_weights(self) -> dict[str, torch.Tensor]:
        """With LoRA: the frozen base under Hugging Face names (what generators must hold too)."""
        return lora_lib.base_state(self.model)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The policy as one plain model: with LoRA, the adapter merged into the base."""
        if self.lora is not None:
            return lora_lib.merged_state(self.model, self.lora.scale)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def export_hf(self, path: Path) -> Path:
        """Atomic HF export (with LoRA: merged): save into a temp folder beside `path`, then rename."""
        tmp = new_tmp_dir_beside(Path(path))
        with no_hf_progress_bars():
            self.model.save_pretrained(tmp, state_dict=self.full_weights(), safe_serialization=True)
        load_tokenizer(self.model_path).save_pretrained(tmp)
        return atomic_publish_dir(tmp, Path(path))

    def save_checkpoint(self, path: Path) -> None:
        """Model (safetensors; with LoRA the adapter alone), optimizer, RNG and version; written to a temp dir
        and renamed."""
        tmp = new_tmp_dir_beside(Path(path))
        try:
            sd = {k: v.detach().cpu().contiguous().clone() for k, v in self.weights().items()}
            # serialised in memory, then written as plain files: a full disk then fails with OSError ENOSPC,
            # where torch.save writing to disk itself says only "unexpected pos"
            (tmp / self._weights_file).write_bytes(save_safetensors(sd))  # clones: tied weights saved twice
            state = io.BytesIO()
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                    "numpy_rng": np.random.get_state(),
                    "python_rng": random.getstate(),
                },
                state,
            )
            (tmp / TRAINER_STATE).write_bytes(state.getbuffer())
            meta = {"version": self.version} | lora_lib.checkpoint_meta(self.lora)
            (tmp / CHECKPOINT_META).write_text(json.dumps(meta))
            if self.reference is not None:
                self.reference.save(tmp)
            atomic_publish_dir(tmp, Path(path))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk leaves no half checkpoint behind
            raise

    @property
    def _weights_file(self) -> str:
        return ADAPTER_FILE if self.lora is not None else WEIGHTS_FILE

    def _load_weights(self, path: Path) -> None:
        lora_lib.check_checkpoint(path, self.lora)
        sd = load_file(str(path / self._weights_file), device=str(self.device))
        if self.lora is None:
            self.model.load_state_dict(sd, strict=True)
        else:
            lora_lib.load_adapter(self.model, sd)

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        self._load_weights(path)
        state = torch.load(path / TRAINER_STATE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])
        self.version = json.loads((path / CHECKPOINT_META).read_text())["version"]
        self._load_reference(path)

    def _load_reference(self, path: Path) -> None:
        # built from these weights, then given the checkpoint's reference (LoRA's is the base: no copy)
        if self.objective.kl_coef and self.lora is None:
            dtype = "bfloat16" if self.bf16 else "float32"
            self.reference = ReferencePolicy(self.model_path, self.weights(), dtype, self.device, self.packing)
            self.reference.load(path)
