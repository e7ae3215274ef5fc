"""Trainer 0 and each vLLM generator's workers in a group of their own: the weights go straight to every worker."""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist

from areal_hpc.config import Config
from areal_hpc.runtime.build import lora_spec
from areal_hpc.runtime.comm.weight_sync import BucketPlan, SyncGroup


def direct_transfer(cfg: Config) -> bool:
    """The run's vLLM workers receive trainer 0's weights themselves. Not with LoRA: the adapter comes to the
    generator rank, which merges it into the base weights and loads those (docs/lora.md)."""
    return cfg.rollout.engine == "vllm" and lora_spec(cfg) is None


def posted_key(version: int) -> str:
    """The store key trainer 0 sets once `version` is posted on every group."""
    return f"vllm_transfer/posted/{version}"


def ready_key(generator_index: int, version: int) -> str:
    """The store key a generator sets as its workers start to receive `version`."""
    return f"vllm_transfer/{generator_index}/ready/{version}"


def group_name(generator_index: int) -> str:
    """The store prefix of generator `generator_index`'s group (its rank in the SyncGroup, from 1)."""
    return f"vllm_transfer/{generator_index}"


def nccl_port_key(generator_index: int) -> str:
    """The store key where trainer 0 puts the port of generator `generator_index`'s NCCL group (GPUs)."""
    return f"vllm_transfer/{generator_index}/nccl_port"


def transfer_backend(device: str) -> str:
    """The group trainer 0 opens with each generator's workers: NCCL on GPUs (vLLM's nccl engine receives), gloo on
    CPU (vllm_transfer.GlooTransferEngine). vllm_transfer.backend_for is the generators' side of this rule."""
    return "nccl" if device == "cuda" else "gloo"


class _Handshake:
    """What every transfer group does over the SyncGroup's store: say a version is posted, wait for the generators
    to start receiving it, name them in an error."""

    device = "cpu"  # where the buffers sent from live

    def __init__(self, sync: SyncGroup, timeout_s: float):
        self.store, self.timeout = sync.store, datetime.timedelta(seconds=timeout_s)
        self.ranks = list(range(1, sync.size))  # the generators' ranks in the SyncGroup

    @property
    def peers(self) -> str:
        return f"the vLLM workers of generators {self.ranks} (sync group ranks)"

    def posted(self, version: int) -> None:
        """Tell the generators `version` is on the wire: a generator starts its receive only then, so its receive
        limit never counts trainer 0's wait for another generator (the previous publish must complete first)."""
        self.store.set(posted_key(version), "1")

    def wait_ready(self, version: int) -> None:
        """Until every generator has started to receive `version` (a drain may take minutes; it has the collective
        timeout, not the sync limit, which then counts the transfer alone)."""
        self.store.wait([ready_key(g, version) for g in self.ranks], self.timeout)


class TransferGroups(_Handshake):
    """Trainer 0's side of vLLM's weight transfer on CPU (vllm_transfer.GlooTransferEngine is the other side).

    One gloo group per generator: rank 0 is trainer 0, ranks 1..N the generator's N tensor-parallel workers, each
    receiving every bucket and loading the part it holds. A group per generator, not one for all: a generator that
    waits to load (rollout.weight_update=drain) holds up no other generator. Built once after the SyncGroup's layout
    check, over the SyncGroup's store; each constructor returns when that generator's workers have joined.
    """

    def __init__(self, sync: SyncGroup, devices_per_generator: int, timeout_s: float):
        super().__init__(sync, timeout_s)
        self.groups = [
            dist.ProcessGroupGloo(
                dist.PrefixStore(group_name(g), sync.store), 0, 1 + devices_per_generator, self.timeout
            )
            for g in self.ranks
        ]

    def post(self, plan: BucketPlan) -> list:
        """Every bucket posted on every generator's group; gloo's threads move each."""
        return [pg.broadcast(buf, 0) for buf in plan.buffers for pg in self.groups]

    def close(self) -> None:
        for pg in self.groups:
            try:
                pg.shutdown()
            except Exception:  # best effort at exit
                pass


class NcclTransferGroups(_Handshake):
    """Trainer 0's side of vLLM's nccl engine (GPUs): one NCCL group per generator, opened with vLLM's own trainer
    endpoint (rank 0; the generator's workers are ranks 1..N), on a port trainer 0 picks and hands over through the
    store. Each version goes out tensor by tensor from trainer 0's GPU buckets, as vLLM's unpacked receive expects,
    on a CUDA stream per generator: a generator that waits to load holds up no other. Not run on this project's
    CPU-only CI (docs/cluster.md lists what has run on GPUs)."""

    device = "cuda"

    def __init__(self, sync: SyncGroup, devices_per_generator: int, timeout_s: float):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        super().__init__(sync, timeout_s)
        self.comms, self.streams = [], []
        for g in self.ranks:  # in turn: generator g's workers wait in connect() for their port, then join
            port = _free_port()
            self.store.set(nccl_port_key(g), str(port))
            info = {"master_address": sync.store.host, "master_port": port, "world_size": 1 + devices_per_generator}
            self.comms.append(trainer_init(info))
            self.streams.append(torch.cuda.Stream())

    def post(self, plan: BucketPlan) -> list:
        """Every tensor broadcast to every generator's group on that group's stream, after what filled the buckets."""
        works = []
        for comm, stream in zip(self.comms, self.streams, strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            for t in plan.tensors():
                comm.broadcast(t, src=0, stream=stream)
            works.append(_StreamWork(stream))
        return works

    def close(self) -> None:
        for comm in self.comms:
            try:
                comm.destroy()
            except Exception:  # best effort at exit
                pass


class _StreamWork:
    """A CUDA stream's queued broadcasts as a Work: `wait(timeout)` polls, as NCCL's own calls have no timeout."""

    def __init__(self, stream):
        self.done = torch.cuda.Event()
        self.done.record(stream)

    def wait(self, timeout: datetime.timedelta) -> None:
        deadline = time.time() + timeout.total_seconds()
        while not self.done.query():
            if time.time() > deadline:
                raise RuntimeError("NCCL broadcast timed out")
            time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def update_fields(plan: BucketPlan, backend: str) -> dict:
    """What every update of this run tells a generator's workers beyond the version: for vLLM's nccl engine each
    tensor trainer 0 broadcasts, in order (names, dtype names, shapes); gloo's workers took the buckets at init."""
    if backend != "nccl":
        return {}
    dtype = [str(s.dtype).removeprefix("torch.") for s in plan.slots]
    return {"names": [s.name for s in plan.slots], "dtype_names": dtype, "shapes": [list(s.shape) for s in plan.slots]}


def worker_init_info(
    sync: SyncGroup, plan: BucketPlan, devices_per_generator: int, timeout_s: float, backend: str = "gloo"
) -> dict:
    """What a generator hands its vLLM workers (`init_weight_transfer_engine`) to join trainer 0's group for it. For
    NCCL this waits for trainer 0 to open that group's port (NcclTransferGroups)."""
    if backend == "nccl":
        port = int(sync.store.get(nccl_port_key(sync.rank)))
        # rank_offset 1: trainer 0 is rank 0; unpacked: one broadcast per tensor, as NcclTransferGroups sends
        return {
            "master_address": sync.store.host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 1 + devices_per_generator,
            "packed": False,
        }
    return {
        "master_address": sync.store.host,
        "master_port": sync.store.port,
        "group": group_name(sync.rank),
        "world_size": 1 + devices_per_generator,
        "buckets": plan.buckets(),
        "timeout_s": timeout_s,
    }
