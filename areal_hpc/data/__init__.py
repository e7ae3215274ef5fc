"""Datasets: jsonl/parquet math question+answer and jsonl code prompt+tests loaders, the synthetic arithmetic task."""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from areal_hpc.data.prompts import (
    TEMPLATE_PART,
    build_prompt,
    chat_enabled,
    check_context,
    encode_prompt,
    template_fields,
)
from areal_hpc.plugins import is_import_path


@dataclass
class Problem:
    """One dataset row as the run uses it. Row format (jsonl lines or parquet rows): a JSON object whose fields
    fill data.prompt_template (`{question}` is the data.question_key field), or which holds a chat `messages`
    list of {"role", "content"}; the reference answer (built-in rewards) under data.answer_key. Every field,
    the ones of your own included, reaches the reward function and the workflow as `row`."""

    prompt_id: int
    prompt: str  # the text fed to the model (prompt_template, then the chat template when on)
    answer: str  # the reference final answer ("" when the row has none and the reward reads the row itself)
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's tokens (set by load_dataset)
    row: dict = field(default_factory=dict)  # the dataset row, every field as read
    messages: list[dict] | None = None  # the row's chat messages, when the prompt comes from them
    # the row's 0-based position in the data file (its jsonl line, blank lines counted; its parquet row), or the
    # arithmetic problem's index: what a stored trajectory keeps to join back to its row (prompt_id counts only
    # the usable rows, so a skipped row shifts it)
    row_index: int = -1


@dataclass
class MathDataset:
    train: list[Problem]
    heldout: list[Problem]
    skipped_rows: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    too_long: int = 0  # prompts over data.max_prompt_tokens, skipped (train + held-out)
    longest_prompt: int = 0  # tokens in the longest prompt kept


def arithmetic_problems(
    n: int, max_operand: int, seed: int, start_id: int = 0, exclude=frozenset(), operator: str = "+", min_operand=0
) -> list[Problem]:
    """Problems `07+35=` (operands zero-padded to a fixed width; `*` for products), answer the result."""
    width = len(str(max_operand))
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Problem] = []
    total = (max_operand - min_operand + 1) ** 2
    if n + len(seen) > total:
        raise ValueError(
            f"asked for {n} distinct problems but operands {min_operand}..{max_operand} give only {total - len(seen)}"
        )
    while len(out) < n:
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        q, answer = f"{a:0{width}d}{operator}{b:0{width}d}=", str(a * b if operator == "*" else a + b)
        i = start_id + len(out)
        out.append(Problem(i, q, answer, row={"question": q, "answer": answer}, row_index=i))
    return out


def arithmetic_dataset(
    train_size: int, heldout_size: int, max_operand: int, seed: int, operator: str = "+", min_operand: int = 0
) -> MathDataset:
    """Disjoint train / held-out problems (held-out ids follow the train ids)."""
    kw = {"operator": operator, "min_operand": min_operand}
    heldout = arithmetic_problems(heldout_size, max_operand, seed + 10_000, start_id=train_size, **kw)
    exclude = {tuple(int(x) for x in p.prompt[:-1].split(operator)) for p in heldout}
    train = arithmetic_problems(train_size, max_operand, seed, start_id=0, exclude=exclude, **kw)
    return MathDataset(train=train, heldout=heldout)


def final_answer(raw) -> str | None:
    """A row's reference final answer: GSM8K puts it after '####'; MATH-style sets hold it directly."""
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


def _tests_text(raw) -> str | None:
    """A code task's tests: a string of Python, or a list of assert strings (joined one per line)."""
    if isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        raw = "\n".join(raw)
    return raw if isinstance(raw, str) and raw.strip() else None


MAX_ROW_BYTES = 1 << 20  # a row past 1 MiB is no prompt any model's context holds: skipped, not loaded
_NOT_UTF8, _TOO_BIG = "not UTF-8", "over 1 MiB"


def _read_rows(path: Path, kind: str):
    """(line number, row) per row: the parsed JSON, None when it is not JSON, or a skip reason (str)."""
    if kind in ("jsonl", "code"):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if len(raw) > MAX_ROW_BYTES:
                    yield lineno, _TOO_BIG
                    continue
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    yield lineno, _NOT_UTF8
                    continue
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
            big = any(isinstance(v, str) and len(v) > MAX_ROW_BYTES for v in row.values())
            yield i, _TOO_BIG if big else row


