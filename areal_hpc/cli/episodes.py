"""`areal-hpc episodes`: a few stored episodes printed as a person reads them, trained text told from the rest."""

from __future__ import annotations

import sys

import click

# Without colour every line of a segment starts with its kind, padded to one width, so trained text can be grepped
# and the text itself starts in one column; with colour the text flows as the model read it.
MARKERS = {"prompt": "[prompt]    ", "trained": "[trained]   ", "untrained": "[untrained] "}
STYLES = {"prompt": {"dim": True}, "trained": {"fg": "green"}, "untrained": {"dim": True}}
ROW_FIELD_CHARS = 80  # a long row field (a whole problem statement, test cases) is cut in the header


def parse_versions(spec: str) -> tuple[int | None, int | None]:
    """A:B, A:, :B or A (that version alone) as (low, high); ClickException in one line otherwise."""
    lo, sep, hi = spec.partition(":")
    try:
        low = int(lo) if lo.strip() else None
        high = (int(hi) if hi.strip() else None) if sep else low
    except ValueError:
        raise click.ClickException(f"--versions {spec!r}: give A:B, A:, :B or A (whole versions)") from None
    if low is not None and high is not None and low > high:
        raise click.ClickException(f"--versions {spec!r}: {low} is after {high}")
    return low, high


def _kind(segment) -> str:
    return "prompt" if segment.prompt else "trained" if segment.trained else "untrained"


def header(ep) -> str:
    """One line: which episode, its reward, the versions that sampled it, what it did."""
    staleness = f"staleness {ep.staleness}" if ep.staleness is not None else "not consumed"
    failures = [f"{k} {getattr(ep.counts, k)}" for k in ("tool_errors", "reward_errors", "reward_timeouts")]
    failed = ", ".join(f for f in failures if not f.endswith(" 0"))
    parts = [
        f"episode {ep.group_id}:{ep.sample_idx}",
        f"prompt {ep.prompt_id}",
        f"reward {ep.reward:g}",
        f"versions {ep.version_start}..{ep.version_end}",
        staleness,
        f"finish {ep.finish_reason}",
        f"turns {ep.counts.turns}",
        f"tool calls {ep.counts.tool_calls}",
        f"errors {ep.failures}" + (f" ({failed})" if failed else ""),
    ]
    if ep.branches:
        parts.append(f"transcripts {len(ep.transcripts)}")
    return "  ".join(parts)


def row_line(row: dict) -> str:
    fields = []
    for k, v in row.items():
        text = " ".join(str(v).split())
        fields.append(f"{k}={text[:ROW_FIELD_CHARS] + '...' if len(text) > ROW_FIELD_CHARS else text}")
    return "row: " + "  ".join(fields)


def transcript_lines(transcript, color: bool) -> list[str]:
    """A transcript's segments: coloured and flowing as the model read them, or one marked block each."""
    if color:
        return ["".join(click.style(s.text, **STYLES[_kind(s)]) for s in transcript.segments)]
    out = []
    for s in transcript.segments:
        marker = MARKERS[_kind(s)]
        out += [marker + line for line in s.text.split("\n")]
    return out


@click.command("episodes")
@click.argument("run_dir")
@click.option("-n", "--n", "n", default=3, show_default=True, type=click.IntRange(min=1), help="Episodes to print.")
@click.option("--lowest", is_flag=True, help="Lowest reward first (default: as stored).")
@click.option("--failed", is_flag=True, help="Only episodes with a tool error, a reward error or a reward time-out.")
@click.option("--prompt", "prompt_id", type=int, help="Only the episodes of this prompt id.")
@click.option("--versions", help="Only episodes sampled in part by weights A..B (A:B, A:, :B or A).")
@click.option("--rows", "rows_path", type=click.Path(dir_okay=False), help="The run's data file, where it moved.")
@click.option("--color/--no-color", default=None, help="Colour instead of markers (default: on a terminal).")
def episodes_cmd(run_dir, n, lowest, failed, prompt_id, versions, rows_path, color) -> None:
    """Print stored episodes of RUN_DIR: a header line each, then its text, trained (sampled by the model) told
    from untrained (the prompt, tool results, feedback): green and dim on a terminal, else lines marked
    [prompt], [trained] and [untrained]."""
    from areal_hpc.model import ModelFolderError
    from areal_hpc.store import CorruptShardError, load_episodes

    span = parse_versions(versions) if versions is not None else None
    try:
        eps = load_episodes(
            run_dir,
            lowest=lowest,
            failed=failed,
            prompt_id=prompt_id,
            versions=span,
            limit=n,
            rows=rows_path or True,
        )
    except (ValueError, OSError, CorruptShardError, ModelFolderError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    if not eps:
        from areal_hpc.rundir import RunDir
        from areal_hpc.store import list_shards

        if not list_shards(RunDir(run_dir).rollouts):
            raise click.ClickException(f"run {run_dir!r} has no shards yet: no episode is stored")
        click.echo("no stored episode matches")
        return
    color = sys.stdout.isatty() if color is None else color
    for i, ep in enumerate(eps):
        if i:
            click.echo("")
        click.echo(click.style(header(ep), bold=True) if color else header(ep), color=color)
        if ep.row:
            click.echo(row_line(ep.row))
        k = len(ep.transcripts)
        for j, t in enumerate(ep.transcripts, 1):
            if k > 1:  # a branched episode: each transcript as it was trained
                click.echo(f"transcript {j} of {k}: reward {t.reward:g}, finish {t.finish_reason}")
            for line in transcript_lines(t, color):
                click.echo(line, color=color)
