"""What a workflow sees of one episode: its row, a token transcript, and awaitable generate / reward / tool calls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_hpc.workflow.runner import EpisodeRunner


@dataclass
class Completion:
    """One answer the model sampled, exactly as the engine returned it (appended to the transcript, trained)."""

    ids: list[int]
    logprobs: list[float]  # behaviour logprob of each token
    versions: list[int]  # the weight version that sampled each token
    finish_reason: str  # stop (EOS or a stop string) | length
    text: str  # ids decoded (special tokens skipped): for rewards and parsing, never tokenized again


@dataclass
class ToolResult:
    """A tool call's outcome; `text` is what goes back to the model."""

    text: str
    ok: bool  # exited 0 within its time limit
    timed_out: bool
    seconds: float


@dataclass
class Segment:
    """A run of transcript tokens: sampled by the policy (trained), or added by the workflow (not trained)."""

    ids: list[int]
    trained: bool
    logprobs: list[float] = field(default_factory=list)  # sampled segments: behaviour logprobs
    versions: list[int] = field(default_factory=list)  # sampled segments: weight versions


@dataclass
class EpisodeStats:
    turns: int = 0  # generate calls
    tool_calls: int = 0
    tool_errors: int = 0  # tool calls that timed out or exited non-zero
    tool_s: float = 0.0
    reward_timeouts: int = 0
    reward_errors: int = 0
    reward_span: tuple[float, float] | None = None  # first reward call to the last answer (the timeline's span)
    tool_spans: list[tuple[float, float]] = field(default_factory=list)  # each tool call's start and end


class Episode:
    """One episode of one prompt. A workflow is `async def workflow(ep: Episode) -> float | None`: it calls
    `await ep.generate()` (the model continues the transcript), may append text of its own
    (`ep.append_message`, `ep.append_text`: rendered once, never trained), scores with `await ep.reward(text)`
    and returns the episode's reward, or None to reject the episode (it is run again).

    The transcript (`ep.tokens`) starts as the prompt's tokens; the model's tokens are kept exactly as sampled,
    so the trainer trains on what the model saw. Waiting for a reward or a tool holds no engine slot.
    """

    def __init__(self, runner: EpisodeRunner, key: str, row: dict, prompt_ids: list[int], greedy: bool):
        self._runner = runner
        self.key = key
        self.row = row  # the dataset row, every field
        self.prompt_ids = list(prompt_ids)
        self.greedy = greedy  # held-out evaluation: argmax decoding
        self.config = runner.settings.workflow  # the config's workflow section (max_turns, max_tool_calls, ...)
        self.args: dict = dict(self.config.args)  # workflow.args: settings for a workflow of your own
        self.tokenizer = runner.tokenizer
        self.segments: list[Segment] = [Segment(list(prompt_ids), trained=False)]
        self.stats = EpisodeStats()
        self.t_start = time.time()
        self.last_finish = "stop"

    # -- the transcript ---------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    def append_text(self, text: str) -> list[int]:
        """`text` tokenized once and appended, not trained (a tool's output inside the model's turn)."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
        return self.append_tokens(ids)

    def append_tokens(self, ids: list[int]) -> list[int]:
        """Token ids appended as they are, not trained."""
        if ids:
            self.segments.append(Segment(list(ids), trained=False))
        return list(ids)

    def append_message(self, role: str, content: str) -> list[int]:
        """A new chat turn (e.g. the user's feedback) appended, not trained: the chat template's rendering of
        this one message plus the prompt of the assistant's next turn (plain `content` without a template)."""
        return self.append_tokens(self._runner.render_turn(role, content))

    # -- calls that wait --------------------------------------------------------------------------
    async def generate(self, max_new_tokens: int | None = None, stop: list[str] | None = None) -> Completion:
        """The model continues the transcript: up to `max_new_tokens` (default rollout.max_new_tokens, capped by
        the model's context), ending at EOS or after one of the `stop` strings. Appended, trained."""
        out = await self._runner.generate(self, max_new_tokens, stop)
        self.stats.turns += 1
        self.last_finish = out.finish_reason
        if out.ids:
            self.segments.append(Segment(list(out.ids), True, list(out.logprobs), list(out.versions)))
        return out

    async def reward(self, completion: str) -> float:
        """The run's reward function (reward.fn) on (completion, this row), in the reward workers: 0.0 when it
        hangs past reward.timeout_s or raises (both counted per version)."""
        return await self._runner.reward(self, completion)

    async def run_python(self, code: str, timeout_s: float | None = None) -> ToolResult:
        """Run `code` with python3 in the sandbox (the code reward's limits; wall limit workflow.tool_timeout_s)
        in a worker thread: other episodes keep the engine busy meanwhile."""
        return await self._runner.run_python(self, code, timeout_s)

    def calculate(self, code: str) -> ToolResult:
        """The calculator tool on `code` (lines of `print(<arithmetic>)`), in this process; counted as a tool call."""
        from areal_hpc.workflow.tools import calculator

        t0 = time.time()
        result = calculator(code)
        self.stats.tool_calls += 1
        self.stats.tool_errors += not result.ok
        self.stats.tool_s += result.seconds
        self.stats.tool_spans.append((t0, time.time()))
        return result

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