def file_rows(path: str | Path, kind: str) -> dict[int, dict]:
    """A data file's rows that are JSON objects, by row index (Problem.row_index): what stored trajectories join to."""
    return {n - 1: row for n, row in _read_rows(Path(path), kind) if isinstance(row, dict)}


def _field_text(row: dict, name: str, question_key: str) -> str | None:
    value = row.get(question_key if name == "question" and question_key in row else name)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):  # parquet's missing value
        return None
    text = str(value).strip()
    return text or None


def fill_template(template: str, row: dict, question_key: str = "question") -> tuple[str | None, str]:
    """(prompt text, "") from the row's fields, or (None, the first field missing or empty)."""
    for name in template_fields(template):
        if _field_text(row, name, question_key) is None:
            return None, (question_key if name == "question" else name)
    fill = lambda m: _field_text(row, m.group(1), question_key) if m.group(1) else m.group(0)[0]  # noqa: E731
    return TEMPLATE_PART.sub(fill, template), ""


def _messages(raw) -> list[dict] | None:
    """A row's chat `messages` (a list of {role, content} with string values), None when malformed."""
    if not isinstance(raw, list) or not raw:
        return None
    ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in raw)
    return [{"role": m["role"], "content": m["content"]} for m in raw] if ok else None


def load_math_dataset(
    path: str | Path,
    kind: str,
    question_key: str = "question",
    answer_key: str = "answer",
    prompt_template: str = "{question}",
    heldout_size: int = 500,
    seed: int = 0,
    need_answer: bool = True,
) -> MathDataset:
    """Load rows from jsonl or parquet (kind=code: jsonl rows with tests); each Problem keeps its whole row.

    The prompt is `prompt_template` over the row's fields, or the row's chat `messages` when it has them.
    `need_answer` (a built-in reward): the row must hold a reference under `answer_key`. Malformed rows are
    skipped and counted; the warning names the first one's file, line and field.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    if not template_fields(prompt_template):
        raise ValueError(f"data.prompt_template must name a row field such as '{{question}}', got {prompt_template!r}")
    problems: list[Problem] = []
    reasons: dict[str, int] = {}
    first: list[str] = []

    def skip(lineno: int, why: str) -> None:
        reasons[why] = reasons.get(why, 0) + 1
        if not first:
            first.append(f"{p}:{lineno}: {why}")

    for lineno, row in _read_rows(p, kind):
        if isinstance(row, str):
            skip(lineno, row)
            continue
        if not isinstance(row, dict):
            skip(lineno, "not a JSON object")
            continue
        messages = None
        if "messages" in row:
            messages = _messages(row["messages"])
            if messages is None:
                skip(lineno, "'messages' is not a list of {role, content} strings")
                continue
            text = ""
        else:
            text, missing = fill_template(prompt_template, row, question_key)
            if text is None:
                skip(lineno, f"missing or empty '{missing}'")
                continue
        a = _tests_text(row.get(answer_key)) if kind == "code" else final_answer(row.get(answer_key))
        if a is None and need_answer:
            skip(lineno, f"missing or empty '{answer_key}'")
            continue
        problems.append(Problem(len(problems), text, a or "", row=row, messages=messages, row_index=lineno - 1))
    skipped = sum(reasons.values())
    detail = ", ".join(f"{n} {why}" for why, n in reasons.items())
    if not problems:  # one line with the reasons (no warning first)
        raise ValueError(
            f"dataset {str(p)!r} has no usable rows (keys {question_key!r}/{answer_key!r}); "
            f"skipped {skipped}" + (f": {detail}; first at {first[0]}" if detail else "")
        )
    if skipped:
        warnings.warn(
            f"dataset {p.name}: skipped {skipped} malformed rows ({detail}); first at {first[0]}", stacklevel=2
        )
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    n_held = min(heldout_size, len(problems) // 2)
    held = [problems[i] for i in sorted(order[:n_held])]
    train = [problems[i] for i in sorted(order[n_held:])]
    return MathDataset(train=train, heldout=held, skipped_rows=skipped, skip_reasons=reasons)


def load_dataset(data_cfg, tokenizer, need_answer: bool = True) -> MathDataset:
    """The dataset named by a DataConfig, prompts built and tokenized; prompts over data.max_prompt_tokens skipped.

    need_answer: rows must carry a reference answer (false when a user's reward.fn reads the row itself)."""
    return build_prompts(read_dataset(data_cfg, need_answer), tokenizer, data_cfg)


def read_dataset(data_cfg, need_answer: bool = True) -> MathDataset:
    """The dataset's rows as problems, split into train and held-out, before any prompt is built (no tokenizer)."""
    if data_cfg.kind == "arithmetic":
        dc = data_cfg
        return arithmetic_dataset(dc.train_size, dc.heldout_size, dc.max_operand, dc.seed, dc.operator, dc.min_operand)
    return load_math_dataset(
        data_cfg.path,
        data_cfg.kind,
        data_cfg.question_key,
        data_cfg.answer_key,
        data_cfg.prompt_template,
        data_cfg.heldout_size,
        data_cfg.seed,
        need_answer=need_answer,
    )


def rows_need_answer(cfg) -> bool:
    """A run's rows need a reference answer unless every reward function is the user's own (it reads the row)."""
    return not all(is_import_path(f) for f in cfg.reward.fns())


def load_run_dataset(cfg, tokenizer) -> MathDataset:
    """A run's dataset, the same on every rank: rows need a reference answer unless reward.fn is the user's own."""
    return load_dataset(cfg.data, tokenizer, need_answer=rows_need_answer(cfg))


def build_prompts(ds: MathDataset, tokenizer, data_cfg) -> MathDataset:
    """Every prompt through the same builder (chat template when on) and tokenized; over-long ones counted out."""
    chat = chat_enabled(tokenizer, data_cfg.chat_template, data_cfg.system_prompt)
    limit = data_cfg.max_prompt_tokens
    too_long = 0

    def keep(problems: list[Problem]) -> list[Problem]:
        nonlocal too_long
        out = []
        for p in problems:
            if p.messages is not None and not chat:
                raise ValueError(
                    f"dataset row {p.prompt_id} has chat 'messages' but prompts use no chat template "
                    f"(data.chat_template={data_cfg.chat_template}); set data.chat_template=on or auto"
                )
            p.prompt = build_prompt(tokenizer, p.prompt, chat, data_cfg.system_prompt, p.messages)
            p.prompt_ids = encode_prompt(tokenizer, p.prompt, chat)
            if limit and len(p.prompt_ids) > limit:
                too_long += 1
            else:
                out.append(p)
        return out

    ds.train, ds.heldout = keep(ds.train), keep(ds.heldout)
    if too_long:
        why = f"longer than data.max_prompt_tokens={limit}"
        ds.skip_reasons[why] = ds.skip_reasons.get(why, 0) + too_long
        ds.skipped_rows += too_long
        ds.too_long = too_long
        warnings.warn(f"dataset: skipped {too_long} prompts {why} tokens", stacklevel=2)
    if not ds.train:
        raise ValueError(f"no training prompt is left: all are longer than data.max_prompt_tokens={limit} tokens")
    ds.longest_prompt = max(len(p.prompt_ids) for p in ds.train + ds.heldout)
    return ds


def check_fits_context(ds: MathDataset, cfg, model_dir) -> None:
    """One line refusing a run whose prompts + rollout.max_new_tokens overflow the model's context."""
    if cfg.rollout.engine == "emulated":
        return  # the model folder stands only for a vocabulary; the emulated context is the cost model's
    limit, mnt = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    if limit:
        check_context(model_dir, limit, mnt, "data.max_prompt_tokens")
    else:
        check_context(model_dir, ds.longest_prompt, mnt, "the longest in the dataset")


def check_prompts_fit(cfg, model_dir):
    """The start-up check the launchers run once, before any rank starts work; returns the dataset it checked
    (None for the emulated engine, which checks nothing), so a caller that needs it does not tokenize it again."""
    from areal_hpc.model import load_tokenizer

    if cfg.rollout.engine == "emulated":
        return None
    dataset = load_run_dataset(cfg, load_tokenizer(model_dir))
    check_fits_context(dataset, cfg, model_dir)
    return dataset
