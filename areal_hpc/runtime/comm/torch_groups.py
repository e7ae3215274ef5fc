"""torch.distributed groups among MPI ranks, bootstrapped over MPI: rank 0's TCPStore address is broadcast."""

from __future__ import annotations

import datetime
import socket


def store_over_mpi(comm, timeout_s: float):
    """A TCPStore for every rank of `comm`, hosted by its rank 0 on a free port.

    MPI already connects the ranks, so no MASTER_ADDR/MASTER_PORT has to be agreed on beforehand (a port
    fixed in a config collides when two jobs share a node).
    """
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        host = socket.gethostname()
        store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        comm.bcast((host, store.port), root=0)
        return store
    host, port = comm.bcast(None, root=0)
    return dist.TCPStore(host, port, size, False, timeout=timeout)


def init_trainer_group(trainer_comm, timeout_s: float, backend: str = "gloo") -> None:
    """The trainers' default torch process group (gloo; NCCL on GPUs), created before the engine."""
    import torch.distributed as dist

    store = store_over_mpi(trainer_comm, timeout_s)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("trainers", store),
        rank=trainer_comm.Get_rank(),
        world_size=trainer_comm.Get_size(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
