"""vLLM's weight-transfer API as the generators use it: versions stamped by vLLM, its weight checker, the group path
with tensor parallelism, and the limits that end a stalled sync in one line."""

from __future__ import annotations

import datetime
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_engines import _perturbed
from test_runtime import _mpirun

from areal_hpc.engines.torch_train import TorchTrainEngine
from areal_hpc.model import load_tokenizer
from areal_hpc.model.weights import WeightSyncTimeout, weights_checksum
from areal_hpc.runtime.comm.weight_sync import BucketPlan, published_layout
from areal_hpc.types import GenRequest

ROOT = Path(__file__).resolve().parents[1]


def _engine(path, **kw):
    from areal_hpc.engines.vllm_gen import VLLMGenerationEngine

    return VLLMGenerationEngine(str(path), seed=0, **kw)


def _moved(path, seed):
    return _perturbed(path, seed).state_dict()


@pytest.mark.parametrize("tp", [1, 2])
def test_keep_kv_loads_mid_answer_and_vllms_version_of_every_token_is_the_expected_one(tiny_model_dir, tp):
    eng = _engine(tiny_model_dir, tensor_parallel=tp)
    try:
        tok = load_tokenizer(tiny_model_dir)
        eng.ignore_eos = True
        reqs = [GenRequest(f"r{i}", tok.encode(p), 30) for i, p in enumerate(["07+35=", "1+2=", "99+99="])]
        eng.add(reqs)
        outs = []
        for step in range(40):
            if step in (5, 15):  # between two steps, every answer half done: keep_kv goes on over the cache
                eng.update_weights(_moved(tiny_model_dir, step), version=1 + (step == 15), keep_kv=True)
            outs += eng.step()
        assert len(outs) == 3 and eng.num_running == 0
        for o in outs:
            assert o.output_versions == [0] * 5 + [1] * 10 + [2] * 15, o.output_versions
        assert eng.versions_checked == 3 * 30 and eng.versions_mismatched == 0
        assert eng.weights_checksum() == weights_checksum(_moved(tiny_model_dir, 15))
    finally:
        eng.close()


def test_after_a_load_vllms_weight_checker_agrees_with_an_engine_started_from_the_trainers_export(
    tiny_model_dir, tmp_path
):
    tr = TorchTrainEngine(str(tiny_model_dir))
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(0.05)
    eng = _engine(tiny_model_dir)
    try:
        eng.update_weights(tr.weights(), version=3)
        loaded = eng.llm.collective_rpc("compute_weight_checksums")
        assert eng.weights_checksum() == weights_checksum(tr.weights())
    finally:
        eng.close()
    fresh = _engine(tr.export_hf(tmp_path / "export"))
    try:
        assert fresh.llm.collective_rpc("compute_weight_checksums") == loaded  # vLLM's own sha256 per parameter
    finally:
        fresh.close()


def test_a_receive_that_passes_its_limit_ends_in_one_line_naming_version_and_ranks(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    plan = BucketPlan(published_layout(tiny_model_dir, "float32"), 1 << 20, "meta")
    trainer = []  # trainer 0's side of the group joins from a thread: its constructor waits for the worker
    t = threading.Thread(
        target=lambda: trainer.append(dist.ProcessGroupGloo(dist.PrefixStore("g", store), 0, 2, timeout))
    )
    t.start()
    try:
        eng.connect(
            {"master_address": "127.0.0.1", "master_port": store.port, "group": "g", "world_size": 2}
            | {"buckets": plan.buckets(), "timeout_s": 30}
        )
        t.join()
        with pytest.raises(WeightSyncTimeout) as err:  # trainer 0 never sends version 4
            eng.load({"rank": 7, "limit_s": 1.0}, 4)
        line = str(err.value)
        assert "\n" not in line and "receive of version 4" in line and "generator rank 7" in line, line
        assert "limit of 1 s" in line and "'g'" in line, line
    finally:
        for pg in trainer:
            pg.shutdown()
        eng.close()


@pytest.mark.slow
def test_two_workers_receive_from_trainer_0_and_a_stalled_update_passes_the_send_limit(tiny_model_dir, tmp_path):
    r = _mpirun(2, str(ROOT / "tests" / "mpi" / "vllm_transfer.py"), str(tiny_model_dir), str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trainer, generator = json.loads((tmp_path / "result.json").read_text())
    for v in (1, 2):  # each of the two workers received every bucket; their checksums agree with what was sent
        assert generator[f"loaded_{v}"] == generator[f"expected_{v}"] == trainer[f"sent_{v}"]
    line = trainer["send_error"]
    assert line.startswith("weight sync: send of version 3 from trainer 0") and "generators [1]" in line, line
    assert "limit of 3 s" in line and "\n" not in line
    print(f"\n[vllm transfer] stalled update reported by trainer 0 after {trainer['send_error_s']:.1f} s (limit 3 s)")


def test_on_gpus_vllms_nccl_engine_is_told_every_tensor_in_the_order_trainer_0_broadcasts_them(tiny_model_dir):
    # what can be checked without a GPU: the worker's backend is registered, an empty init is the file route,
    # and the update names each tensor NcclTransferGroups.post broadcasts, in that order, as vLLM's receive checks
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from areal_hpc.engines.vllm_transfer import NCCL_BACKEND, NcclTransferEngine, TransferUpdate, backend_for
    from areal_hpc.runtime.comm.transfer_groups import transfer_backend, update_fields

    assert backend_for("cuda") == NCCL_BACKEND and transfer_backend("cuda") == "nccl"
    assert WeightTransferEngineFactory._registry[NCCL_BACKEND]() is NcclTransferEngine
    assert NcclTransferEngine.parse_init_info(None, {}) is None
    plan = BucketPlan(published_layout(tiny_model_dir, "bfloat16"), 1 << 16, "meta")
    assert len(plan.buffers) > 1  # several buckets: the order is the slots', not a bucket's
    fields = update_fields(plan, "nccl")
    sent = plan.tensors()
    assert fields["names"] == [s.name for s in plan.slots] and len(sent) == len(fields["names"])
    assert fields["shapes"] == [list(t.shape) for t in sent]
    assert (
        fields["dtype_names"] == [str(t.dtype).removeprefix("torch.") for t in sent]
        and "bfloat16" in fields["dtype_names"]
    )
    NCCLWeightTransferUpdateInfo(**fields)  # vLLM's own check of the three lists
    assert TransferUpdate(version=3, **fields).names == fields["names"]
    assert update_fields(plan, "gloo") == {}  # gloo's workers took the bucket layout at init
