"""`areal-hpc config`, `train-sync` and `run`: a config resolved, and runs on this machine (mpirun)."""

from __future__ import annotations

from pathlib import Path

import click

from areal_hpc.cli.common import load_or_fail
from areal_hpc.config import to_yaml
from areal_hpc.rundir import RunDir
from areal_hpc.trackers import tracker_lines


@click.command("config")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def config_cmd(config_path: str, overrides: tuple[str, ...]) -> None:
    """Print the resolved config: CONFIG_PATH plus dotted KEY=VALUE overrides."""
    click.echo(to_yaml(load_or_fail(config_path, overrides)), nl=False)


@click.command("train-sync")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def train_sync_cmd(config_path: str, overrides: tuple[str, ...]) -> None:
    """Run the single-process synchronous learning loop (generate, reward, store, train)."""
    cfg = load_or_fail(config_path, overrides)
    from areal_hpc.model import ModelFolderError
    from areal_hpc.runtime.sync_loop import run_sync
    from areal_hpc.workflow import TooManyFailures

    try:
        s = run_sync(cfg)
    except (ModelFolderError, OSError, ValueError, TooManyFailures) as err:  # the failure budget's line too
        raise click.ClickException(str(err).splitlines()[0]) from None
    click.echo(
        f"held-out accuracy: {s.acc_before:.1%} at start, {s.acc_after_warm_start:.1%} after warm start, "
        f"{s.acc_after:.1%} after {s.versions} RL versions ({s.rl_wall_s:.0f} s of RL, {s.wall_s:.0f} s total); "
        f"reward >= {cfg.logging.eval_threshold:g} counts as correct"
    )
    click.echo(
        f"held-out mean reward: {s.reward_before:.3f} at start, {s.reward_after_warm_start:.3f} after warm start, "
        f"{s.reward_after:.3f} at the end"
    )
    click.echo(f"run dir:     {s.run_dir}")
    click.echo(f"metrics:     {RunDir(s.run_dir).metrics}")
    for line in tracker_lines(cfg.logging.trackers, RunDir(s.run_dir), cfg.logging.mlflow_uri):
        click.echo(line)


def episode_lines(s: dict, workflow: str = "") -> list[str]:
    """The summary's lines on what the episodes did: turns and tool calls, agents' (and workflows') failures and
    branches, and reward calls that failed."""
    lines = []
    if s.get("episodes_generated"):
        lines.append(
            f"episodes:    {s['episodes_generated']} generated for training, {s['turns_per_episode']:.2f} turns and "
            f"{s['tool_calls_per_episode']:.2f} tool calls per episode"
        )
    failed, heldout = s.get("agent_failures", 0), s.get("heldout_agent_failures", 0)
    if workflow == "agent" or failed or heldout:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted((s.get("agent_failures_by_kind") or {}).items()))
        who = "agents:     " if workflow == "agent" else "workflow:   "
        lines.append(
            f"{who} {failed} failed in training episodes{f' ({kinds})' if kinds else ''}, {heldout} in held-out "
            "ones (each ran again; held out, left out of the figures; the first of each kind is in the generator's "
            "log); "
            f"{s.get('branches', 0)} branches (histories rewritten)"
        )
    if "reward_errors" in s:
        lines.append(
            f"reward fn:   {s['reward_errors']} errors and {s['reward_timeouts']} time-outs in training episodes, "
            f"{s.get('heldout_reward_errors', 0)} and {s.get('heldout_reward_timeouts', 0)} in held-out ones "
            "(each scored 0; the first of each kind is in the generator's log)"
        )
    return lines


@click.command("run")
@click.argument("config_path", required=False, type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False),
    help="Continue the run in this RUN_DIR from its last checkpoint.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs and CI).")
