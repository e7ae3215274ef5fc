"""Generation engine on vLLM, step-driven: continuous batching, processed logprobs, weights through vLLM's API."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Hashable

import torch

from areal_hpc.engines.base import GenerationEngine, InFlight, generate
from areal_hpc.engines.lora import model_skeleton
from areal_hpc.model import load_causal_lm
from areal_hpc.model import stop_token_ids as model_stop_ids
from areal_hpc.model.weights import shared_names, tied_aliases, weights_checksum
from areal_hpc.types import GenOutput, GenRequest

# vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process; close() restores it
_TORCH_SET_NUM_THREADS = torch.set_num_threads


def _vllm_env(device: str) -> None:
    """Environment vLLM reads at import: set before the first `import vllm` in this process."""
    # The engine core stays in this process: start-up in seconds, and abort/reload are plain calls.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device == "cpu":
        # Leave threads where MPI/Slurm put this rank: several ranks share a node's cores here.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class VLLMGenerationEngine(GenerationEngine):
    """vLLM behind the step-driven GenerationEngine interface: add -> add_request, step -> step,
    interrupt -> abort_request.

    vLLM batches continuously (a finished sequence frees its slot at once, up to `max_num_seqs`
    running) and shares the KV blocks of a prompt's n samples through the prefix cache. Logprobs are
    vLLM's "processed" ones, after temperature: the distribution the trainer recomputes.

    One engine spans `tensor_parallel` devices (worker processes on CPU, GPUs of one node on cuda). Weights reach
    them only through vLLM's weight-transfer API: start_weight_update -> update_weights -> finish_weight_update
    (version): vLLM's nccl engine on GPUs, this project's gloo engine on CPU (engines/vllm_transfer.py). Every
    worker receives and loads what it holds; this process keeps no copy of the weights. Per-token versions are
    vLLM's own (its weight_versions spans), checked against the versions this engine expects.
    """

    def __init__(
        self,
        model_path: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        dtype: str = "float32",
        seed: int = 0,
        kv_cache_gib: float = 1.0,
        device: str = "cpu",
        max_num_seqs: int = 256,
        stop_token_ids: list[int] | None = None,
        tensor_parallel: int = 1,
    ):
        super().__init__(max_num_seqs, temperature, top_p)
        self.model_path = str(model_path)
        self.dtype = dtype
        _vllm_env(device)
        # None: every EOS the model folder declares. vLLM also reads generation_config.json's own; the set is
        # given explicitly so it stops on exactly what the torch engine does (config.json's, the tokenizer's)
        self.stop_ids = list(stop_token_ids if stop_token_ids is not None else model_stop_ids(model_path))
        import vllm
        from vllm.config import WeightTransferConfig
        from vllm.sampling_params import RequestOutputKind

        from areal_hpc.engines import vllm_transfer

        self._vllm = vllm
        self._delta = RequestOutputKind.DELTA
        skeleton = model_skeleton(model_path)  # names and shapes on the meta device: no memory
        self.names = set(skeleton.state_dict())  # what a load may name
        self.aliases = shared_names(skeleton)  # a tied output layer: sent once, loaded under both names
        parallel = {}
        if tensor_parallel > 1:  # worker processes; the engine core stays here (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            parallel = dict(tensor_parallel_size=tensor_parallel, distributed_executor_backend="mp")
        self.llm = vllm.LLM(
            model=self.model_path,
            dtype=dtype,
            seed=seed,
            enforce_eager=True,  # no graph capture/compile: start-up in seconds, weights stay swappable
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
            max_num_seqs=max_num_seqs,
            # this project's gloo engine on CPU; on GPUs vLLM's nccl engine (both also read a file: LoRA, disk)
            weight_transfer_config=WeightTransferConfig(backend=vllm_transfer.backend_for(device)),
            worker_extension_cls=f"{vllm_transfer.__name__}.TransferWorkerExtension",
            **parallel,
        )
        self.tensor_parallel = tensor_parallel
        self.engine = self.llm.llm_engine
        self._transfer = vllm_transfer
        self.llm.init_weight_transfer_engine({"init_info": {}})  # file updates from here on; connect() adds the group
        self._checksum: int | None = None  # of the weights loaded last (None: the model folder's, computed on demand)
        self.receive_s = 0.0  # the workers' receive + load seconds of the last update
        # OpenMP thread counts are per thread: stepping from another thread than this one must use the
        # count vLLM set up here, or its CPU attention refuses ("thread_num ... 2 vs. 1")
        self._threads = torch.get_num_threads()
        self._ids = itertools.count()
        self._seqs: dict[str, InFlight] = {}  # vLLM's request id -> our record, for every request in vLLM
        self._prefilled: set[str] = set()  # vLLM ids whose prefill has been counted
        self._core = getattr(getattr(self.engine, "engine_core", None), "engine_core", None)  # in-process EngineCore
        self.llm.update_weight_version("0")  # vLLM says "default" until told: the model folder is version 0
        # vLLM's first step builds what its kernels need (2-3 s for the tiny CPU model): here it is start-up,
        # overlapping the other ranks', instead of a stall in the first generation the runtime times
        generate(self, [GenRequest("warmup", [self.stop_ids[0] if self.stop_ids else 0], 1, greedy=True)])
        self.prefill_tokens = self.prefill_shared_tokens = 0  # the warm-up is not the runtime's work
        self.versions_checked = 0

    @property
    def num_running(self) -> int:
        sched = getattr(self._core, "scheduler", None)
        if sched is not None and hasattr(sched, "running"):
            return len(sched.running)
        return min(len(self._seqs), self.capacity)

    @property
    def num_waiting(self) -> int:
        return len(self._seqs) - self.num_running

    # -- weights ---------------------------------------------------------------------------------
    def connect(self, init_info: dict) -> None:
        """Join trainer 0's group for this generator (collective with trainer 0's transfer_groups.TransferGroups)."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, keep_kv: bool = False) -> None:
        """A state dict held by the caller (a LoRA merge, a test) goes in as a file in shared memory, which every
        worker reads: the same API call as a publish, and nothing pickled through an RPC."""
        from safetensors.torch import save_file

        unknown = sorted(set(state_dict) - self.names)
        if unknown:
            raise RuntimeError(
                f"update_weights: unexpected weight names {unknown[:3]}; the model has {len(self.names)} others"
            )
        self._check_idle(keep_kv)
        aliases = tied_aliases(state_dict)  # safetensors refuses two names on one tensor
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(suffix=".safetensors", prefix="areal-weights-", dir=shm)
        os.close(fd)
        try:
            save_file({k: v.detach().contiguous() for k, v in state_dict.items() if k not in aliases}, path)
            self.load({"path": path}, version, keep_kv)
        finally:
            os.unlink(path)

    def load(self, update_info: dict, version: int, keep_kv: bool = False) -> None:
        """One update through vLLM's API: every worker receives (from the file, or from trainer 0's group) and loads
        its part, then vLLM stamps the tokens it samples from here on with `version`."""
        self._check_idle(keep_kv)
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": update_info | {"version": version, "aliases": self.aliases}})
        self.llm.finish_weight_update(weight_version=str(version))
        per_worker = self.llm.collective_rpc(self._transfer.last_update)
        crcs = {crc for crc, _ in per_worker}
        if len(crcs) > 1:
            raise RuntimeError(f"the workers of one generator received different weights for version {version}")
        self._checksum, self.receive_s = crcs.pop(), max(s for _, s in per_worker)
        # blocks cached under the old weights must not serve new requests: reset when nothing holds blocks;
        # with requests in flight (keep_kv) the reset cannot run, and the version in each new request's cache
        # salt keeps it off blocks computed under older weights instead
        if not self.llm.reset_prefix_cache() and not keep_kv:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight load (requests still running)")
        self.version = version

    def _check_idle(self, keep_kv: bool) -> None:
        if self._seqs and not keep_kv:
            raise RuntimeError("update_weights with requests in flight; interrupt them or let them finish first")

    def weights_checksum(self) -> int:
        """What the workers received last (computed there, bucket by bucket); before any load, the model folder's."""
        if self._checksum is None:
            self._checksum = weights_checksum(load_causal_lm(self.model_path, self.dtype).state_dict())
        return self._checksum

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            "the vLLM engine keeps no host copy of its weights: compare weights_checksum(), or vLLM's own "
            "compute_weight_checksums() across engines"
        )

    def close(self) -> None:
        if self._seqs:  # nothing may stay in vLLM holding KV blocks
            self.engine.abort_request(list(self._seqs))
            self._seqs.clear()
        # vLLM 0.32's LLM has no shutdown(); the engine core's is the one that ends cleanly (and its workers')
        self.engine.engine_core.shutdown()
        torch.set_num_threads = _TORCH_SET_NUM_THREADS

    # -- requests --------------------------------------------------------------------------------
    def _params(self, max_tokens: int, greedy: bool):
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=max_tokens,
            logprobs=0,
            detokenize=False,
            output_kind=self._delta,
            ignore_eos=self.ignore_eos,
            stop_token_ids=[] if self.ignore_eos else self.stop_ids,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
        )

    def add(self, requests: list[GenRequest]) -> None:
        for r in requests:
            seq = self._admit(r)
            if seq is None:
                continue
            rid = f"areal-{next(self._ids)}"  # vLLM's own id: a resumed request may reuse ours
            # a prompt's n samples share their prefix blocks; a request added after a weight load never meets
            # blocks that earlier weights computed (they may outlive the load while requests hold them: keep_kv)
            prompt = {"prompt_token_ids": list(r.prompt_ids) + seq.ids, "cache_salt": f"v{self.version}"}
            self.engine.add_request(rid, prompt, self._params(seq.budget, r.greedy))
            self._seqs[rid] = seq

    def interrupt(self, ids: list[Hashable] | None = None) -> list[GenOutput]:
        hit = None if ids is None else set(ids)
        gone = [rid for rid, s in self._seqs.items() if hit is None or s.request.request_id in hit]
        if gone:
            self.engine.abort_request(gone)
            self._prefilled.difference_update(gone)
        return [self._seqs.pop(rid).output("abort") for rid in gone]

    def step(self) -> list[GenOutput]:
        done = self._take_ready()
        if self.paused or not self._seqs:
            return done
        if torch.get_num_threads() != self._threads:
            _TORCH_SET_NUM_THREADS(self._threads)
        for o in self.engine.step():
            seq = self._seqs.get(o.request_id)
            if seq is None:
                continue
            c = o.outputs[0]
            if o.request_id not in self._prefilled:
                self._prefilled.add(o.request_id)  # its prompt (+ partial) went through one prefill, less cached blocks
                cached = o.num_cached_tokens or 0  # whole KV blocks only, and never the last prompt token
                self.prefill_tokens += len(o.prompt_token_ids or ()) - cached
                self.prefill_shared_tokens += cached
            for tok, lp in zip(c.token_ids, c.logprobs, strict=True):  # logprobs=0: the sampled token's
                seq.ids.append(int(tok))
                seq.logprobs.append(float(lp[tok].logprob))
                seq.versions.append(self.version)
            if o.finished:
                self._prefilled.discard(o.request_id)
                self._take_versions(seq, c.weight_versions)
                done.append(self._seqs.pop(o.request_id).output("stop" if c.finish_reason == "stop" else "length"))
            elif seq.request.stop and self._hits_stop(seq):  # stop strings are ours: vLLM does not detokenize
                self.engine.abort_request([o.request_id])
                self._prefilled.discard(o.request_id)
                done.append(self._seqs.pop(o.request_id).output("stop"))
        return done

    def _take_versions(self, seq: InFlight, spans) -> None:
        """vLLM's per-token versions of the tokens this request sampled (a resumed request's earlier tokens came from
        an earlier request), compared with the versions this engine expected, then kept as vLLM reports them."""
        base = len(seq.request.partial_ids)
        for span in spans or ():
            v = int(span.version)
            for i in range(base + span.start, base + span.end):
                self.versions_checked += 1
                if seq.versions[i] != v:
                    self.versions_mismatched += 1
                    seq.versions[i] = v
