"""The single-process synchronous loop: run episodes (generate, reward), write shard, read it back, train, sync."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from areal_hpc.algo import mismatch
from areal_hpc.config import Config
from areal_hpc.data import load_run_dataset
from areal_hpc.data.order import PromptOrder, batch_draws
from areal_hpc.data.record import record_dataset
from areal_hpc.episode_counts import episode_metrics, episode_stats, group_counts
from areal_hpc.evaluation import heldout_evaluation, heldout_figures
from areal_hpc.model import load_tokenizer
from areal_hpc.reward import reward_pool_for
from areal_hpc.rundir import RunDir, RunDirError
from areal_hpc.rundir.actions import create
from areal_hpc.runtime.build import (
    adapt_after_warm_start,
    adapter_base,
    build_generation_engine,
    build_train_engine,
    lora_spec,
    warm_start,
    write_lora_contract,
)
from areal_hpc.runtime.generation.adapters import AdapterLoader
from areal_hpc.runtime.reporting.generated import GeneratedEpisodes
from areal_hpc.runtime.reporting.metrics import MetricsLogger
from areal_hpc.runtime.startup_checks import check_start, record_start
from areal_hpc.runtime.training.train_step import train_version
from areal_hpc.store import Ledger, write_shard
from areal_hpc.store.shards import read_columns
from areal_hpc.types import SampleId
from areal_hpc.utils import bar_interval, seed_everything
from areal_hpc.workflow import load_workflow, runner_settings
from areal_hpc.workflow.batch import EpisodeStart, run_episodes
from areal_hpc.workflow.samples import episode_counts, to_trajectories


@dataclass
class RunSummary:
    run_dir: Path
    versions: int
    acc_before: float
    acc_after: float
    acc_after_warm_start: float
    wall_s: float
    rl_wall_s: float
    tensorboard_dir: Path
    # the held-out mean rewards beside the accuracies (partial credit counts here, not in acc_*)
    reward_before: float = math.nan
    reward_after: float = math.nan
    reward_after_warm_start: float = math.nan


def run_sync(cfg: Config) -> RunSummary:
    """Run the synchronous learning loop described by `cfg` and return before/after accuracy."""
    root = Path(cfg.store.run_dir).resolve()
    model_dir, checked = check_start(cfg, root, resume=False)  # the launchers' checks, before the run dir is written
    t0 = time.time()  # as the asynchronous runs' wall time, from after the start-up checks
    seed_everything(cfg.trainer.seed)
    torch.set_num_threads(cfg.cluster.threads_per_rank)
    try:
        run_dir = create(RunDir(root), cfg)
    except RunDirError as err:
        raise FileExistsError(str(err)) from None
    record_start(run_dir, cfg)
    tokenizer = load_tokenizer(model_dir)
    dataset = checked if checked is not None else load_run_dataset(cfg, tokenizer)  # the checks tokenized it
    record_dataset(run_dir, cfg.data)  # a fresh run dir: RUN_DIR/dataset.json

    rc, tc = cfg.rollout, cfg.trainer
    workflow, settings = load_workflow(cfg.workflow.fn), runner_settings(cfg, tokenizer, model_dir)
    gen = build_generation_engine(cfg, model_dir, seed=tc.seed)
    spec = lora_spec(cfg)  # LoRA: the adapter is merged into the engine's base weights at each load
    lora_after_warm_start = bool(spec and tc.warm_start_steps)  # every weight is warm-started, then the adapter trains
    trainer = build_train_engine(cfg, model_dir, full=lora_after_warm_start)
    adapters = AdapterLoader(spec, run_dir, model_dir, cfg.model.dtype) if spec else None

    def publish() -> None:
        sd = trainer.weights()
        gen.update_weights(adapters.merged(gen, sd) if adapters else sd, trainer.version)

    metrics = MetricsLogger(run_dir, cfg.logging.trackers, config=cfg)
    ledger = Ledger(run_dir)
    rollout_dir = run_dir.rollouts
    heldout = dataset.heldout[: cfg.logging.eval_prompts]
    progress = cfg.logging.progress

    with reward_pool_for(cfg) as pool:
        lc = cfg.logging  # greedy, or avg@k at rollout.temperature (the engine's)
        greedy, thr = lc.eval_temperature == 0, lc.eval_threshold
        evaluate = lambda: heldout_evaluation(  # noqa: E731
            gen, tokenizer, pool, heldout, settings, lc.eval_n_samples, greedy, workflow, thr
        )
        before = evaluate()
        warm = before
        if tc.warm_start_steps:
            warm_start(trainer, tokenizer, dataset, cfg, progress)
            if lora_after_warm_start:
                trainer = adapt_after_warm_start(cfg, run_dir, trainer, writer=True)
        if spec:
            write_lora_contract(cfg, run_dir, trainer, adapter_base(cfg, run_dir, model_dir), writer=True)
        if tc.warm_start_steps:
            publish()
            warm = evaluate()
        metrics.log(0, {**warm, "reward_mean": math.nan, "wall_s": time.time() - t0})

        order = PromptOrder(len(dataset.train), cfg.data.seed)  # rank 0's order, epoch after epoch
        t_rl = time.time()
        last_eval = warm
        bar = tqdm(range(1, tc.versions + 1), desc="RL", disable=not progress, mininterval=bar_interval())
        generated = GeneratedEpisodes()  # reward failures and logged numbers, per version
        for step in bar:
            problems = [dataset.train[i] for i in batch_draws(order, step, rc.batch_prompts)]
            samples = [
                (SampleId((step - 1) * rc.batch_prompts + g, s), p)
                for g, p in enumerate(problems)
                for s in range(rc.n_samples)
            ]
            starts = [EpisodeStart(k, p.row, p.prompt_ids) for k, p in samples]
            t_gen = time.time()
            eps = run_episodes(gen, workflow, tokenizer, pool, settings, starts)
            generated.add(group_counts([e.stats for e in eps]))  # every episode is in the batch here
            t_write = time.time()
            # rewards are scored while other episodes generate: t_reward is the tail after the last answer
            t_rew = max([t_gen] + [e.stats.reward_span[0] for e in eps if e.stats.reward_span])
            trajs = [t for e, (k, p) in zip(eps, samples) for t in to_trajectories(e, k, p.prompt_id, 0, p.row_index)]
            table = [episode_counts(e, k) for e, (k, _) in zip(eps, samples)]
            shard = write_shard(
                rollout_dir, trajs, 0, step, cfg.run_name, compression=cfg.store.compression, episodes=table
            )

            # train on what the store returns, the same path the asynchronous runtime takes
            batch = read_columns(shard)
            t_train = time.time()  # t_store covers the shard write and its read-back
            r = batch.seqs["reward"].astype(np.float64)
            # the ledger names the version whose training step consumed the batch (the policy
            # version being improved), so on-policy data has staleness 0
            consumed_by = trainer.version
            stats, keep = train_version(trainer, batch, cfg)
            ledger.record(consumed_by, [(shard.name, i) for i in range(len(batch))])
            t_sync = time.time()
            publish()
            t_end = time.time()

            row = {
                "reward_mean": float(r.mean()),
                **heldout_figures([], lc.eval_threshold),  # NaN where not evaluated
                "groups_kept": int(keep.sum()) // rc.n_samples,
                "gen_tokens": int(batch.seqs["gen_len"].sum()),
                "t_generate": t_rew - t_gen,
                "t_reward": t_write - t_rew,
                "t_store": t_train - t_write,
                "t_train": t_sync - t_train,
                "t_sync": t_end - t_sync,
                "wall_s": t_end - t0,
                **episode_metrics([episode_stats(batch)], len(batch)),
                **generated.row(),
                **{k: v for k, v in mismatch.without_sums(stats).items() if not k.endswith(("_t_start", "_t_end"))},
                **mismatch.row_columns([stats]),  # the same columns as the asynchronous runtime's rank 0 writes
            }
            last = step == tc.versions or (tc.max_wall_s and t_end - t_rl >= tc.max_wall_s)
            if last or (cfg.logging.eval_every and step % cfg.logging.eval_every == 0):
                last_eval = evaluate()
                row.update(last_eval)
            metrics.log(trainer.version, row)
            if tc.checkpoint_every and trainer.version % tc.checkpoint_every == 0 and not last:
                trainer.save_checkpoint(run_dir.trainer_checkpoint(trainer.version))
            bar.set_postfix(reward=f"{r.mean():.3f}", acc=f"{last_eval['heldout_acc']:.3f}", refresh=False)
            if last:
                break
        bar.close()
        rl_wall = time.time() - t_rl
    trainer.save_checkpoint(run_dir.trainer_checkpoint(trainer.version))
    acc, rew = "heldout_acc", "heldout_reward_mean"
    summary = RunSummary(
        run_dir.root,
        trainer.version,
        before[acc],
        last_eval[acc],
        warm[acc],
        time.time() - t0,
        rl_wall,
        metrics.tb_dir,
        before[rew],
        last_eval[rew],
        warm[rew],
    )
    metrics.close({k: v for k, v in vars(summary).items() if isinstance(v, (int, float))})  # to the trackers
    return summary
