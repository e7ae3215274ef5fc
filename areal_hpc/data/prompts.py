"""Prompt building: the tokenizer's chat template, prompt token ids, and length limits against the model's context."""

from __future__ import annotations

import json
import re
from pathlib import Path

CHAT_TEMPLATE_MODES = ("auto", "on", "off")  # data.chat_template
# a template over a row's fields (data.prompt_template, trainer.warm_start_template), read left to right: {{ and }}
# stand for literal braces, {field} for a row's field, so a field can sit inside literal braces
# (\boxed{{{answer}}} is \boxed{ + the answer + })
TEMPLATE_PART = re.compile(r"\{\{|\}\}|\{(\w+)\}")


def template_fields(template: str) -> list[str]:
    """The row fields a template names, in order ({question} is the data.question_key field)."""
    return list(dict.fromkeys(m.group(1) for m in TEMPLATE_PART.finditer(template) if m.group(1)))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_enabled(tokenizer, mode: str, system_prompt: str = "") -> bool:
    """Whether prompts go through the tokenizer's chat template (auto: when the tokenizer has one)."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"data.chat_template={mode!r} is not allowed; choose one of {', '.join(CHAT_TEMPLATE_MODES)}")
    if mode == "on" and not has_chat_template(tokenizer):
        raise ValueError("data.chat_template=on but the model folder's tokenizer has no chat template; use auto or off")
    chat = has_chat_template(tokenizer) if mode == "auto" else mode == "on"
    if system_prompt and not chat:
        # without a template there is no place for a system turn that the model was trained to read
        raise ValueError(
            "data.system_prompt is set but prompts use no chat template; set data.chat_template=on or auto"
        )
    return chat


def build_prompt(tokenizer, text: str, chat: bool, system_prompt: str = "", messages: list[dict] | None = None) -> str:
    """The text fed to the model: `text` as the user's turn (or the row's own chat `messages`) plus the
    generation prompt, or `text` itself without a chat template."""
    if not chat:
        return text
    if messages is None:
        messages = [{"role": "user", "content": text}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a built prompt; a chat template writes its own special tokens (BOS included), so none are added."""
    return list(tokenizer.encode(prompt, add_special_tokens=not chat))


def max_context(model_dir: str | Path) -> int | None:
    """The model's context length (config.json's max_position_embeddings), None when it declares none."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    n = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(n) if n else None


def check_context(model_dir: str | Path, longest_prompt: int, max_new_tokens: int, limit_key: str) -> None:
    """Refuse, in one line, a run whose longest prompt + rollout.max_new_tokens does not fit the model's context."""
    ctx = max_context(model_dir)
    if ctx is not None and longest_prompt + max_new_tokens > ctx:
        raise ValueError(
            f"prompts of up to {longest_prompt} tokens ({limit_key}) + rollout.max_new_tokens={max_new_tokens} = "
            f"{longest_prompt + max_new_tokens} tokens do not fit the model's max_position_embeddings={ctx} "
            f"({Path(model_dir) / 'config.json'}); lower data.max_prompt_tokens or rollout.max_new_tokens"
        )


_MARK = "\u00a7"  # an assistant turn's stand-in content: where the template's end of that turn begins
_AFTER = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]


def assistant_turn_end(tokenizer, tools=None) -> str:
    """The text a chat template puts after an assistant turn's content (`<eos>`, Qwen's `<|im_end|>` + newline)."""
    closed = tokenizer.apply_chat_template(_AFTER, tools=tools, tokenize=False)
    return closed[closed.rindex(_MARK) + len(_MARK) :]


def after_assistant_turn(tokenizer, messages: list[dict], tools=None, end: str | None = None) -> str:
    """`messages` after an assistant turn, plus the next assistant prompt, as the chat template renders them in
    a conversation: the text after that turn's end (`end`, default `assistant_turn_end`), so earlier turns are
    never rendered again, whatever the template does to a last assistant turn (Qwen3's empty think block)."""
    end = assistant_turn_end(tokenizer, tools) if end is None else end
    conversation = _AFTER + list(messages)
    full = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=False)
    i = full.index(_MARK) + len(_MARK)
    if not full.startswith(end, i):
        raise ValueError("the chat template ends an assistant turn differently once messages follow it")
    return full[i + len(end) :]
