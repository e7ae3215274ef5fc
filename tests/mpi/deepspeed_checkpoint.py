"""Under mpirun -n 2: DeepSpeed ZeRO trainers take one PPO step and checkpoint it into RUN_DIR/checkpoints/vN,
as a run's trainers do; trainer 0 also saves the weights the trainers hold (gathered under ZeRO-3)."""

import pickle
import sys

import torch
from mpi4py import MPI

from areal_hpc.engines.deepspeed_train import DeepSpeedTrainEngine
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.comm.torch_groups import init_trainer_group
from areal_hpc.runtime.worker import exit_rank


def main(model_dir: str, run_dir: str, stage: int, batch_file: str, weights_file: str) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    init_trainer_group(comm, 120)
    with open(batch_file, "rb") as f:
        trajs, adv = pickle.load(f)
    engine = DeepSpeedTrainEngine(model_dir, zero_stage=stage, lr=1e-2, optimizer="adamw", n_minibatches=1, seed=0)
    mine = list(range(rank, len(trajs), size))  # each trainer its share of one minibatch
    engine.ppo_update([trajs[i] for i in mine], adv[mine], [list(range(len(mine)))])
    engine.save_checkpoint(RunDir(run_dir).trainer_checkpoint(engine.version))  # collective
    weights = engine.weights()  # collective under ZeRO-3
    if rank == 0:
        torch.save({k: v.cpu() for k, v in weights.items()}, weights_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    exit_rank()
