"""Under mpirun -n 2: trainer 0 (rank 0) sends over vLLM's weight-transfer API to a TP 2 vLLM generator (rank 1),
whose two workers receive every bucket themselves; then the workers stall inside an update, and trainer 0's send
limit says so.
Everything heavy is imported in main(): vLLM spawns its workers, which import this module again."""

import json
import sys
import time

import torch

from areal_hpc.model import load_causal_lm
from areal_hpc.model.weights import WeightSyncTimeout, weights_checksum
from areal_hpc.runtime.comm.transfer_groups import TransferGroups, ready_key, worker_init_info
from areal_hpc.runtime.comm.weight_sync import BucketPlan, SyncGroup, WeightSender, published_layout
from areal_hpc.runtime.worker import exit_rank

TP, LIMIT_S = 2, 3.0


def moved(model_dir: str, version: int) -> dict[str, torch.Tensor]:
    model = load_causal_lm(model_dir).eval()
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():  # through the parameters: the tied head stays tied
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model.state_dict()


def main(model_dir: str, out: str) -> None:
    from mpi4py import MPI  # not at import: vLLM's worker processes import this module again, outside MPI

    comm = MPI.COMM_WORLD
    sync = SyncGroup(comm, "gloo", 60)
    result: dict = {}
    if comm.Get_rank() == 0:
        sender = WeightSender("broadcast", sync, out, 1, True, 2, limit_s=LIMIT_S)
        sync.check_layout(sender.plan_for(moved(model_dir, 0)).layout)
        sender.group = TransferGroups(sync, TP, 60)
        for version in (1, 2):
            sender.publish(moved(model_dir, version), version)
            result[f"sent_{version}"] = sender.wait()["checksum"]
        sender.publish(moved(model_dir, 3), 3)  # the generator's workers stall inside this update
        t0 = time.time()
        try:
            sender.wait()
        except WeightSyncTimeout as err:
            result["send_error"], result["send_error_s"] = str(err), time.time() - t0
    else:
        from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

        engine = VLLMGenerationEngine(model_dir, tensor_parallel=TP)
        plan = BucketPlan(published_layout(model_dir, "float32"), 1 << 20, "meta")
        sync.check_layout(plan.layout)
        engine.connect(worker_init_info(sync, plan, TP, 60))
        for version in (1, 2):
            sync.store.set(ready_key(1, version), "1")  # as the generator says it (its send limit counts from here)
            engine.load({"rank": 1, "limit_s": LIMIT_S}, version)
            result[f"loaded_{version}"] = engine.weights_checksum()
            result[f"expected_{version}"] = weights_checksum(moved(model_dir, version))
        sync.store.set(ready_key(1, 3), "1")
        try:  # the chaos suite's stall: trainer 0's limit must say so while the workers sleep
            engine.load({"rank": 1, "limit_s": 60, "stall_s": 3 * LIMIT_S}, 3)
        except Exception as err:  # after the stall the trainer's side of the group is gone
            result["after_stall"] = str(err).splitlines()[-1]
        engine.close()
    results = comm.gather(result, root=0)
    if comm.Get_rank() == 0:
        with open(out + "/result.json", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_rank()
