"""A run's reward `f(completion, row)`: built-in (math, code), the user's by import path, or a weighted list of them."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

from areal_hpc.data import final_answer
from areal_hpc.plugins import PluginError, check_signature, resolve
from areal_hpc.reward.code import _score as _code_score
from areal_hpc.reward.emulated import EmulatedRewards
from areal_hpc.reward.math import _math_reward_unbounded, warm_up
from areal_hpc.reward.pool import RewardPool
from areal_hpc.reward.sandbox import Limits, isolation
from areal_hpc.reward.values import RewardValueError, as_reward

__all__ = ["BUILTIN_REWARDS", "reward_fn_names", "check_reward_fn", "reward_pool_for", "WeightedRewards"]

logger = logging.getLogger(__name__)

BUILTIN_REWARDS = ("math", "code")
# A worker waits this much longer than the sandbox's wall timeout: bwrap and python3 start in ~0.1 s.
SANDBOX_SLACK_S = 5.0


def _reference(ref, key: str) -> str:
    """The reference a built-in compares against: the row's `key` field, or `ref` itself when given as text."""
    return ref if isinstance(ref, str) else (ref.get(key) if isinstance(ref, dict) else None)


@dataclass(frozen=True)
class MathAnswer:
    """Built-in `math`: 1.0 when the completion's final answer (its last \\boxed{}) equals the row's `key`
    field (the text after '####' when there is one) under math-verify, else 0.0."""

    key: str = "answer"

    def __call__(self, completion: str, row) -> float:
        return _math_reward_unbounded(completion, final_answer(_reference(row, self.key)) or "")

    def load(self) -> None:
        warm_up()


@dataclass(frozen=True)
class CodeTests:
    """Built-in `code`: 1.0 when the completion's last ```python block passes the row's `key` field (Python
    asserts, a string or a list) in the sandbox, else 0.0."""

    how: str  # bwrap | rlimits-only, resolved once by isolation() in the process that builds the pool
    limits: Limits
    key: str = "tests"

    def __call__(self, completion: str, row) -> float:
        tests = _reference(row, self.key)
        if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
            tests = "\n".join(tests)
        return _code_score(completion, tests, self.how, self.limits)


@dataclass(frozen=True)
class UserReward:
    """`reward.fn` given as an import path: imported by name in each worker process (functions defined in a
    file outside any package cannot be pickled by reference, their path can), called with reward.args."""

    spec: str
    args: dict = field(default_factory=dict)  # reward.args: keyword arguments of every call

    def __call__(self, completion: str, row):
        return resolve(self.spec, "reward.fn")(completion, row, **self.args)

    def load(self) -> None:
        """Import the function now (a worker's start-up), not inside the first call's time limit."""
        resolve(self.spec, "reward.fn")


@dataclass(frozen=True)
class WeightedRewards:
    """reward.fn as a list: the reward is the weighted sum of the functions' scores; each score is returned as
    the extra `<name>` (logged as reward/<name>), and each function's own extras as `<name>/<key>`."""

    names: tuple[str, ...]
    parts: tuple  # the scorers, in reward.fn's order
    weights: tuple[float, ...]

    def __call__(self, completion: str, row) -> dict:
        out = {"score": 0.0}
        for name, part, w in zip(self.names, self.parts, self.weights):
            try:
                score, extras = as_reward(part(completion, row))
            except RewardValueError as e:
                raise RewardValueError(f"{name} {e}") from None  # which function of the list
            except Exception as e:  # a time-out is no Exception: it passes through as itself
                raise RuntimeError(f"{name} raised {type(e).__name__}: {e}") from None
            out["score"] += w * score
            out[name] = score
            out.update((f"{name}/{k}", v) for k, v in extras.items())
        return out

    def load(self) -> None:
        for part in self.parts:
            if (load := getattr(part, "load", None)) is not None:
                load()


def reward_fn_names(cfg) -> list[str]:
    """reward.fn as a list, "" replaced by the built-in the dataset implies (code for data.kind=code, else math)."""
    return [f or ("code" if cfg.data.kind == "code" else "math") for f in cfg.reward.fns()]


def check_reward_fn(cfg) -> dict[str, dict]:
    """Import each reward function of the user's and check it can be called as f(completion, row, **args), where
    args are the reward.args its signature takes (all of them for one function, or one with **kwargs): one line
    (PluginError) if not, or if no function takes one of reward.args. Returns each function's args."""
    fns = reward_fn_names(cfg)
    args, taken = {}, set()
    for i, name in enumerate(fns):
        if name in BUILTIN_REWARDS:
            continue
        key = "reward.fn" if len(fns) == 1 else f"reward.fn[{i}]"
        fn = resolve(name, key)
        mine = {k: v for k, v in cfg.reward.args.items() if len(fns) == 1 or _takes(fn, k)}
        check_signature(fn, name, key, ("completion", "row"), is_async=False, keywords=tuple(mine))
        args[name] = mine
        taken |= set(mine)
    if unused := [k for k in cfg.reward.args if k not in taken]:
        raise PluginError(f"reward.args.{unused[0]}: no function of reward.fn={cfg.reward.fn!r} takes it")
    return args


def _takes(fn, keyword: str) -> bool:
    """fn accepts `keyword` as a keyword argument (by name, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD or (p.name == keyword and p.kind in kinds) for p in params)


def reward_pool_for(cfg, cpus: frozenset[int] | None = None) -> RewardPool | EmulatedRewards:
    """The reward pool a run's config asks for: the reward function (or the weighted list) in supervised worker
    processes, or the emulated rewards of an emulated engine (its placeholder answers cannot be right). Its
    worker processes run on `cpus` (None: where this process runs).

    For code the isolation is checked here, at start-up: the run stops with one line (SandboxUnavailable)
    when reward.sandbox asks for isolation this machine cannot give.
    """
    reward_cfg = cfg.reward
    if cfg.rollout.engine == "emulated":
        return EmulatedRewards(cfg.emulation.p_correct, cfg.trainer.seed)
    args = check_reward_fn(cfg)
    names = reward_fn_names(cfg)
    timeout_s = reward_cfg.timeout_s
    parts = []
    for name in names:
        if name == "math":
            parts.append(MathAnswer(cfg.data.answer_key))
        elif name == "code":
            iso = isolation(reward_cfg.sandbox)
            log = logger.warning if iso.name != "bwrap" else logger.info
            log("code reward isolation: %s (%s)", iso.name, iso.description)
            limits = Limits(wall_s=reward_cfg.timeout_s, memory_mb=reward_cfg.code_memory_mb)
            parts.append(CodeTests(iso.name, limits, cfg.data.answer_key))
            timeout_s = reward_cfg.timeout_s + SANDBOX_SLACK_S
        else:
            parts.append(UserReward(name, args[name]))
    if len(parts) == 1 and not isinstance(reward_cfg.fn, list):
        scorer = parts[0]
    else:
        weights = tuple(float(w) for w in reward_cfg.weights) or (1.0,) * len(parts)
        scorer = WeightedRewards(tuple(reward_cfg.names()), tuple(parts), weights)
    return RewardPool(reward_cfg.num_workers, timeout_s, scorer=scorer, cpus=cpus)
