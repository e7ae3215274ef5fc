"""Chat messages to token ids through the model's chat template; the model's tool calls read by vLLM's parsers."""

from __future__ import annotations

import json
import logging
import uuid

log = logging.getLogger("areal_hpc.agents")

_MARK = "\u00a7"  # an assistant turn's stand-in content: where the template's end of an assistant turn begins


class ChatRenderer:
    """Renders a conversation's first prompt, and the messages that extend one after an assistant turn (the
    difference between the template's rendering with and without them, so earlier turns are never rendered
    again). `glue`: the tokens the template puts after an assistant turn, which the model did not sample."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "rollout.workflow=agent needs a chat template: the model folder's tokenizer has none "
                "(tokenizer_config.json chat_template)"
            )
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        rendered = self._render(base, None, generation_prompt=False)
        tail = rendered[rendered.rindex(_MARK) + len(_MARK) :]
        self.turn_end = self._encode(tail)  # e.g. [<eos>], or Qwen's [<|im_end|>, "\n"]
        self._before: dict[str, str] = {}  # tools' key -> the base conversation rendered with them (per call: slow)

    def _render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template writes its own

    def prompt(self, messages: list[dict], tools) -> list[int]:
        """A whole conversation plus the assistant's generation prompt."""
        return self._encode(self._render(messages, tools, generation_prompt=True))

    def glue(self, sampled: list[int]) -> list[int]:
        """What closes the model's turn as the template closes it: the template's end of an assistant turn,
        less the end token the model sampled itself (none is sampled when the turn ran into its length limit)."""
        end = self.turn_end
        if end and sampled and sampled[-1] == end[0]:
            return end[1:]
        return list(end)

    def extension(self, messages: list[dict], tools, tools_key: str) -> list[int]:
        """`messages` (the new ones, after an assistant turn) plus the generation prompt; `tools_key` names the
        tools (the base conversation's rendering with them is made once)."""
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        before = self._before.get(tools_key)
        if before is None:
            if len(self._before) >= 64:  # agents send one or a few tool lists: a bound, not an eviction policy
                self._before.clear()
            before = self._before[tools_key] = self._render(base, tools, generation_prompt=False)
        after = self._render(base + messages, tools, generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template renders earlier turns differently once messages follow them")
        return self._encode(after[len(before) :])


def template_messages(messages: list[dict]) -> list[dict]:
    """Normalised messages as chat templates read them: tool calls' arguments as objects (templates write them
    with tojson), content as text."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class ToolCallReader:
    """The model's tool-call markup in its own chat format, read by vLLM's tool parser of that name
    (workflow.tool_parser; `none` reads none). Output that does not parse comes back as content, as vLLM's
    server returns it."""

    def __init__(self, name: str, tokenizer):
        self.name = name
        self.parser = None
        if name != "none":
            self.parser = tool_parser_class(name)(tokenizer)
        self._requests: dict[str, object] = {}  # tools' key -> the request record the parser reads (slow to make)

    def read(self, text: str, tools, tools_key: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls as OpenAI returns them) of one answer."""
        if self.parser is None or not tools:
            return text, []
        request = self._requests.get(tools_key)
        if request is None:
            if len(self._requests) >= 64:
                self._requests.clear()
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            request = self._requests[tools_key] = ChatCompletionRequest(model="policy", messages=[], tools=tools)
        try:
            info = self.parser.extract_tool_calls(text, request)
        except Exception as e:  # a parser's own failure: the answer stays content, as vLLM's server does
            log.debug("tool parser %s failed: %s", self.name, e)
            return text, []
        if not info.tools_called:
            return text, []
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in info.tool_calls
        ]
        return info.content or None, calls


def tool_parser_class(name: str):
    """vLLM's tool parser called `name`; ValueError (one line) naming the ones there are."""
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        names = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"workflow.tool_parser={name!r} is not one of vLLM's parsers ({names}), or none") from None
