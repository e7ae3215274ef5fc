"""Under mpirun -n 3: rank 0 sends a mixed-dtype state dict in buckets; the other ranks must get it exactly."""

import json
import sys

import torch
from mpi4py import MPI

from areal_hpc.model.weights import weights_checksum
from areal_hpc.runtime.comm.weight_sync import SyncGroup, WeightReceiver, WeightSender
from areal_hpc.runtime.worker import exit_rank


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 70, generator=g),
        "b.weight": torch.randn(1000, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(17, generator=g),
        "d.count": torch.randint(0, 1000, (33,), generator=g),
        "e.big": torch.randn(300_000, generator=g),  # 1.2 MB: bigger than a 1 MiB bucket, gets its own
    }


def main(out: str) -> None:
    comm = MPI.COMM_WORLD
    group = SyncGroup(comm, "gloo", 60)
    sender = WeightSender("broadcast", group, out, 1, True, 2) if comm.Get_rank() == 0 else None
    recv = WeightReceiver("broadcast", group, out, state(0), 1) if comm.Get_rank() else None
    results = []
    for version in (1, 2):  # the same pre-allocated buffers carry every version
        sd = state(version)
        if sender is not None:
            sender.publish(sd, version)
            info = sender.wait()  # the send is posted; this waits until every receiver has it
            mine = {"checksum": info["checksum"], "buckets": len(sender.plan.buffers), "bytes": info["bytes"]}
        else:
            got = recv.receive(version)
            mine = {
                "checksum": weights_checksum(got),
                "equal": all(torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype for k in sd),
            }
        results.append(comm.gather(mine, root=0))
    group.close()
    if comm.Get_rank() == 0:
        with open(out + "/result.json", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
