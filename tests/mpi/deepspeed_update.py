"""Under mpirun -n 2: DeepSpeed ZeRO trainers take a PPO step on one batch; then checkpoint, step, restore, step.
argv: model folder, output folder, ZeRO stage, loss aggregation, the objective (JSON: algo.ppo.Objective's fields),
the LoRA adapter (JSON: [rank, alpha] or null)."""

import json
import pickle
import sys

import torch
from mpi4py import MPI

from areal_hpc.algo.packing import balance_across_ranks
from areal_hpc.algo.ppo import Objective
from areal_hpc.engines.deepspeed_train import DeepSpeedTrainEngine
from areal_hpc.engines.lora import LoraSpec
from areal_hpc.runtime.comm.torch_groups import init_trainer_group
from areal_hpc.runtime.worker import exit_rank


def main(model_dir: str, out: str, stage: int, agg: str, objective: dict, lora: list | None) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    init_trainer_group(comm, 120)
    with open(f"{out}/batch.pkl", "rb") as f:
        trajs, adv = pickle.load(f)
    lengths = [len(t.input_ids) for t in trajs]
    groups = [t.group_id for t in trajs]
    mine, minibatches = [], []  # as the scheduler splits whole groups: minibatches first, then across trainers
    for mb in balance_across_ranks(lengths, 2, groups):
        sizes, gids = [lengths[i] for i in mb], [groups[i] for i in mb]
        part = [mb[j] for j in balance_across_ranks(sizes, comm.Get_size(), gids)[rank]]
        minibatches.append(list(range(len(mine), len(mine) + len(part))))
        mine += part
    share, share_adv = [trajs[i] for i in mine], adv[mine]

    def engine(optimizer):
        return DeepSpeedTrainEngine(
            model_dir,
            zero_stage=stage,
            lr=0.1 if optimizer == "sgd" else 1e-3,
            optimizer=optimizer,
            weight_decay=0.0,
            grad_clip=0.0,
            n_minibatches=2,
            seed=0,
            loss_agg=agg,
            loss_norm_tokens=6,
            objective=Objective(**objective),
            # stages 2 and 3 also recompute activations, pack into smaller micro-batches and take
            # log-probabilities 7 positions at a time: the same update either way
            gradient_checkpointing=stage > 1,
            max_tokens_per_mb=128 if stage > 1 else 4096,
            logprob_chunk_tokens=7 if stage > 1 else 1024,
            lora=LoraSpec(*lora) if lora else None,
            share_min_tokens=4,  # each group's prompt laid down once, against the reference's unshared forward
        )

    a = engine("sgd")
    stats = comm.gather(a.ppo_update(share, share_adv, minibatches), root=0)  # each share's mismatch sums
    w1 = a.weights()  # collective under ZeRO-3
    merged = a.full_weights()  # with LoRA: the adapter merged into the base
    a.export_hf(f"{out}/export")  # collective too; trainer 0 writes a Hugging Face folder
    # checkpoint round trip with Adam (its moments must come back too)
    b = engine("adamw")
    b.ppo_update(share, share_adv, minibatches)
    b.save_checkpoint(f"{out}/ckpt")
    b.ppo_update(share, share_adv, minibatches)
    w_cont = b.weights()
    c = engine("adamw")
    c.load_checkpoint(f"{out}/ckpt")
    c.ppo_update(share, share_adv, minibatches)
    w_restored = c.weights()
    if rank == 0:
        got = {"sgd_step": w1, "merged": merged, "continued": w_cont, "restored": w_restored, "version": c.version}
        got["stats"] = stats
        torch.save(got, f"{out}/ds.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]), json.loads(sys.argv[6]))
    exit_rank()
