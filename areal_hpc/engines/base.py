"""The engine interfaces the runtime talks to (generation: step-driven sampling with versions; training: PPO steps)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from areal_hpc.model.weights import weights_checksum
from areal_hpc.store.columns import Batch
from areal_hpc.types import GenOutput, GenRequest


@dataclass
class InFlight:
    """One request inside an engine: what it asked for and what it has produced so far."""

    request: GenRequest
    ids: list[int]
    logprobs: list[float]
    versions: list[int]

    @classmethod
    def of(cls, r: GenRequest) -> InFlight:
        return cls(r, list(r.partial_ids), list(r.partial_logprobs), list(r.partial_versions))

    @property
    def budget(self) -> int:
        """Tokens still to sample."""
        return self.request.max_new_tokens - len(self.ids)

    def output(self, reason: str) -> GenOutput:
        r = self.request
        return GenOutput(
            request_id=r.request_id,
            prompt_ids=list(r.prompt_ids),
            output_ids=self.ids,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason=reason,
            request=r,
        )


class GenerationEngine(ABC):
    """Step-driven generation: requests join the running batch at any step and leave in the step they finish.

    Nothing here blocks for longer than one engine step, so the caller (a generator's main loop) keeps
    answering MPI between steps. Per token an output records the sampled id, its behaviour logprob under
    softmax(logits / temperature) and the weight version that sampled it.

    Besides the interface this class holds what the engines share: version, pause flag, capacity, the
    sampling temperature/top-p and the requests that finished before a step.
    """

    version: int
    """Weight version now loaded; every token sampled carries it."""
    ignore_eos: bool
    """True: every sequence runs to max_new_tokens (benchmarks, tests)."""
    capacity: int
    """Sequences one step can hold; more are queued and join as slots free."""
    prefill_tokens: int
    """Tokens processed by prefills since start-up (new requests, and resumed ones' prompt + partial again)."""
    versions_checked: int = 0
    """Output tokens whose version the engine's backend stamped itself (vLLM's weight_versions), compared with the
    version this class recorded; 0 for engines that keep no stamp of their own."""
    versions_mismatched: int = 0
    """... of those, the tokens whose stamp differed (then the backend's is kept)."""
    prefill_shared_tokens: int
    """Prompt (+ partial) tokens of requests prefilled since start-up that were served from a prefix cache or
    a group's shared prefill instead of computed: prefill_tokens + this is every prompt token prefilled."""

    def __init__(self, max_num_seqs: int, temperature: float, top_p: float) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.version = 0
        self.ignore_eos = False
        self.capacity = max_num_seqs
        self.temperature = temperature
        self.top_p = top_p
        self.paused = False
        self.prefill_tokens = 0
        self.prefill_shared_tokens = 0
        self.model_path: str | None = None  # set by the engine: its tokenizer decodes stop strings
        self._tokenizer = None
        self._ready: list[GenOutput] = []  # finished without a step (no budget left); returned by the next step

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Requests in the running batch now (at most `capacity`)."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Requests added that wait for a slot."""

    @property
    def has_work(self) -> bool:
        """A step would return or advance something: requests running or waiting, or outputs that finished without
        a step (no budget left: a max_new_tokens of 0, a resumed answer already at its length)."""
        return bool(self.num_running or self.num_waiting or self._ready)

    @abstractmethod
    def add(self, requests: list[GenRequest]) -> None:
        """The requests join the running batch at the next step (queued if it is full)."""

    @abstractmethod
    def step(self) -> list[GenOutput]:
        """One engine step: every running request gets one token; returns those that finished in it."""

    @abstractmethod
    def interrupt(self, ids: list[Hashable] | None = None) -> list[GenOutput]:
        """End these running or waiting requests (None: all) and return their partial outputs ('abort').

        Adding `output.request.resumed(output)` later continues each exactly where it stopped.
        """

    def pause(self) -> None:
        """Stop stepping: step() does nothing until resume()."""
        self.paused = True

    def resume(self) -> None:
        """Step again after pause()."""
        self.paused = False

    @abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, keep_kv: bool = False) -> None:
        """Load new weights in place; tokens sampled afterwards carry `version`.

        keep_kv=False: nothing may be in flight. keep_kv=True: requests in flight stay; running ones go on
        over the KV cache their earlier tokens left (computed under the old weights), and no cache computed
        before the load is served to a request added after it.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights now loaded, in the trainer's names (receive buffers and checksums are built from it)."""

    def weights_checksum(self) -> int:
        """model.weights.weights_checksum of the weights loaded last, in the trainer's names (weights_match)."""
        return weights_checksum(self.state_dict())

    @abstractmethod
    def close(self) -> None:
        """Release what the engine holds outside Python objects (vLLM's engine core)."""

    # -- helpers for the engines -------------------------------------------------------------------
    def _admit(self, r: GenRequest) -> InFlight | None:
        """The engine's record of a new request, or None when it has nothing left to sample."""
        seq = InFlight.of(r)
        if seq.budget <= 0:
            self._ready.append(seq.output("length"))
            return None
        return seq

    def _take_ready(self) -> list[GenOutput]:
        out, self._ready = self._ready, []
        return out

    def _finish_reason(self, seq: InFlight, token: int, stop_ids: set[int]) -> str | None:
        if token in stop_ids and not self.ignore_eos:
            return "stop"
        if seq.request.stop and self._hits_stop(seq):
            return "stop"
        return "length" if seq.budget <= 0 else None

    def _hits_stop(self, seq: InFlight) -> bool:
        """Whether the newest tokens complete one of the request's stop strings. A string of n characters ends
        within the last n tokens (every token decodes to at least one character, or to none: then more are
        needed, and the check comes again at the next token)."""
        n = max(len(s) for s in seq.request.stop)
        tail = self.tokenizer.decode(seq.ids[-n:], skip_special_tokens=False)
        return any(s in tail for s in seq.request.stop)

    @property
    def tokenizer(self):
        """The model folder's tokenizer, loaded when a request first has stop strings."""
        if self._tokenizer is None:
            from areal_hpc.model import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer


def run_to_end(
    engine: GenerationEngine,
    deliver: Callable[[GenOutput], None],
    more: Callable[[], bool],
    idle: Callable[[], None],
) -> None:
    """The one blocking loop over an engine with nothing else in flight: step it and `deliver` each output while
    `more()` says work is left; when the engine holds nothing, `idle()` (wait for what lives outside it, or raise).

    `generate` (raw requests: engine tests, benchmarks, vLLM's warm-up) and workflow.batch.run_episodes (episodes:
    evaluation, the single-process loop) are both this loop; the generator rank steps its engine in its own loop.
    """
    while more():
        if engine.has_work:
            for o in engine.step():
                deliver(o)
        else:
            idle()


def generate(engine: GenerationEngine, requests: list[GenRequest]) -> list[GenOutput]:
    """Add every request and step until all are back; outputs come back in request order."""
    want = {r.request_id for r in requests}
    if len(want) != len(requests):
        raise ValueError("generate: request ids must be unique")
    done: dict[Hashable, GenOutput] = {}

    def keep(o: GenOutput) -> None:
        if o.request_id in want:
            done[o.request_id] = o

    def lost() -> None:
        missing = sorted(map(str, want - done.keys()))[:3]
        raise RuntimeError(f"generate: the engine is empty but never returned {missing}")

    engine.add(requests)
    run_to_end(engine, keep, lambda: len(done) < len(want), lost)
    return [done[r.request_id] for r in requests]


class TrainEngine(ABC):
    """Data-parallel PPO training on this rank's share of a batch, plus the warm start, weights and checkpoints.

    Every trainer rank calls ppo_update and supervised_step together (they run collectives); the two
    flags below say which of the other calls must be collective too.
    """

    version: int
    """Policy version of the weights: ppo_update adds one, load_checkpoint restores it."""
    model: torch.nn.Module
    """The Hugging Face causal LM being trained (tests perturb it and swap its optimizer)."""
    optimizer: torch.optim.Optimizer
    """The optimizer stepping `model` (tests replace it with SGD for exact comparisons)."""
    collective_weights: bool = False
    """True: every trainer must call weights() together (ZeRO-3 gathers the full tensors)."""
    collective_checkpoint: bool = False
    """True: every trainer writes its part of a checkpoint, so all call save_checkpoint."""
    lora = None
    """The adapter trained on a frozen base (engines.lora.LoraSpec), or None: every weight is trained."""

    @abstractmethod
    def compute_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        """Per-token log p(token_t | tokens_<t) under the current weights (position 0 gets 0)."""

    @abstractmethod
    def ppo_update(
        self, trajectories: Batch, advantages: np.ndarray, minibatches: list[list[int]] | None = None
    ) -> dict[str, float]:
        """One policy version on this rank's share (columns, or Trajectory records: columns.as_columns): one
        optimizer step per minibatch; version += 1.

        `minibatches` (indices into `trajectories`, the same count on every rank) is how the batch was
        split before it was shared out; None: this rank's share is split n_minibatches ways.
        """

    @abstractmethod
    def supervised_step(self, sequences: list[np.ndarray], loss_masks: list[np.ndarray], lr: float) -> float:
        """One cross-entropy step on the masked tokens at learning rate `lr` (the warm start); version unchanged."""

    def set_lr(self, lr: float) -> None:  # noqa: B027  (an engine without an optimizer has nothing to set)
        """The learning rate of the next update (trainer.lr_schedule)."""

    def sum_across_trainers(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum of `values` over every trainer (collective: all call it); one trainer: itself."""
        return np.asarray(values, dtype=np.float64)

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """What is published to generators: full weights, or with LoRA the adapter alone."""

    def base_weights(self) -> dict[str, torch.Tensor]:
        """With LoRA, the frozen base in Hugging Face names (collective like weights())."""
        raise NotImplementedError(f"{type(self).__name__} trains no adapter")

    @abstractmethod
    def export_hf(self, path: Path) -> Path:
        """Save a Hugging Face folder (safetensors + tokenizer) loadable by transformers/vLLM."""

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Write model, optimizer, RNG state and version to the folder `path` (published atomically)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        """Restore what save_checkpoint wrote, version included."""
