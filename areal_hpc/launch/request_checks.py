"""Every check of a job request at once (render, submit, resume): the user fixes all problems in one go."""

from __future__ import annotations

from areal_hpc.config import Config
from areal_hpc.launch.sizing import sizing_problems
from areal_hpc.launch.slurm import SlurmError, render_target_problem, request_problems


class RequestRefused(SlurmError):
    """A request with several problems: 'VERB refused: N problems:' then one indented line each. A request
    with one problem raises a plain SlurmError of that one line."""

    def __init__(self, verb: str, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join([f"{verb} refused: {len(problems)} problems:", *(f"  {p}" for p in problems)]))


def all_problems(cfg: Config, cluster: bool = True, target: bool = False) -> list[str]:
    """The run dir (target: a rendered script's), the request against the cluster (cluster: sinfo is asked)
    and the sizing, in that order; nothing is written."""
    problems = []
    if target and (problem := render_target_problem(cfg)) is not None:
        problems.append(problem)
    if cluster:
        problems += request_problems(cfg)[1]
    return problems + sizing_problems(cfg)


def check_all(cfg: Config, verb: str, cluster: bool = True, target: bool = False) -> None:
    """SlurmError with the one problem, or RequestRefused listing them all; nothing when the request is fine."""
    problems = all_problems(cfg, cluster, target)
    if len(problems) == 1:
        raise SlurmError(problems[0])
    if problems:
        raise RequestRefused(verb, problems)


def refusal_text(err: Exception) -> str:
    """What a command prints for an error: every problem of a refused request, else the error's first line."""
    return str(err) if isinstance(err, RequestRefused) else str(err).splitlines()[0]
