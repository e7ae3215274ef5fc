"""The warm start's targets: the text its supervised steps teach for a row, from trainer.warm_start_template."""

from __future__ import annotations

import json
import random

from areal_hpc.data import Problem, fill_template, read_dataset, rows_need_answer, template_fields

# the built-in math reward's form: the last \boxed{} of an answer against the reference (arithmetic: the same)
DEFAULT_TEMPLATE = "\\boxed{{{answer}}}"


class WarmStartError(ValueError):
    """Rows lacking what the warm start's template names: one line naming the field and the settings to change."""


def warm_start_template(cfg) -> str:
    """trainer.warm_start_template, or the built-in reward's form when it is empty."""
    return cfg.trainer.warm_start_template or DEFAULT_TEMPLATE


def target_text(template: str, p: Problem, data_cfg) -> tuple[str | None, str]:
    """(the text the warm start trains on for p, "") or (None, the field its row lacks). {answer} is the problem's
    reference answer (data.answer_key's, "" when the row has none), any other name the row's field."""
    text, missing = fill_template(template, {**p.row, "answer": p.answer}, data_cfg.question_key)
    if text is None and missing == "answer":
        missing = data_cfg.answer_key  # the field the user's rows would need
    return text, missing


def calculator_call(expression: str) -> str:
    """A Hermes-style call of the agent demo's calculator tool, as vLLM's hermes parser reads it and the tiny
    model's arith_agent vocabulary spells it (json.dumps's spaces are dropped there)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return "<tool_call>" + json.dumps(call) + "</tool_call>"


def warm_start_segments(p: Problem, target: str, cfg, rng: random.Random, tokenizer) -> list:
    """The reference episode of one problem after its prompt, as the workflow's transcript Segments: its target,
    or for the arithmetic task under the `tool` or `agent` workflow (a share workflow.warm_start_tool_share of
    them) a tool call whose output is not trained, then the target. The tool's output is the ids the workflow
    appends: `tool`'s observation text, `agent`'s result rendered by the chat template after an assistant turn."""
    from areal_hpc.workflow.builtin import CODE_CLOSE, tool_observation
    from areal_hpc.workflow.records import Segment
    from areal_hpc.workflow.text import render_turn

    def text(t: str, trained: bool) -> Segment:
        return Segment(list(tokenizer.encode(t, add_special_tokens=False)), trained)

    workflow = cfg.workflow.fn if cfg.data.kind == "arithmetic" else ""
    if workflow not in ("tool", "agent") or rng.random() >= cfg.workflow.warm_start_tool_share:
        return [text(target, True)]
    expression = p.row["question"].rstrip("=")
    if workflow == "agent":
        # the call turn ends with EOS (the endpoint returns the call there); the result turn ends in the next prompt
        result = Segment(render_turn(tokenizer, "tool", p.answer, chat=True), False)
        return [text(calculator_call(expression) + tokenizer.eos_token, True), result, text(target, True)]
    call = f"```python\nprint({expression})\n{CODE_CLOSE}"
    return [text(call, True), text(tool_observation(p.answer), False), text(target, True)]


def warm_start_example(p: Problem, target: str, cfg, rng: random.Random, tokenizer) -> tuple[list[int], list[int]]:
    """One supervised example's token ids and loss mask: the prompt (as every rollout's), the reference episode,
    EOS; built as the workflow builds a trajectory."""
    from areal_hpc.workflow.records import Segment
    from areal_hpc.workflow.samples import ids_and_mask

    eos = Segment([tokenizer.eos_token_id], True)
    return ids_and_mask([Segment(list(p.prompt_ids), False), *warm_start_segments(p, target, cfg, rng, tokenizer), eos])


def warm_start_targets(examples: list[Problem], cfg, source: str = "") -> list[str]:
    """The target of every warm-start example; WarmStartError (one line) when any of their rows lacks a field
    the template names. `source`: where the rows come from, for the message."""
    template = warm_start_template(cfg)
    targets, lacking, field = [], 0, ""
    for p in examples:
        text, missing = target_text(template, p, cfg.data)
        if text is None:
            lacking, field = lacking + 1, field or missing
        targets.append(text or "")
    if lacking:
        default = "" if cfg.trainer.warm_start_template else " (the default: the built-in math reward's form)"
        key = " (data.answer_key)" if field == cfg.data.answer_key and "answer" in template_fields(template) else ""
        raise WarmStartError(
            f"config trainer.warm_start_steps={cfg.trainer.warm_start_steps} trains on "
            f"trainer.warm_start_template={template}{default}, but {lacking} of its {len(examples)} example rows"
            f"{source} have no {field!r}{key}; set trainer.warm_start_steps=0 to start RL without a warm start, "
            "or point data.answer_key or trainer.warm_start_template at your rows' fields"
        )
    return targets


def check_warm_start(cfg) -> None:
    """The start-up check, before a run directory is written: every warm-start example has its target."""
    if not cfg.trainer.warm_start_steps:
        return
    ds = read_dataset(cfg.data, need_answer=rows_need_answer(cfg))
    source = f" of {cfg.data.path}" if cfg.data.kind != "arithmetic" else ""
    warm_start_targets(ds.train[: cfg.trainer.warm_start_examples], cfg, source)
