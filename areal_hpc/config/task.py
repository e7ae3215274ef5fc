"""What a user brings to a run, as config sections: the dataset, the reward function and the workflow."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    """The prompts: a synthetic arithmetic task or a dataset file, and how a row becomes a prompt."""

    kind: str = "arithmetic"  # arithmetic (synthetic) | jsonl | parquet | code (jsonl rows of prompt + tests)
    path: str = ""  # dataset file for jsonl / parquet / code
    question_key: str = "question"  # the row's question field (data.kind=code: its prompt, e.g. prompt)
    # the row's reference-answer field for the math reward (data.kind=code: its tests, e.g. tests: Python
    # asserts, a string or a list)
    answer_key: str = "answer"
    # the prompt from a row's fields: {question} is the question_key field, {name} any other ({{ }}: literal braces);
    # a row with a chat `messages` list uses that instead
    prompt_template: str = "{question}"
    # auto: prompts go through the tokenizer's chat template when it has one (instruct and reasoning models
    # are trained on theirs); on: require one; off: the prompt_template text as it is
    chat_template: str = "auto"
    system_prompt: str = ""  # a system turn before each question (needs the chat template)
    max_prompt_tokens: int = 0  # prompts longer than this many tokens are skipped and counted (0 = no limit)
    heldout_size: int = 500  # problems held out for evaluation (a file: at most half its rows, drawn with data.seed)
    max_operand: int = 99  # arithmetic: operands drawn from [min_operand, max_operand]
    min_operand: int = 0  # arithmetic: the smallest operand (see max_operand)
    operator: str = "+"  # arithmetic: + (sums) | * (products: the tool demo)
    train_size: int = 9500  # arithmetic: number of training problems
    # arithmetic: which problems are drawn; a file: which rows are held out; both: the training prompts' order
    # (a fresh shuffle each epoch, the same for train-sync and run)
    seed: int = 0


@dataclass
class RewardConfig:
    """How answers are scored: the reward function and the pool of processes that runs it."""

    # f(completion: str, row: dict) -> float (or a dict with a 'score' and other numbers to log), by import path:
    # package.module:function or path/to/file.py:function; "" = the built-in the data implies: math (the row's
    # answer_key under math-verify), or code (data.kind=code); a list of them: the reward is their weighted sum,
    # each logged as reward/<name>
    fn: Any = ""
    weights: Any = field(default_factory=list)  # reward.fn as a list: one weight per function ([] = all 1.0)
    # keyword arguments to the reward function of your own (in a list, each gets those its signature names)
    args: dict = field(default_factory=dict)
    timeout_s: float = 5.0  # per answer; data.kind=code: the sandbox's wall (and cpu) limit
    num_workers: int = 2  # reward processes per generator rank: answers scored at once, off the generation path
    # data.kind=code: bwrap = bubblewrap namespaces, else the run refuses to start; auto = bubblewrap where it
    # works, else rlimits only; none = rlimits only (no network or filesystem isolation). docs/sandbox.md
    sandbox: str = "bwrap"
    code_memory_mb: int = 1024  # data.kind=code: address-space limit of the sandboxed program
    # DAPO's soft overlong penalty: an answer within this many tokens of rollout.max_new_tokens loses reward
    # linearly, up to overlong_penalty at the limit (0 = off); the longest model call of an episode counts
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the penalty at rollout.max_new_tokens (see overlong_buffer)

    def fns(self) -> list[str]:
        """reward.fn as a list of names (built-ins or import paths): one for a string, each for a list."""
        return [str(f) for f in self.fn] if isinstance(self.fn, (list, tuple)) else [self.fn]

    def names(self) -> list[str]:
        """Each function's name, as its metrics column reward/<name> says it: a built-in's, or what follows ':'."""
        return [f.rpartition(":")[2] for f in self.fns()]


@dataclass
class WorkflowConfig:
    """Which workflow runs an episode (`fn`) and its settings; `args` reaches a workflow of your own as
    `episode.args`."""

    # one episode of one prompt (docs/workflows.md): single_turn | multi_turn | tool | agent, or an import path to
    # an `async def f(episode) -> float | None`
    fn: str = "single_turn"
    max_turns: int = 2  # multi_turn: answers per episode (a wrong one gets a feedback turn)
    turn_discount: float = 0.5  # multi_turn: a right answer at turn k (from 0) earns turn_discount ** k
    feedback: str = "Wrong, try again."  # multi_turn: the user's turn after a wrong answer
    max_tool_calls: int = 4  # tool: code blocks run per episode
    tool: str = "python"  # tool: python (python3 in the sandbox) | calculator (print(<arithmetic>), in-process)
    tool_timeout_s: float = 5.0  # tool: the sandbox's wall limit per call
    # tool calls (tool=python, ep.run_python): the isolation they run under, as reward.sandbox's: bwrap | auto |
    # none (docs/sandbox.md)
    tool_sandbox: str = "bwrap"
    tool_memory_mb: int = 1024  # tool calls: the address-space limit of their python3
    # tool, agent: the share of warm-start examples written with a tool call (the rest answer directly)
    warm_start_tool_share: float = 0.5
    args: dict = field(default_factory=dict)  # anything a workflow of your own reads, as episode.args
    # agent (docs/agents.md): an OpenAI-API agent run once per episode against this generator's endpoint
    agent: str = ""  # path/to/file.py:fn or package.module:fn, `async def fn(client, row) -> float | str | None`
    agent_command: str = ""  # or a command run per episode: the row as JSON on stdin, its result on stdout
    agent_timeout_s: float = 60.0  # agent: the wall limit of one episode's agent (both forms)
    tool_parser: str = "hermes"  # agent: the vLLM tool parser reading the model's tool calls; none: never parsed
    endpoint_host: str = "127.0.0.1"  # agent: the address the endpoint binds (loopback: only this node's agents)
    max_request_kb: int = 1024  # agent: a request body larger than this is refused (413)
    # tries whose workflow or agent failed (raised, timed out, a bad result) run again; the run stops once more
    # than this share of the last failure_window tries failed (docs/agents.md); in (0, 1], 1: never
    max_failure_share: float = 0.75
    failure_window: int = 200  # the tries max_failure_share is judged over, in the order they started; >= 1
