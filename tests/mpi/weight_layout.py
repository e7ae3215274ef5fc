"""Under mpirun -n 3: trainer 0 (rank 0) publishes fp32 master weights cast to bf16; the generators check the
layout first, then receive exactly the cast weights. A layout that does not fit is refused in one line."""

import json
import sys

import torch
from mpi4py import MPI

from areal_hpc.model.weights import weights_checksum
from areal_hpc.runtime.comm.weight_sync import (
    SyncGroup,
    WeightLayoutMismatch,
    WeightReceiver,
    WeightSender,
    cast_floating,
)
from areal_hpc.runtime.worker import exit_rank


def masters() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g), "n": torch.arange(5)}


def main(out: str) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    group = SyncGroup(comm, "gloo", 60)
    result: dict = {}
    if rank == 0:
        sender = WeightSender("broadcast", group, out, 1, True, 2, dtype=torch.bfloat16)
        plan = sender.plan_for(masters())
        group.check_layout(plan.layout)
        sender.publish(masters(), 1)
        result["checksum"] = sender.wait()["checksum"]
        # a generator whose model is not the trainer's: rank 1 gets a wider tensor, rank 2 an fp32 one
        group.check_layout(plan.layout)
    else:
        template = cast_floating(masters(), torch.bfloat16)
        recv = WeightReceiver("broadcast", group, out, template, 1)
        group.check_layout(recv.plan.layout)
        got = recv.receive(1)
        result["exact"] = all(torch.equal(got[k], template[k]) and got[k].dtype == template[k].dtype for k in got)
        result["checksum"] = weights_checksum(got)
        wrong = dict(template, w=torch.zeros(40, 31, dtype=torch.bfloat16)) if rank == 1 else masters()
        try:
            group.check_layout(WeightReceiver("broadcast", group, out, wrong, 1).plan.layout)
        except WeightLayoutMismatch as err:
            result["refused"] = str(err)
    results = comm.gather(result, root=0)
    group.close()
    if rank == 0:
        with open(out + "/result.json", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