def run_cmd(config_path: str | None, overrides: tuple[str, ...], resume_dir: str | None, no_progress: bool) -> None:
    """Run the asynchronous runtime under mpirun: CONFIG_PATH [KEY=VALUE ...], or --resume RUN_DIR [KEY=VALUE ...]."""
    from areal_hpc.launch.local import RunFailed, launch, staleness_histogram
    from areal_hpc.model import ModelFolderError

    if resume_dir:
        if config_path is not None:  # with --resume every argument is an override
            overrides = (config_path, *overrides)
        saved = RunDir(resume_dir).config
        if not saved.is_file():
            raise click.ClickException(f"{resume_dir!r} is not a run dir (no {saved.name})")
        from areal_hpc.launch.resume import refused_change

        cfg = load_or_fail(str(saved), (*overrides, f"store.run_dir={Path(resume_dir).resolve()}"))
        if (why := refused_change(load_or_fail(str(saved), ()), cfg)) is not None:
            raise click.ClickException(why)
    elif config_path is None:
        raise click.ClickException("give a config file (e.g. jobs/demo.yaml) or --resume RUN_DIR")
    else:
        cfg = load_or_fail(config_path, overrides)
    if no_progress:
        cfg.logging.progress = False
    try:
        s = launch(cfg, resume=bool(resume_dir), progress=cfg.logging.progress)
    except (RunFailed, ModelFolderError, OSError, ValueError) as err:
        raise click.ClickException(str(err).splitlines()[0]) from None
    run_dir = RunDir(Path(cfg.store.run_dir).resolve())
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    click.echo(
        f"versions:    {s['start_version']} -> {s['versions']} ({s['stop_reason']}) "
        f"in {s['rl_wall_s']:.0f} s of RL, {s['wall_s']:.0f} s total"
    )
    threshold = s.get("eval_threshold", cfg.logging.eval_threshold)
    click.echo(
        f"held-out:    accuracy (reward >= {threshold:g}) {pct(s['acc_init'])} at start, "
        f"{pct(s['acc_start'])} after warm start, {pct(s['acc_final'])} at the end"
    )
    rew = [s.get(f"heldout_reward_mean_{t}") for t in ("init", "start", "final")]
    num = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    click.echo(
        f"             mean reward {num(rew[0])} at start, {num(rew[1])} after warm start, {num(rew[2])} at the end"
    )
    if s.get("heldout_cut"):  # evaluations that ran into their time bound: their figures are over what finished
        click.echo(
            f"             {s['heldout_cut']} held-out episodes cut unfinished ({s['heldout_cut_final']} in the final "
            "evaluation) by logging.eval_timeout_s or the stop, left out of these figures"
        )
    click.echo(
        f"throughput:  {s['consumed_tokens_per_s']:.0f} consumed tokens/s "
        f"({s['tokens_consumed']} tokens, {s['samples_consumed']} samples)"
    )
    hist = staleness_histogram(run_dir.root)
    click.echo(
        f"staleness:   {hist} (versions behind -> trajectories); "
        f"dropped too stale: {s['dropped_stale']} groups, {s['dropped_on_resume']} on resume"
    )
    by_value = ", ".join(f"{v}: {n}" for v, n in (s.get("uniform_groups") or {}).items())
    click.echo(
        f"sampling:    {s.get('rejected_uniform', 0)} groups rejected as uniform (all rewards equal) and refilled; "
        f"uniform groups by reward: {{{by_value}}}; "
        f"{s.get('aborted_requests', 0)} requests interrupted for new weights and resumed; "
        f"{s.get('prefill_tokens', 0)} tokens prefilled"
    )
    for line in episode_lines(s, cfg.workflow.fn):
        click.echo(line)
    if s.get("sync_s_mean") is not None:
        # per version: on a small model GB/s only measures how fast the generators reach the collective
        how = f"through {run_dir.weights}" if cfg.sync.method == "disk" else "bucketed broadcast"
        load = f", loaded in {1e3 * s['load_s_mean']:.0f} ms" if s.get("load_s_mean") is not None else ""
        click.echo(
            f"weight sync: {1e3 * s['sync_s_mean']:.0f} ms per version to send {s['sync_bytes'] / 1e6:.1f} MB "
            f"({how}, {s['sync_gbps_mean']:.2f} GB/s){load}; weight_update={s.get('weight_update')}"
        )
    rel = [p.relative_to(run_dir.root) for p in (run_dir.metrics, run_dir.timeline, run_dir.logs, run_dir.checkpoints)]
    click.echo(f"run dir:     {run_dir.root}  ({', '.join(map(str, rel))})")
    for line in tracker_lines(cfg.logging.trackers, run_dir, cfg.logging.mlflow_uri):
        click.echo(line)
