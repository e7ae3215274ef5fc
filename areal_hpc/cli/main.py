"""The `areal-hpc` command group: every command, from its part's module (local, slurm, analysis, evaluate, episodes)."""

from __future__ import annotations

import click

from areal_hpc.cli import analysis, episodes, evaluate, local, slurm


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """areal-hpc: fully asynchronous RL for LLM reasoning, on Slurm or one machine."""


for _cmd in (
    local.config_cmd,
    local.train_sync_cmd,
    local.run_cmd,
    slurm.render_cmd,
    slurm.submit_cmd,
    slurm.resume_cmd,
    slurm.sweep_cmd,
    slurm.collect_cmd,
    slurm.status_cmd,
    slurm.cancel_cmd,
    slurm.prepare_cmd,
    analysis.report_cmd,
    analysis.simulate_cmd,
    episodes.episodes_cmd,
    evaluate.eval_cmd,
    evaluate.export_cmd,
):
    main.add_command(_cmd)
