"""Under mpirun -n 2 (argv: student, teacher, out): ZeRO-3 trainers' teacher logprobs, distill_kl, baseline."""

import pickle
import sys

import numpy as np
import torch
from mpi4py import MPI

from areal_hpc.algo.packing import balance_across_ranks
from areal_hpc.engines.deepspeed_train import DeepSpeedTrainEngine
from areal_hpc.engines.teacher import DistillSpec
from areal_hpc.runtime.comm.torch_groups import init_trainer_group
from areal_hpc.runtime.worker import exit_rank


def main(student: str, teacher: str, out: str) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    init_trainer_group(comm, 120)
    with open(f"{out}/batch.pkl", "rb") as f:
        trajs, _ = pickle.load(f)
    lengths = [len(t.input_ids) for t in trajs]
    mine = balance_across_ranks(lengths, 2)[rank][: 3 - rank]  # uneven shares: lockstep pads the shorter rank
    share = [trajs[i] for i in mine]
    engine = DeepSpeedTrainEngine(
        student,
        zero_stage=3,
        lr=0.1,
        optimizer="sgd",
        n_minibatches=1,
        seed=0,
        temperature=0.7,
        max_tokens_per_mb=16,  # one sequence per micro-batch
        logprob_chunk_tokens=7,
        distill=DistillSpec(teacher, 0.5),
    )
    lps = engine._teacher_logprobs([t.input_ids for t in share], {})
    stats = engine.ppo_update(share, np.zeros(len(share), np.float32))
    kl = stats["distill_kl"] if share else None
    got = comm.gather((mine, [lp.numpy() for lp in lps], kl, engine._distill_baseline), root=0)
    if rank == 0:
        with open(f"{out}/ds.pkl", "wb") as f:
            pickle.dump(got, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    exit_rank()
