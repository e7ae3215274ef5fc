"""Chat messages to token ids through the model's chat template; the model's tool calls read by vLLM's parsers."""

from __future__ import annotations

import json
import logging
import uuid

from areal_hpc.data.prompts import after_assistant_turn, assistant_turn_end

log = logging.getLogger("areal_hpc.agents")


class ChatRenderer:
    """Renders a conversation's first prompt, and the messages that extend one after an assistant turn (only them:
    earlier turns are never rendered again). `rest_of_turn_end`: the tokens the template puts after an assistant
    turn that the model did not sample."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "workflow.fn=agent needs a chat template: the model folder's tokenizer has none "
                "(tokenizer_config.json chat_template)"
            )
        self.tokenizer = tokenizer
        self.turn_end = self._encode(assistant_turn_end(tokenizer))  # e.g. [<eos>], or Qwen's [<|im_end|>, "\n"]
        self._ends: dict[str, str] = {}  # tools' key -> the end of an assistant turn rendered with them

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template writes its own

    def prompt(self, messages: list[dict], tools) -> list[int]:
        """A whole conversation plus the assistant's generation prompt."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self._encode(text)

    def rest_of_turn_end(self, sampled: list[int]) -> list[int]:
        """What closes the model's turn as the template closes it: the template's end of an assistant turn,
        less the end token the model sampled itself (none is sampled when the turn ran into its length limit)."""
        end = self.turn_end
        if end and sampled and sampled[-1] == end[0]:
            return end[1:]
        return list(end)

    def extension(self, messages: list[dict], tools, tools_key: str) -> list[int]:
        """`messages` (the new ones, after an assistant turn) plus the generation prompt; `tools_key` names the
        tools (the end of a turn rendered with them is found once)."""
        end = self._ends.get(tools_key)
        if end is None:
            if len(self._ends) >= 64:  # agents send one or a few tool lists: a bound, not an eviction policy
                self._ends.clear()
            end = self._ends[tools_key] = assistant_turn_end(self.tokenizer, tools)
        return self._encode(after_assistant_turn(self.tokenizer, messages, tools, end))


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
        try:
            request = self._requests.get(tools_key)
            if request is None:
                if len(self._requests) >= 64:
                    self._requests.clear()
                from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

                request = self._requests[tools_key] = ChatCompletionRequest(model="policy", messages=[], tools=tools)
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
