"""The calculator agent as a command (workflow.agent_command), standard library only: the row as JSON on stdin,
the endpoint from OPENAI_BASE_URL and OPENAI_API_KEY, the final answer as the last line of stdout."""

import json
import os
import re
import sys
import urllib.request

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "The value of a product of whole numbers.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def chat(messages: list[dict]) -> dict:
    """One chat completion from the episode's endpoint: the assistant message."""
    body = json.dumps({"model": "policy", "messages": messages, "tools": [CALCULATOR]}).encode()
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=body,
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)["choices"][0]["message"]


def product(arguments: str) -> str:
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, KeyError, TypeError):
        return "error: arguments must be {'expression': '...'}"
    if not isinstance(expression, str) or not re.fullmatch(r"\d+(\*\d+)*", expression.replace(" ", "")):
        return "error: not a product of whole numbers"
    value = 1
    for factor in expression.replace(" ", "").split("*"):
        value *= int(factor)
    return str(value)


def main() -> None:
    row = json.load(sys.stdin)
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(3):
        message = chat(messages)
        if not message.get("tool_calls"):
            print(json.dumps({"answer": message.get("content") or ""}))
            return
        messages.append(message)
        for call in message["tool_calls"]:
            result = product(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    print(json.dumps({"answer": ""}))


if __name__ == "__main__":
    main()
