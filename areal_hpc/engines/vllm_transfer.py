"""The weight-transfer engines this project registers with vLLM: each worker receives trainer 0's weights itself."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from areal_hpc.model.weights import Checksum, WeightSyncTimeout

BACKEND = "areal_gloo"
"""Its name in vLLM's factory (`WeightTransferConfig(backend=BACKEND)`). vLLM's own engines (nccl, ipc) need CUDA;
this one moves the same calls over gloo, or reads a safetensors file, so the CPU runs use vLLM's API end to end."""
NCCL_BACKEND = "areal_nccl"
"""On GPUs: vLLM's nccl engine (trainer 0 broadcasts every tensor to every worker, GPU to GPU), which also reads a
safetensors file (LoRA's merged weights, sync.method=disk) and keeps this project's checksum of what arrived."""


def backend_for(device: str) -> str:
    """The transfer engine a generator on `device` uses (transfer_groups.transfer_backend is trainer 0's rule)."""
    return NCCL_BACKEND if device == "cuda" else BACKEND


@dataclass
class TransferInit(WeightTransferInitInfo):
    """Where a generator's workers meet trainer 0: its TCPStore, the group's prefix and size, and the bucket layout
    both ends build from the same model (weight_sync.BucketPlan). No address: file updates only."""

    master_address: str = ""
    master_port: int = 0
    group: str = ""  # the store prefix of this generator's group
    world_size: int = 0  # trainer 0 (rank 0) + this generator's workers (ranks 1..N, by tensor-parallel rank)
    buckets: list = field(default_factory=list)  # per bucket: [dtype name, numel, [[name, offset, shape], ...]]
    timeout_s: float = 1800.0  # the group's collective timeout (the run's sync.timeout_s)


@dataclass
class TransferUpdate(WeightTransferUpdateInfo):
    """One version: from `path` (a safetensors file every worker reads) or, with no path, over the group."""

    version: int
    path: str = ""
    limit_s: float = 0.0  # the receive passes this many seconds: WeightSyncTimeout (0 = the group's timeout)
    checksum: bool = True  # compute the checksum of what arrived (weights_checksum over the trainer's names)
    rank: int = -1  # the generator's MPI rank, for the error line
    aliases: dict = field(default_factory=dict)  # a tied tensor's other names -> the name it travels under
    stall_s: float = 0.0  # the chaos suite's stalled update (AREAL_HPC_FAULT=stall-update@V): sleep inside it first
    # vLLM's nccl engine: every tensor sent, in order (transfer_groups.update_fields), each broadcast on its own
    names: list = field(default_factory=list)
    dtype_names: list = field(default_factory=list)
    shapes: list = field(default_factory=list)


class _Intake:
    """What both engines do with what arrives: a tied tensor's other names, the checksum, the model's own
    `load_weights` (inside vLLM's layerwise reload, started and finished by start/finish_weight_update), timing."""

    last_checksum: int | None = None
    last_receive_s = 0.0

    def _receive(self, u: TransferUpdate, chunks: Callable[[Callable], Iterator[dict] | None]) -> None:
        """`chunks(load)` yields {name: tensor} dicts to load, or calls `load(pairs)` itself (vLLM's receive)."""
        time.sleep(u.stall_s)
        t0 = time.time()
        crc = Checksum() if u.checksum else None
        load_weights = self.model.load_weights

        def load(pairs) -> None:
            named = dict(pairs)
            named |= {a: named[k] for a, k in u.aliases.items() if k in named}
            if crc is not None:
                for name, t in named.items():
                    crc.add(name, t)
            load_weights(list(named.items()))

        for named in chunks(load) or ():
            load(named.items())
        self.last_checksum = crc.value if crc is not None else None
        self.last_receive_s = time.time() - t0


