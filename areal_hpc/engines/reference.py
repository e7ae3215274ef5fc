"""The KL penalty's reference policy: a frozen copy of the weights RL started from, and its chunked logprobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from areal_hpc.engines import forward
from areal_hpc.model import load_causal_lm
from areal_hpc.rundir import REFERENCE_FILE


class FrozenPolicy:
    """A model without gradients on the trainer's device, in the trainer's compute precision, and its chunked
    no-grad logprobs: the KL's reference (below) and the distillation teacher (engines/teacher.py)."""

    def __init__(
        self,
        model_path: str,
        weights: dict[str, torch.Tensor] | None,
        dtype: str,
        device,
        packing: bool,
        trees: bool = False,
    ):
        # a model of its own from the folder (then `weights`, if given): a copy of the trainer's module would
        # carry whatever DeepSpeed hung on it
        self.model = load_causal_lm(model_path, dtype).to(device).eval()
        if weights is not None:
            self.model.load_state_dict({k: v.to(self.model.dtype) for k, v in weights.items()}, strict=True)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if packing:
            # trees: the trainer's micro-batches may lay shared prefixes down once (engines/batching.py)
            forward.use_packed_attention(self.model, torch.device(device), half=dtype == "bfloat16", trees=trees)

    @torch.no_grad()
    def logprobs(self, mbs, temperature: float, chunk_tokens: int) -> list[np.ndarray]:
        """Per micro-batch (forward.MicroBatch) of sequences, each token's logprob under this model."""
        head = self.model.get_output_embeddings()
        out = []
        for mb in mbs:
            lps, _ = forward.token_logprobs(self.model, head, mb, temperature, chunk_tokens)
            out += [lp.float().cpu().numpy() for lp in lps]
        return out


class ReferencePolicy(FrozenPolicy):
    """A copy of the policy at version 0 (after the warm start), without gradients or optimizer state.

    It lives on the trainer's device, in the trainer's compute precision (bf16 under trainer.bf16, else
    fp32): that is 2 or 4 bytes per parameter more on every trainer, and one more chunked forward per
    version over the batch. It is only built when ppo.kl_coef is not 0.
    """

    def save(self, folder: Path) -> None:
        sd = {k: v.detach().cpu().contiguous().clone() for k, v in self.model.state_dict().items()}
        (Path(folder) / REFERENCE_FILE).write_bytes(save_safetensors(sd))

    def load(self, folder: Path) -> None:
        path = Path(folder) / REFERENCE_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"checkpoint {folder} has no {REFERENCE_FILE}: it was written with ppo.kl_coef=0, so the run's "
                "reference policy is lost; resume with ppo.kl_coef=0 or start a new run"
            )
        dtype = next(self.model.parameters()).dtype
        device = next(self.model.parameters()).device
        sd = {k: v.to(dtype) for k, v in load_file(str(path), device=str(device)).items()}
        self.model.load_state_dict(sd, strict=True)
