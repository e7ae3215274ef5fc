"""The `agent` workflow: an agent written against the OpenAI API runs once per episode on this generator's endpoint."""

from __future__ import annotations

import asyncio
import logging
import shlex
import shutil

from areal_hpc.agents.endpoint import Endpoint
from areal_hpc.agents.running import ENDED, STOPPED, AgentOutcome, load_agent
from areal_hpc.agents.session import AgentSession
from areal_hpc.agents.transcript import tool_parser_class
from areal_hpc.workflow.episode import Episode
from areal_hpc.workflow.failures import EndpointLost, EpisodeFailed
from areal_hpc.workflow.records import EpisodeFailure
from areal_hpc.workflow.runner import RunnerServices

log = logging.getLogger("areal_hpc.workflow")


def check_agent_config(wc) -> None:
    """The start-up check (config checks have checked the settings' form): the agent imports and has the
    signature, or the command's program exists; the tool parser exists. One line (ValueError) if not."""
    if wc.agent:
        load_agent(wc)
    else:
        try:
            argv = shlex.split(wc.agent_command)
        except ValueError as e:
            raise ValueError(f"workflow.agent_command={wc.agent_command!r} does not split into words: {e}") from None
        if not argv or shutil.which(argv[0]) is None:
            raise ValueError(
                f"workflow.agent_command={wc.agent_command!r}: {argv[0] if argv else 'nothing'!r} is not a program "
                "found on PATH (or an executable file)"
            )
    if wc.tool_parser != "none":
        tool_parser_class(wc.tool_parser)


class AgentEndpoint:
    """The runner's endpoint (one per episode runner, closed with it: Episode.service)."""

    def __init__(self, services: RunnerServices):
        s = services.settings
        if s.config is None:
            raise ValueError("workflow.fn=agent needs the run's config in its runner's settings (`config`)")
        self.endpoint = Endpoint(services.tokenizer, s.config, s.max_context, services.call_in_loop)
        self.wait = services.wait
        self.stopping = False  # its process was ended by the job's stop signal (said once)
        # vLLM's parsers log a traceback for every answer that does not parse (returned as content, as meant)
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)
        log.info("agent endpoint at %s", self.endpoint.base_url)

    async def run_agent(self, session: AgentSession, row: dict) -> AgentOutcome:
        """The episode's agent, run to its outcome on the endpoint's process (cancelled with the episode)."""
        return await self.wait(self.endpoint.start_agent(session, row))

    def close(self) -> None:
        self.endpoint.shutdown()


async def agent(ep: Episode) -> float | None:
    """workflow.fn=agent: the episode's session is opened, the agent runs against it, and its result
    becomes the episode's reward: a float as it is, a string scored by reward.fn with the row, None rejects
    the episode. An agent that fails (raises, hangs past workflow.agent_timeout_s, returns or prints something
    else) costs its episode only: it fails (EpisodeFailed), is counted against workflow.max_failure_share, and
    runs again."""
    shared: AgentEndpoint = ep.service(AgentEndpoint)
    session = shared.endpoint.open(ep)
    try:
        outcome = await shared.run_agent(session, ep.row)
    except RuntimeError as e:  # the job cancelled on the endpoint's side (its loop shutting down): as before, a try
        raise EpisodeFailed(EpisodeFailure("raised", f"it stopped: {e}", source="agent")) from None
    finally:
        shared.endpoint.close(session)
    ep.stats.branches += session.branches
    if outcome.kind == STOPPED:  # the job is stopping: this rank ends too, and the episode with it
        if not shared.stopping:
            shared.stopping = True
            log.info("%s as the job stops: its episodes are given up", outcome.failure)
        raise asyncio.CancelledError
    if outcome.kind == ENDED:
        raise EndpointLost(outcome.failure)
    if outcome.failure:
        raise EpisodeFailed(EpisodeFailure(outcome.kind, outcome.failure, outcome.where, source="agent"))
    if isinstance(outcome.value, str):
        return await ep.reward(outcome.value)
    return outcome.value