def _from_file(path: str) -> Iterator[dict[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:  # one tensor at a time: the file is never in memory whole
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield {name: f.get_tensor(name)}


class GlooTransferEngine(_Intake, WeightTransferEngine[TransferInit, TransferUpdate]):
    """Lives in every vLLM worker: receives each bucket into one reused buffer and hands its tensors to the model's
    own `load_weights`, so a worker holds at most one bucket besides its (sharded) model, and the generator process
    holds nothing."""

    init_info_cls = TransferInit
    update_info_cls = TransferUpdate
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.pg = None
        self.init: TransferInit | None = None
        self.buffers: dict[str, torch.Tensor] = {}  # dtype name -> a flat buffer of its largest bucket

    def init_transfer_engine(self, init_info: TransferInit) -> None:
        self.init = init_info
        if not init_info.master_address:
            return
        from vllm.distributed import get_tensor_model_parallel_rank

        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, is_master=False, timeout=timeout)
        rank = 1 + get_tensor_model_parallel_rank()
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(init_info.group, store), rank, init_info.world_size, timeout)
        for dtype, numel, _ in init_info.buckets:
            if numel > self.buffers.get(dtype, torch.empty(0)).numel():
                self.buffers[dtype] = torch.empty(numel, dtype=getattr(torch, dtype))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which has no accelerator to wait for on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def receive_weights(self, update_info: TransferUpdate) -> None:
        u = update_info
        self._receive(u, lambda load: _from_file(u.path) if u.path else self._from_group(u))

    def _from_group(self, u: TransferUpdate) -> Iterator[dict[str, torch.Tensor]]:
        if self.pg is None:
            raise RuntimeError("weight transfer over the group before init_weight_transfer_engine gave an address")
        limit = u.limit_s or self.init.timeout_s
        deadline = time.time() + limit
        for i, (dtype, numel, slots) in enumerate(self.init.buckets):
            buf = self.buffers[dtype][:numel]
            try:
                left = datetime.timedelta(seconds=max(0.001, deadline - time.time()))
                self.pg.broadcast(buf, 0).wait(left)
            except RuntimeError as err:
                why = str(err).splitlines()[0][:120]
                where = (
                    f"version {u.version} (bucket {i + 1} of {len(self.init.buckets)}) on generator rank {u.rank}, "
                    f"worker {self.pg.rank()} of group {self.init.group!r}"
                )
                if "timed out" in why.lower():  # a stall: this limit is the failure's cause
                    raise WeightSyncTimeout(
                        f"weight sync: receive of {where} passed its limit of {limit:.0f} s ({why})"
                    ) from None
                # trainer 0 went away: the echo of its failure (gloo's words say so), which is the cause
                raise RuntimeError(f"weight sync: receive of {where} failed ({why})") from None
            yield {name: buf[off : off + _numel(shape)].view(shape) for name, off, shape in slots}

    def shutdown(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:  # best effort at exit
                pass
            self.pg = None


class NcclTransferEngine(_Intake, NCCLWeightTransferEngine):
    """vLLM's nccl engine, as it is, in every worker (GPUs): it joins trainer 0's NCCL group (rank 1 + its
    tensor-parallel rank, transfer_groups.NcclTransferGroups is rank 0) and receives each tensor by broadcast into a
    fresh GPU tensor; this class only adds a file route, the checksum of what arrived and the chaos suite's stall.
    NCCL's broadcast has no timeout here: trainer 0's send limit is what ends a stalled update."""

    update_info_cls = TransferUpdate
    supports_draft_weight_update = False

    def parse_init_info(self, init_dict: dict) -> NCCLWeightTransferInitInfo | None:
        return NCCLWeightTransferInitInfo(**init_dict) if init_dict else None  # {}: file updates only

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo | None) -> None:
        if init_info is not None:
            super().init_transfer_engine(init_info)

    def receive_weights(self, update_info: TransferUpdate) -> None:
        u = update_info

        def over_nccl(load) -> None:
            # vLLM's receive hands each tensor to model.load_weights: for this receive, that is `load`
            self.model.load_weights = load
            try:
                NCCLWeightTransferEngine.receive_weights(self, u)
            finally:
                del self.model.load_weights

        self._receive(u, lambda load: _from_file(u.path) if u.path else over_nccl(load))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def last_update(worker) -> tuple[int | None, float]:
    """Run in each worker through `collective_rpc`: the checksum of the weights its last update received, and the
    seconds the receive and load took."""
    engine = worker.weight_transfer_engine
    return engine.last_checksum, engine.last_receive_s


def register() -> None:
    """Make both backends known to vLLM's factory in this process (every worker imports this module, see
    TransferWorkerExtension)."""
    for name, engine in ((BACKEND, GlooTransferEngine), (NCCL_BACKEND, NcclTransferEngine)):
        try:
            WeightTransferEngineFactory.register_engine(name, engine)
        except ValueError:  # already registered in this process
            pass


class TransferWorkerExtension:
    """Given to vLLM as `worker_extension_cls`: each worker process imports this module before it loads the model,
    which registers BACKEND there (vLLM spawns its workers; a registration in the parent does not reach them)."""


register()
