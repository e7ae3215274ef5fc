"""The messages between the generator and the endpoint's process: typed records, checked on send and on receive.

generator -> endpoint's process
  StartAgent     key, row                      an episode opened: its agent starts under its key
  CloseSession   key                           the episode ended: its key is refused, its agent cancelled
  CallAnswered   call, answer (Answer)         a call's answer from the episode's session
  CallRefused    call, error (OpenAIError)     a call refused (an ended episode, a bad request)
  Quit                                         the endpoint's process ends
endpoint's process -> generator
  Ready          port                          the HTTP server listens (the first message)
  Failed         what                          it could not start (the first message, and the last)
  ChatCall       call, key, request, t_received  a checked chat request of an open episode (its monotonic
                                               arrival time: the endpoint's latency figure)
  TokenCall      call, key, request, t_received  a checked token-route request (TokenRequest), likewise
  AgentDone      key, outcome (AgentOutcome)   an episode's agent ended
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, fields

from areal_hpc.agents.protocol import Answer, ChatRequest, OpenAIError
from areal_hpc.agents.running import AgentOutcome
from areal_hpc.agents.token_route import TokenRequest


class PipeError(RuntimeError):
    """A pipe message that is not one of the records its direction carries, or a field of the wrong type."""


@dataclass(frozen=True)
class StartAgent:
    key: str
    row: dict


@dataclass(frozen=True)
class CloseSession:
    key: str


@dataclass(frozen=True)
class CallAnswered:
    call: int
    answer: Answer


@dataclass(frozen=True)
class CallRefused:
    call: int
    error: OpenAIError


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class Ready:
    port: int


@dataclass(frozen=True)
class Failed:
    what: str


@dataclass(frozen=True)
class ChatCall:
    call: int
    key: str
    request: ChatRequest
    t_received: float


@dataclass(frozen=True)
class TokenCall:
    call: int
    key: str
    request: TokenRequest
    t_received: float


@dataclass(frozen=True)
class AgentDone:
    key: str
    outcome: AgentOutcome


TO_HOST = (StartAgent, CloseSession, CallAnswered, CallRefused, Quit)
TO_GENERATOR = (Ready, Failed, ChatCall, TokenCall, AgentDone)


@functools.cache
def _field_types(record: type) -> dict[str, type]:
    hints = typing.get_type_hints(record)  # this module's names: the records' field types
    return {f.name: hints[f.name] for f in fields(record)}


def check(msg, allowed: tuple[type, ...]) -> None:
    """PipeError (one line) unless `msg` is one of the `allowed` records with every field of its type."""
    if type(msg) not in allowed:
        names = ", ".join(r.__name__ for r in allowed)
        raise PipeError(f"agent pipe: a {type(msg).__name__} where the protocol carries {names}")
    for name, want in _field_types(type(msg)).items():
        value = getattr(msg, name)
        # a bool is no number here; an int is a float's value (a clock read as a whole second)
        ok = isinstance(value, (int, float) if want is float else want) and not (
            isinstance(value, bool) and want in (int, float)
        )
        if not ok:
            what = f"{type(msg).__name__}.{name} is a {type(value).__name__}"
            raise PipeError(f"agent pipe: {what}, the protocol says {want.__name__}")


def send(conn, msg, allowed: tuple[type, ...]) -> None:
    """`msg` checked, then sent on the connection."""
    check(msg, allowed)
    conn.send(msg)


def receive(conn, allowed: tuple[type, ...]):
    """The next message on the connection, checked."""
    msg = conn.recv()
    check(msg, allowed)
    return msg
