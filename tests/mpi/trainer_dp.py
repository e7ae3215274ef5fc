"""Under mpirun -n 2: two trainers on the runtime's own trainer group split one batch by tokens and update (each
loss aggregation)."""

import pickle
import sys

import torch
from mpi4py import MPI

from areal_hpc.algo.packing import balance_across_ranks
from areal_hpc.algo.ppo import LOSS_AGGS as AGGS
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.runtime.comm.torch_groups import init_trainer_group
from areal_hpc.runtime.worker import exit_rank


def main(model_dir: str, out: str) -> None:
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    init_trainer_group(comm, 60)
    with open(f"{out}/batch.pkl", "rb") as f:
        trajs, adv = pickle.load(f)
    lengths = [len(t.input_ids) for t in trajs]
    groups = [t.group_id for t in trajs]
    # as the scheduler does: whole groups into minibatches over the whole batch, then each one across trainers
    mine, minibatches = [], []
    for mb in balance_across_ranks(lengths, 2, groups):
        sizes, gids = [lengths[i] for i in mb], [groups[i] for i in mb]
        part = [mb[j] for j in balance_across_ranks(sizes, comm.Get_size(), gids)[comm.Get_rank()]]
        minibatches.append(list(range(len(mine), len(mine) + len(part))))
        mine += part
    for agg in AGGS:  # each aggregation over several micro-batches per trainer (a 40-token budget)
        eng = TorchTrainEngine(
            model_dir, lr=1e-3, n_minibatches=2, loss_agg=agg, loss_norm_tokens=6, max_tokens_per_mb=40
        )
        eng.optimizer = torch.optim.SGD(eng.model.parameters(), lr=0.1)  # linear in the gradient (see test_engines)
        eng.ppo_update([trajs[i] for i in mine], adv[mine], minibatches)
        torch.save(eng.weights(), f"{out}/rank{comm.Get_rank()}-{agg}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_rank()
