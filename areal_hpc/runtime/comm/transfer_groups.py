"""Trainer 0 and each vLLM generator's workers in a group of their own: the weights go straight to every worker."""

from __future__ import annotations

import datetime

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


class TransferGroups:
    """Trainer 0's side of vLLM's weight transfer on CPU (vllm_transfer.GlooTransferEngine is the other side).

    One gloo group per generator: rank 0 is trainer 0, ranks 1..N the generator's N tensor-parallel workers, each
    receiving every bucket and loading the part it holds. A group per generator, not one for all: a generator that
    waits to load (rollout.weight_update=drain) holds up no other generator. Built once after the SyncGroup's layout
    check, over the SyncGroup's store; each constructor returns when that generator's workers have joined.
    """

    def __init__(self, sync: SyncGroup, devices_per_generator: int, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store, self.timeout = sync.store, timeout
        self.ranks = list(range(1, sync.size))  # the generators' ranks in the SyncGroup
        self.groups = [
            dist.ProcessGroupGloo(dist.PrefixStore(group_name(g), sync.store), 0, 1 + devices_per_generator, timeout)
            for g in self.ranks
        ]

    def post(self, tensor: torch.Tensor) -> list:
        """The broadcast posted on every generator's group; gloo's threads move each."""
        return [pg.broadcast(tensor, 0) for pg in self.groups]

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

    def close(self) -> None:
        for pg in self.groups:
            try:
                pg.shutdown()
            except Exception:  # best effort at exit
                pass


def worker_init_info(sync: SyncGroup, plan: BucketPlan, devices_per_generator: int, timeout_s: float) -> dict:
    """What a generator hands its vLLM workers (`init_weight_transfer_engine`) to join trainer 0's group for it."""
    return {
        "master_address": sync.store.host,
        "master_port": sync.store.port,
        "group": group_name(sync.rank),
        "world_size": 1 + devices_per_generator,
        "buckets": plan.buckets(),
        "timeout_s": timeout_s,
    }
