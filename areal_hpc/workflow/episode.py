"""What a workflow sees of one episode: its row, a token transcript, and awaitable generate / reward / tool calls."""

from __future__ import annotations

import time
from collections.abc import Hashable

from areal_hpc.reward.values import finite_number
from areal_hpc.workflow.records import Completion, EpisodeFailure, EpisodeStats, FinishedEpisode, Segment, ToolResult
from areal_hpc.workflow.tools import calculator


class Episode:
    """One episode of one prompt. A workflow is `async def workflow(ep: Episode) -> float | None`: it calls
    `await ep.generate()` (the model continues the transcript), may append text of its own
    (`ep.append_message`, `ep.append_text`: rendered once, never trained), scores with `await ep.reward(text)`
    and returns the episode's reward, or None to reject the episode (it is run again).

    The transcript (`ep.tokens`) starts as the prompt's tokens; the model's tokens are kept exactly as sampled,
    so the trainer trains on what the model saw. Waiting for a reward or a tool holds no engine slot.
    """

    def __init__(self, runner, key: Hashable, row: dict, prompt_ids: list[int], greedy: bool):
        # runner: the EpisodeRunner that runs this episode: its raw calls (sample, score, run_python) and text
        self._runner = runner
        self._text = runner.text
        self.key = key  # as the runner's caller gave it
        self.row = row  # the dataset row, every field
        self.prompt_ids = list(prompt_ids)
        self.greedy = greedy  # held-out evaluation: argmax decoding
        self.config = runner.settings.workflow  # the config's workflow section (max_turns, max_tool_calls, ...)
        self.args: dict = dict(self.config.args)  # workflow.args: settings for a workflow of your own
        self.tokenizer = runner.text.tokenizer
        self.segments: list[Segment] = [Segment(list(prompt_ids), trained=False)]
        self.branches: list[list[Segment]] = []  # earlier transcripts, given up by branch()
        self.stats = EpisodeStats()
        self.t_start = time.time()
        self.last_finish = "stop"

    # -- the transcript ---------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    def branch(self, context_ids: list[int] | None = None) -> None:
        """Rewrite history: the transcript so far is kept as a sample of its own (when the model sampled in it),
        trained with this episode's reward and advantage, and a new transcript starts from `context_ids`
        (default: the prompt), none of them trained, whatever earlier transcripts they came from."""
        if any(s.trained for s in self.segments):
            self.branches.append(self.segments)
        self.segments = [Segment(list(self.prompt_ids if context_ids is None else context_ids), trained=False)]

    def append_text(self, text: str) -> list[int]:
        """`text` tokenized once and appended, not trained (a tool's output inside the model's turn)."""
        return self.append_tokens(self._text.encode(text))

    def append_tokens(self, ids: list[int]) -> list[int]:
        """Token ids appended as they are, not trained."""
        if ids:
            self.segments.append(Segment(list(ids), trained=False))
        return list(ids)

    def append_message(self, role: str, content: str) -> list[int]:
        """A new chat turn (e.g. the user's feedback) appended, not trained: the chat template's rendering of
        this one message plus the prompt of the assistant's next turn (plain `content` without a template)."""
        return self.append_tokens(self._text.turn(role, content))

    # -- calls that wait --------------------------------------------------------------------------
    async def generate(
        self, max_new_tokens: int | None = None, stop: list[str] | None = None, train: bool = True
    ) -> Completion:
        """The model continues the transcript: up to `max_new_tokens` (default rollout.max_new_tokens, capped by
        the model's context), ending at EOS or after one of the `stop` strings. Appended; trained unless
        `train=False` (kept in the transcript with its logprobs and versions, loss mask 0)."""
        tokens = self.tokens
        budget = self._budget(max_new_tokens, len(tokens))
        if budget <= 0:
            out = Completion([], [], [], "length", "")
        else:
            o = await self._runner.sample(self.key, tokens, budget, self.greedy, list(stop or []))
            reason = "stop" if o.finish_reason == "stop" else "length"
            out = Completion(o.output_ids, o.output_logprobs, o.output_versions, reason, self.decode(o.output_ids))
        self.stats.turns += 1
        self.last_finish = out.finish_reason
        if out.ids:
            self.segments.append(Segment(list(out.ids), bool(train), list(out.logprobs), list(out.versions)))
        return out

    def _budget(self, max_new_tokens: int | None, context: int) -> int:
        """A call's token budget: max_new_tokens (default rollout.max_new_tokens), capped by the model's context."""
        settings = self._runner.settings
        budget = max_new_tokens or settings.max_new_tokens
        return min(budget, settings.max_context - context) if settings.max_context else budget

    def log(self, name: str, value: float) -> None:
        """A number of this episode (logging `name` again replaces it), averaged per version into metrics.csv
        as episode/<name>. Anything but a finite number fails the workflow."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"ep.log({name!r}, ...): the name must be a non-empty string")
        v = finite_number(value)
        if v is None:
            raise TypeError(
                f"ep.log({name!r}, {value!r}): the value must be a finite number, not {type(value).__name__}"
            )
        self.stats.logged[f"episode/{name}"] = v

    async def reward(self, completion: str) -> float:
        """The run's reward function (reward.fn) on (completion, this row), in the reward workers: 0.0 when it
        hangs past reward.timeout_s or raises (both counted per version)."""
        t0 = time.time()
        value, status, extras = await self._runner.score(completion, self.row)
        self.stats.add_reward_call(status, extras, t0, time.time())
        return value

    async def run_python(self, code: str, timeout_s: float | None = None) -> ToolResult:
        """Run `code` with python3 in the sandbox (workflow.tool_sandbox, tool_memory_mb; wall limit
        workflow.tool_timeout_s) in a worker thread: other episodes keep the engine busy meanwhile."""
        t0 = time.time()
        result = await self._runner.run_python(code, timeout_s or self.config.tool_timeout_s)
        self.stats.add_tool_call(result, t0, time.time())
        return result

    def calculate(self, code: str) -> ToolResult:
        """The calculator tool on `code` (lines of `print(<arithmetic>)`), in this process; counted as a tool call."""
        t0 = time.time()
        result = calculator(code)
        self.stats.add_tool_call(result, t0, time.time())
        return result

    def service(self, make):
        """What a workflow keeps for all the episodes of this episode's runner (the agent workflow's endpoint):
        `make(services)` at the first call, the same object after, closed (its `close()`) when the runner closes.
        `services` (a RunnerServices) is what it may use of the runner: settings, tokenizer, thread bridges."""
        return self._runner.service(make)

    def decode(self, ids: list[int]) -> str:
        """Token ids as text (special tokens skipped), as a Completion's `text` is made."""
        return self._text.decode(ids)

    def finished(self, reward: float | None, failure: EpisodeFailure | None = None) -> FinishedEpisode:
        """This episode as it ended (the runner's record of it)."""
        return FinishedEpisode(
            self.key,
            reward,
            self.segments,
            self.stats,
            self.last_finish,
            self.t_start,
            time.time(),
            self.branches,
            failure,
        )
