"""Training engine on DeepSpeed ZeRO (stage 1/2/3): the same decoupled-PPO step as the torch engine."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from areal_hpc.engines import forward
from areal_hpc.engines import lora as lora_lib
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_tokenizer, no_hf_progress_bars
from areal_hpc.rundir import ADAPTER_FILE, CHECKPOINT_META, DEEPSPEED_TAG, rng_file, shared_temporary
from areal_hpc.utils import atomic_publish_dir, new_tmp_dir_beside


def _ensure_process_group(backend: str) -> None:
    """DeepSpeed needs a default group; a lone trainer gets a world of one (no MPI discovery)."""
    if dist.is_initialized():
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    # DeepSpeed asserts LOCAL_RANK is set, and equal to Open MPI's when under mpirun
    os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))


class DeepSpeedTrainEngine(TorchTrainEngine):
    """ZeRO-sharded data parallelism over the trainers' default group (gloo on CPU, NCCL on GPUs).

    The loss is normalised by the global token count, so gradients must be summed across trainers;
    DeepSpeed averages them, hence the loss is scaled by the world size. Every trainer runs the same
    number of micro-batches (ZeRO-3 gathers parameters inside each forward), and for ZeRO-3 gathering
    the full weights and checkpointing are collective: every trainer calls them.
    """

    lockstep = True
    collective_checkpoint = True

    def __init__(self, model_path: str, zero_stage: int = 2, bf16: bool = False, device: str = "cpu", **kwargs):
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device == "cpu" else "cuda")
        try:
            import deepspeed
        except ImportError:
            raise ImportError(
                "trainer.engine=deepspeed needs DeepSpeed: pip install deepspeed==0.19.8 "
                "(CPU: bash env/setup.sh installs it)"
            ) from None
        _ensure_process_group("gloo" if device == "cpu" else "nccl")
        super().__init__(model_path, device="cpu", **kwargs)  # deepspeed.initialize places the model
        self.autocast = False  # with bf16, DeepSpeed keeps fp32 master weights and runs the module in bf16
        self.bf16 = bool(bf16)  # the compute precision, which the frozen models (reference, teacher) are held in
        self.zero_stage = zero_stage
        self.collective_weights = zero_stage == 3
        if zero_stage == 3:  # every call of the head gathers its parameters: all ranks make as many
            self.fixed_chunks = -(-self.batching.max_tokens // self.logprob_chunk_tokens)
        config = {
            "train_micro_batch_size_per_gpu": 1,  # micro-batches are packed by token budget here
            "gradient_accumulation_steps": 1,  # accumulation boundaries are set explicitly per minibatch
            "gradient_clipping": self.grad_clip if self.grad_clip > 0 else 0.0,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": bool(bf16)},
            "zero_allow_untested_optimizer": True,  # a torch AdamW: no compiled optimizer op needed
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=self.optimizer, config=config)
        if self.packing:  # chosen again for the device DeepSpeed placed the model on, in its precision
            device = torch.device(self.ds.device)
            forward.use_packed_attention(self.model, device, half=bf16, trees=self.batching.trees)
        self._deepspeed = deepspeed
        self._fwd = self.ds
        self.device = self.batching.device = self.ds.device
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()

    # -- hooks of the torch engine ----------------------------------------------------------------
    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(last)
        self.ds.backward(loss * self.world)  # DeepSpeed averages over ranks; the loss wants a sum

    def _optimizer_step(self) -> float:
        self.ds.step()
        gnorm = self.ds.get_global_grad_norm()
        return float(gnorm) if gnorm is not None else float("nan")

    def _head_path(self) -> dict:
        if self.zero_stage != 3 or self.lora is None:
            return super()._head_path()
        # LoRA under ZeRO-3: the frozen head needs no gradient, so it is gathered once per micro-batch and the loss
        # takes the fused path (its gradient made in the forward). A checkpointed head call would find the frozen
        # weight released again when it is recomputed in backward.
        head = self.model.get_output_embeddings()
        return {"n_chunks": None, "head_weight": lambda: self._gathered([head.weight])}

    # -- weights and checkpoints --------------------------------------------------------------------
    def _gathered(self, params: list) -> contextlib.AbstractContextManager:
        """Under ZeRO-3 full tensors exist only inside a gather, which every trainer joins (collective)."""
        if self.zero_stage == 3:
            return self._deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return contextlib.nullcontext()

    def _copied(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ZeRO-3: copies out of the gather, a tied tensor copied once so its names stay one tensor (sent once)."""
        if self.zero_stage != 3:
            return state
        copies: dict[int, torch.Tensor] = {}
        for v in state.values():
            if v.data_ptr() not in copies:
                copies[v.data_ptr()] = v.detach().clone()
        return {k: copies[v.data_ptr()] for k, v in state.items()}

    def weights(self) -> dict[str, torch.Tensor]:
        adapter = list(lora_lib.adapter_params(self.model).values()) if self.lora is not None else None
        with self._gathered(adapter or list(self.model.parameters())):
            return self._copied(super().weights())

    def base_weights(self) -> dict[str, torch.Tensor]:
        with self._gathered(list(self.model.parameters())):
            return self._copied(super().base_weights())

    def full_weights(self) -> dict[str, torch.Tensor]:
        with self._gathered(list(self.model.parameters())):
            return self._copied(super().full_weights())

    def export_hf(self, path: Path) -> Path:
        """Collective under ZeRO-3 (the weights are gathered); trainer 0 writes the folder, atomically."""
        sd = {k: v.cpu() for k, v in self.full_weights().items()}
        path = Path(path)
        if self.rank == 0:
            tmp = new_tmp_dir_beside(path)
            with no_hf_progress_bars():
                self.model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
            load_tokenizer(self.model_path).save_pretrained(tmp)
            atomic_publish_dir(tmp, path)
        dist.barrier()
        return path

    def save_checkpoint(self, path: Path) -> None:
        """Collective: every trainer writes its shard into one folder, published by an atomic rename."""
        path = Path(path)
        tmp = shared_temporary(path)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        # with LoRA the frozen base stays out of the shards (it is the run's base model folder)
        self.ds.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, exclude_frozen_parameters=self.lora is not None)
        adapter = self.weights() if self.lora is not None else None  # collective under ZeRO-3
        if adapter is not None and self.rank == 0:  # the adapter alone, for export and eval
            save_file({k: v.cpu().contiguous() for k, v in adapter.items()}, str(tmp / ADAPTER_FILE))
        rng = {"torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(), "python_rng": random.getstate()}
        torch.save(rng, tmp / rng_file(self.rank))
        dist.barrier()
        if self.rank == 0:
            meta = {
                "version": self.version,
                "zero_stage": self.zero_stage,
                "world": self.world,
            } | lora_lib.checkpoint_meta(self.lora)
            (tmp / CHECKPOINT_META).write_text(json.dumps(meta))
            if self.reference is not None:
                self.reference.save(tmp)
            atomic_publish_dir(tmp, path)
        dist.barrier()

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        meta = json.loads((path / CHECKPOINT_META).read_text())
        lora_lib.check_checkpoint(path, self.lora)
        self.ds.load_checkpoint(str(path), tag=DEEPSPEED_TAG, load_module_strict=self.lora is None)
        rng = torch.load(path / rng_file(self.rank), weights_only=False)
        torch.set_rng_state(rng["torch_rng"])
        np.random.set_state(rng["numpy_rng"])
        random.setstate(rng["python_rng"])
        self.version = meta["version"]
        self._load_reference(path)
