"""Generation engine on vLLM, in-process: continuous batching, processed logprobs, in-place weight reload."""

from __future__ import annotations

import itertools
import os

import torch

from areal_hpc.engines.base import GenerationBase
from areal_hpc.model import load_causal_lm
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


class VLLMGenerationEngine(GenerationBase):
    """vLLM behind the GenerationEngine interface.

    One generate() call adds every request to vLLM's scheduler, which batches them continuously (a
    finished sequence frees its slot at once) and shares the KV blocks of a prompt's n samples through
    the prefix cache. Logprobs are vLLM's "processed" ones, after temperature: the distribution the
    trainer recomputes. Weights are reloaded in place from the received tensors (vLLM copies them, so
    the caller's buffers can be reused) and the prefix cache is reset, since cached blocks were
    computed by the old weights.

    `state_dict()` is a host mirror of the last weights loaded, in the trainer's (Hugging Face) names:
    vLLM fuses q/k/v and gate/up, so its own parameters do not line up with the trainer's export. The
    contract tests check that what vLLM computes after a reload equals transformers on those weights.
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
    ):
        super().__init__()
        _vllm_env(device)
        import vllm
        from vllm.sampling_params import RequestOutputKind

        self._vllm = vllm
        self._delta = RequestOutputKind.DELTA
        self.mirror = load_causal_lm(model_path, dtype).state_dict()
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            enforce_eager=True,  # no graph capture/compile: start-up in seconds, weights stay swappable
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
        )
        self.engine = self.llm.llm_engine
        # OpenMP thread counts are per thread: a generate() on another thread (the runtime's worker) must use
        # the count vLLM set up here, or its CPU attention refuses ("thread_num ... 2 vs. 1")
        self._threads = torch.get_num_threads()
        self.temperature = temperature
        self.top_p = top_p
        self._ids = itertools.count()

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        unknown = sorted(set(state_dict) - set(self.mirror))
        if unknown:
            raise RuntimeError(f"update_weights: unexpected weight names {unknown[:3]}; the model has {len(self.mirror)} others")
        with self._lock:
            for k, v in state_dict.items():
                self.mirror[k].copy_(v)
            # tied weights appear under two names; vLLM loads each name it knows once
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state_dict.items())})
            # blocks cached under the old weights must go; this fails only while requests still hold blocks
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a weight reload (requests still running)")
            self.version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.mirror

    def close(self) -> None:
        # vLLM 0.32's LLM has no shutdown(); the engine core's is the one that ends cleanly
        self.engine.engine_core.shutdown()
        torch.set_num_threads = _TORCH_SET_NUM_THREADS

    # -- sampling --------------------------------------------------------------------------------
    def _params(self, max_tokens: int, greedy: bool):
        return self._vllm.SamplingParams(
            n=1, max_tokens=max_tokens, logprobs=0, detokenize=False, output_kind=self._delta, ignore_eos=self.ignore_eos,
            temperature=0.0 if greedy else self.temperature, top_p=1.0 if greedy else self.top_p,
        )

    def _generate(self, requests: list[GenRequest], greedy: bool) -> list[GenOutput]:
        if torch.get_num_threads() != self._threads:
            _TORCH_SET_NUM_THREADS(self._threads)
        out_ids = [list(r.partial_ids) for r in requests]
        out_lp = [list(r.partial_logprobs) for r in requests]
        out_ver = [list(r.partial_versions) for r in requests]
        reason: list[str | None] = [None] * len(requests)
        running: dict[str, int] = {}
        for i, r in enumerate(requests):
            budget = r.max_new_tokens - len(r.partial_ids)
            if budget <= 0:
                reason[i] = "length"
                continue
            rid = f"areal-{next(self._ids)}"
            prompt = {"prompt_token_ids": list(r.prompt_ids) + list(r.partial_ids)}
            with self._lock:
                self.engine.add_request(rid, prompt, self._params(budget, greedy))
            running[rid] = i
        try:
            while running and not self._abort.is_set():
                with self._lock:
                    version = self.version
                    step = self.engine.step()
                for o in step:
                    i = running.get(o.request_id)
                    if i is None:
                        continue
                    c = o.outputs[0]
                    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):  # logprobs=0: the sampled token's
                        out_ids[i].append(int(tok))
                        out_lp[i].append(float(lp[tok].logprob))
                        out_ver[i].append(version)
                    if o.finished:
                        reason[i] = "stop" if c.finish_reason == "stop" else "length"
                        del running[o.request_id]
        finally:
            if running:  # aborted, or an error: nothing may stay in vLLM holding KV blocks
                with self._lock:
                    self.engine.abort_request(list(running))
        return self._outputs(requests, out_ids, out_lp, out_ver, reason)
