"""Math datasets: jsonl/parquet question+answer loaders and the synthetic arithmetic task."""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Problem:
    prompt_id: int
    prompt: str  # the text fed to the model (template applied)
    answer: str  # the reference final answer, compared by the reward


@dataclass
class MathDataset:
    train: list[Problem]
    heldout: list[Problem]
    skipped_rows: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)


def arithmetic_problems(n: int, max_operand: int, seed: int, start_id: int = 0, exclude=frozenset()) -> list[Problem]:
    """Addition problems `07+35=` (operands zero-padded to a fixed width), answer the sum."""
    width = len(str(max_operand))
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Problem] = []
    total = (max_operand + 1) ** 2
    if n + len(seen) > total:
        raise ValueError(f"asked for {n} distinct problems but operands 0..{max_operand} give only {total - len(seen)}")
    while len(out) < n:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append(Problem(start_id + len(out), f"{a:0{width}d}+{b:0{width}d}=", str(a + b)))
    return out


def arithmetic_dataset(train_size: int, heldout_size: int, max_operand: int, seed: int) -> MathDataset:
    """Disjoint train / held-out addition problems (held-out ids follow the train ids)."""
    heldout = arithmetic_problems(heldout_size, max_operand, seed + 10_000, start_id=train_size)
    exclude = {tuple(int(x) for x in p.prompt[:-1].split("+")) for p in heldout}
    train = arithmetic_problems(train_size, max_operand, seed, start_id=0, exclude=exclude)
    return MathDataset(train=train, heldout=heldout)


def arithmetic_completion(answer: str) -> str:
    """The completion a correct policy writes for the arithmetic task (used by the warm start)."""
    return "\\boxed{" + answer + "}"


def _final_answer(raw) -> str | None:
    """GSM8K puts the final answer after '####'; MATH-style sets hold it directly."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return str(raw)
    if isinstance(raw, float):  # parquet numbers; NaN is a missing value
        if not math.isfinite(raw):
            return None
        return str(int(raw)) if raw.is_integer() else str(raw)
    if not isinstance(raw, str):
        return None
    text = raw.split("####")[-1].strip() if "####" in raw else raw.strip()
    return text or None


def _read_rows(path: Path, kind: str):
    if kind == "jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    yield lineno, None
                    continue
                yield lineno, row
    else:
        import pandas as pd

        for i, row in enumerate(pd.read_parquet(path).to_dict("records"), 1):
            yield i, row


def load_math_dataset(
    path: str | Path,
    kind: str,
    question_key: str = "question",
    answer_key: str = "answer",
    prompt_template: str = "{question}",
    heldout_size: int = 500,
    seed: int = 0,
) -> MathDataset:
    """Load question/answer rows from jsonl or parquet; malformed rows are skipped and counted."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    if "{question}" not in prompt_template:
        raise ValueError(f"data.prompt_template must contain '{{question}}', got {prompt_template!r}")
    problems: list[Problem] = []
    reasons: dict[str, int] = {}

    def skip(why: str) -> None:
        reasons[why] = reasons.get(why, 0) + 1

    for _, row in _read_rows(p, kind):
        if not isinstance(row, dict):
            skip("not a JSON object")
            continue
        q = row.get(question_key)
        if not isinstance(q, str) or not q.strip():
            skip(f"missing or empty '{question_key}'")
            continue
        a = _final_answer(row.get(answer_key))
        if a is None:
            skip(f"missing or empty '{answer_key}'")
            continue
        problems.append(Problem(len(problems), prompt_template.replace("{question}", q.strip()), a))
    skipped = sum(reasons.values())
    if skipped:
        detail = ", ".join(f"{n} {why}" for why, n in reasons.items())
        warnings.warn(f"dataset {p.name}: skipped {skipped} malformed rows ({detail})", stacklevel=2)
    if not problems:
        raise ValueError(
            f"dataset {str(p)!r} has no usable rows (keys {question_key!r}/{answer_key!r}); skipped {skipped}"
        )
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    n_held = min(heldout_size, len(problems) // 2)
    held = [problems[i] for i in sorted(order[:n_held])]
    train = [problems[i] for i in sorted(order[n_held:])]
    return MathDataset(train=train, heldout=held, skipped_rows=skipped, skip_reasons=reasons)


def load_dataset(data_cfg) -> MathDataset:
    """The dataset named by a DataConfig."""
    if data_cfg.kind == "arithmetic":
        return arithmetic_dataset(data_cfg.train_size, data_cfg.heldout_size, data_cfg.max_operand, data_cfg.seed)
    return load_math_dataset(
        data_cfg.path,
        data_cfg.kind,
        data_cfg.question_key,
        data_cfg.answer_key,
        data_cfg.prompt_template,
        data_cfg.heldout_size,
        data_cfg.seed,
    )
