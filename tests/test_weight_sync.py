"""Weight publishing of a tied model: the output layer travels once, and the generator still holds the trainer's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_hpc.engines.base import generate
from areal_hpc.engines.torch_gen import TorchGenerationEngine
from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_tokenizer
from areal_hpc.model.weights import weights_checksum
from areal_hpc.runtime.comm.weight_sync import WeightReceiver, WeightSender, state_nbytes
from areal_hpc.types import GenRequest


class Loopback:
    """gloo's broadcast between trainer 0 and one generator in this process: what is posted is what arrives."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    peers = "the loopback"

    def post(self, plan) -> list:
        self.sent += [buf.clone() for buf in plan.buffers]
        return [self]  # its Work: done at once

    def wait(self, timeout=None) -> None:
        pass

    def posted(self, version: int) -> None:
        pass

    def wait_ready(self, version: int) -> None:
        pass

    def broadcast(self, buf: torch.Tensor) -> None:
        buf.copy_(self.sent.pop(0))


def unique_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum({v.data_ptr(): v.numel() * v.element_size() for v in state.values()}.values())


@pytest.mark.parametrize("method", ["broadcast", "disk"])
def test_a_tied_head_is_sent_once_and_the_generator_matches_the_trainer(method, tiny_qwen_dir, tmp_path):
    tr = TorchTrainEngine(str(tiny_qwen_dir), seed=0)
    gen = TorchGenerationEngine(str(tiny_qwen_dir), seed=0)
    with torch.no_grad():  # a new version: the shared embedding and head move together
        tr.model.get_input_embeddings().weight.add_(0.05 * torch.randn_like(tr.model.get_input_embeddings().weight))
    sent = tr.weights()
    assert unique_nbytes(sent) < state_nbytes(sent)  # the tiny Qwen2, as the recipe's 1.5B, ties its head

    group = Loopback() if method == "broadcast" else None
    receiver = WeightReceiver(method, group, tmp_path, gen.state_dict(), 1)
    sender = WeightSender(method, group, tmp_path, 1, True, 2)
    sender.publish(sent, 1)
    info = sender.wait()
    assert info["bytes"] == unique_nbytes(sent)
    got = receiver.receive(1)
    assert set(got) == set(gen.state_dict())  # the head arrives under both its names
    gen.update_weights(got, 1)
    assert weights_checksum(gen.state_dict()) == info["checksum"]  # the runtime's weights_match

    tok = load_tokenizer(tiny_qwen_dir)
    outs = generate(gen, [GenRequest(str(i), tok.encode(p), 6, greedy=True) for i, p in enumerate(["03+04=", "11+9="])])
    lps = tr.compute_logprobs([np.array(o.prompt_ids + o.output_ids) for o in outs])
    for o, lp in zip(outs, lps):
        np.testing.assert_allclose(o.output_logprobs, lp[len(o.prompt_ids) :], atol=1e-4)
