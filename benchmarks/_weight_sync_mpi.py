"""Run by async_vs_sync.py under mpirun -n 3: rank 0 sends a Llama-shaped fp32 state dict (~230 MB) to 2
receivers three ways: bucketed (the runtime's WeightSender), one raw flat buffer, and tensor by tensor."""

import json
import sys
import time

import torch
from mpi4py import MPI

from areal_hpc.runtime.comm.weight_sync import SyncGroup, WeightReceiver, WeightSender, state_nbytes


def llama_like(hidden: int = 1024, layers: int = 2, vocab: int = 16000, inter: int = 2752) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden), "lm_head.weight": torch.randn(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = torch.randn(hidden, hidden)
        for n, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            sd[p + f"mlp.{n}.weight"] = torch.randn(*shape)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return sd


def main(out: str, repeats: int = 5) -> None:
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    sd = llama_like()
    nbytes = state_nbytes(sd)
    group = SyncGroup(comm, "gloo", 300)
    res = {"bytes": nbytes}
    raw = group.raw_bandwidth(nbytes, repeats=repeats)  # one flat buffer of the same bytes
    if comm.Get_rank() == 0:
        sender = WeightSender("broadcast", group, out, 64, False, 2)
        sender.publish(sd, 0)  # allocates the buckets once
        sender.wait()
        comm.Barrier()
        t0 = time.perf_counter()
        for v in range(repeats):
            sender.publish(sd, v + 1)
        sender.wait()
        res["bucketed_gbps"] = nbytes * repeats / (time.perf_counter() - t0) / 1e9
        res["buckets"] = len(sender.plan.buffers)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            for name in sorted(sd):
                group.broadcast(sd[name])
        res["per_tensor_gbps"] = nbytes * repeats / (time.perf_counter() - t0) / 1e9
        res["raw_gbps"] = raw
        with open(out, "w") as f:
            json.dump(res, f)
    else:
        recv = WeightReceiver("broadcast", group, out, sd, 64)
        recv.receive(0)
        comm.Barrier()
        for v in range(repeats):
            recv.receive(v + 1)
        comm.Barrier()
        for _ in range(repeats):
            for name in sorted(sd):
                group.broadcast(sd[name])
    group.close()


if __name__ == "__main__":
    main(sys.argv[1])
