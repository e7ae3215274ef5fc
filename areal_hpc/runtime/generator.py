"""A generator rank: sample groups for granted prompts, reward them, write shards, take new weights mid-flight."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_hpc.config import Config
from areal_hpc.data import Problem, load_dataset
from areal_hpc.evaluation import heldout_accuracy
from areal_hpc.model import load_tokenizer
from areal_hpc.reward import RewardPool
from areal_hpc.rollout import completion_texts, final_rewards, group_requests, to_trajectory
from areal_hpc.runtime.build import build_generation_engine
from areal_hpc.runtime.layout import Layout
from areal_hpc.runtime.protocol import Mailbox, Tag
from areal_hpc.runtime.timeline import Timeline
from areal_hpc.runtime.weight_sync import WeightReceiver, state_nbytes, weights_checksum
from areal_hpc.store import ROLLOUTS_SUBDIR, next_seq, write_shard
from areal_hpc.types import GenOutput, GenRequest

log = logging.getLogger("areal_hpc.generator")


@dataclass
class _Group:
    problem: Problem
    t_start: float
    outputs: dict[int, GenOutput] = field(default_factory=dict)


@dataclass
class _Scoring:
    future: Future
    group_ids: list[int]
    outputs: list[GenOutput]
    t_submit: float


class Generator:
    """Holds up to `prompts_per_generator` groups; generation runs on a worker thread so this loop keeps
    answering MPI. New weights abort the running batch (interrupt on: partial tokens are kept and
    resumed as prompt + partial under the new weights) or wait until it ends (interrupt off).
    """

    def __init__(self, cfg: Config, run_dir: Path, comm, layout: Layout, sync_group, model_dir: Path, resume: bool):
        self.cfg, self.run_dir, self.layout, self.resume = cfg, Path(run_dir), layout, resume
        self.rank = comm.Get_rank()
        self.index = layout.index(self.rank)
        self.mail = Mailbox(comm)
        self.timeline = Timeline(self.run_dir, self.rank, "generator")
        self.engine = build_generation_engine(cfg, model_dir, seed=cfg.trainer.seed + 1000 * self.rank)
        self.tokenizer = load_tokenizer(model_dir)
        dataset = load_dataset(cfg.data)
        self.train, self.heldout = dataset.train, dataset.heldout[: cfg.logging.eval_prompts]
        self.pool = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
        sc = cfg.sync
        self.receiver = WeightReceiver(sc.method, sync_group, self.run_dir, self.engine.state_dict(), sc.bucket_mb,
                                       cfg.cluster.device)
        if sync_group is not None:  # paired with trainer 0's measurement at start-up
            sync_group.raw_bandwidth(state_nbytes(self.engine.state_dict()), cfg.cluster.device)
        self.rollout_dir = self.run_dir / ROLLOUTS_SUBDIR
        self.seq = next_seq(self.rollout_dir, self.rank)

        self.groups: dict[int, _Group] = {}
        self.queue: list[GenRequest] = []  # new requests and interrupted partials, generated next
        self.asked = 0  # prompts asked for and not granted yet
        self.staged: tuple[int, dict] | None = None  # received weights not applied yet
        self.have_weights = False
        self.scoring: list[_Scoring] = []
        self.eval_tags: list[str] = []
        self.stopping = False
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.running: Future | None = None
        self.t_gen = 0.0
        self.idle_since = time.time()
        self.interrupted = 0

    # -- weights --------------------------------------------------------------------------------
    def _receive(self, version: int) -> None:
        crc = None
        if self.staged is not None:
            # computed before the receive overwrites the shared buffers
            crc = weights_checksum(self.staged[1]) if self.cfg.sync.checksum else None
        self.mail.flush()  # pending messages leave before this rank blocks outside MPI
        with self.timeline.span("sync"):
            try:
                sd = self.receiver.receive(version)
            except FileNotFoundError:
                # disk path: pruned because newer versions exist, whose NEW_VERSION messages follow
                self.mail.send(0, Tag.WEIGHTS_OK, {"version": version, "checksum": None, "skipped": True})
                return
        if self.staged is not None:  # never applied: a newer version is here first
            self.mail.send(0, Tag.WEIGHTS_OK, {"version": self.staged[0], "checksum": crc, "skipped": True})
        self.staged = (version, sd)
        if self.cfg.rollout.interrupt and self.running is not None and not self.running.done():
            self.engine.abort()

    def _apply_staged(self) -> None:
        if self.staged is None:
            return
        version, sd = self.staged
        self.staged = None
        t0 = time.time()
        with self.timeline.span("load"):
            self.engine.update_weights(sd, version)
        load_s = time.time() - t0
        crc = weights_checksum(self.engine.state_dict()) if self.cfg.sync.checksum else None
        self.have_weights = True
        self.mail.send(0, Tag.WEIGHTS_OK, {"version": version, "checksum": crc, "load_s": load_s})

    # -- generation -----------------------------------------------------------------------------
    def _start_batch(self) -> None:
        reqs, self.queue = self.queue, []
        self.t_gen = time.time()
        if self.t_gen - self.idle_since > 1e-3:
            self.timeline.add("idle", self.idle_since, self.t_gen)  # no work or no weights
        self.running = self.executor.submit(self.engine.generate, reqs)

    def _collect_batch(self) -> None:
        outs = self.running.result()  # re-raises an engine error here, on the main thread
        self.running = None
        self.engine.clear_abort()  # an abort that came as the batch ended must not hit the next call
        self.idle_since = time.time()
        self.timeline.add("generate", self.t_gen, self.idle_since)
        finished: list[int] = []
        for o in outs:
            gid, sample = (int(x) for x in o.request_id.split(":"))
            if o.finish_reason == "abort":
                self.interrupted += 1
                self.queue.append(GenRequest(o.request_id, o.prompt_ids, self.cfg.rollout.max_new_tokens,
                                             list(o.output_ids), list(o.output_logprobs), list(o.output_versions)))
                continue
            g = self.groups[gid]
            g.outputs[sample] = o
            if len(g.outputs) == self.cfg.rollout.n_samples:
                finished.append(gid)
        if finished:
            outputs = [self.groups[gid].outputs[s] for gid in finished for s in range(self.cfg.rollout.n_samples)]
            texts = completion_texts(self.tokenizer, outputs)
            answers = [self.groups[gid].problem.answer for gid in finished for _ in range(self.cfg.rollout.n_samples)]
            # rewards are computed by worker processes while the next batch generates
            self.scoring.append(_Scoring(self.pool.submit(texts, answers), finished, outputs, time.time()))

    def _write_scored(self) -> None:
        """Shards for every group whose rewards are in, then the announcement to rank 0."""
        done = [s for s in self.scoring if s.future.done()]
        if not done:
            return
        self.scoring = [s for s in self.scoring if not s.future.done()]
        trajs, summaries = [], []
        now = time.time()
        for s in done:
            self.timeline.add("reward", s.t_submit, now)
            rewards = final_rewards(s.future.result(), s.outputs)
            n = self.cfg.rollout.n_samples
            for k, gid in enumerate(s.group_ids):
                g = self.groups.pop(gid)
                first = len(trajs)
                for o, r in zip(s.outputs[k * n : (k + 1) * n], rewards[k * n : (k + 1) * n]):
                    trajs.append(to_trajectory(o, g.problem.prompt_id, r, self.rank, g.t_start, now))
                members = trajs[first:]
                summaries.append({
                    "indices": list(range(first, len(trajs))),
                    "prompt_id": g.problem.prompt_id,
                    "group_id": gid,
                    "n_tokens": int(sum(len(t.input_ids) for t in members)),
                    "gen_tokens": int(sum(t.gen_len for t in members)),
                    "version_start": int(min(t.version_start for t in members)),
                })
        with self.timeline.span("write"):
            shard = write_shard(self.rollout_dir, trajs, gen_rank=self.rank, seq=self.seq, run_id=self.cfg.run_name)
        self.seq += 1
        self.mail.send(0, Tag.GROUPS_DONE, {"shard": shard.name, "groups": summaries})

    def _ask(self) -> None:
        free = self.cfg.rollout.prompts_per_generator - len(self.groups) - self.asked
        if free > 0 and self.have_weights and not self.stopping:
            self.mail.send(0, Tag.WANT, {"k": free})
            self.asked += free

    def _grant(self, prompts: list) -> None:
        self.asked -= len(prompts)
        now = time.time()
        for idx, gid in prompts:
            p = self.train[idx]
            self.groups[gid] = _Group(p, now)
            self.queue += group_requests(self.tokenizer.encode(p.prompt), gid, self.cfg.rollout.n_samples,
                                         self.cfg.rollout.max_new_tokens)

    def _evaluate(self, tag: str) -> None:
        with self.timeline.span("eval"):
            acc = heldout_accuracy(self.engine, self.tokenizer, self.pool, self.heldout, self.cfg.rollout.max_new_tokens)
        self.mail.send(0, Tag.EVAL_RESULT, {"tag": tag, "version": self.engine.version, "acc": acc})

    # -- loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        torch.set_num_threads(self.cfg.cluster.threads_per_rank)
        if self.index == 0 and not self.resume and self.cfg.logging.eval_prompts:
            self._evaluate("init")  # the model folder as it is, before any training
        while True:
            busy = False
            while (msg := self.mail.poll(0)) is not None:
                busy = True
                _, tag, body = msg
                if tag == Tag.GRANT:
                    self._grant(body["prompts"])
                elif tag == Tag.NEW_VERSION:
                    self._receive(body["version"])
                elif tag == Tag.EVAL:
                    self.eval_tags.append(body["tag"])
                elif tag == Tag.STOP:
                    self.stopping = True
                    if self.running is not None:
                        self.engine.abort()
                else:
                    raise RuntimeError(f"generator got unexpected message {tag.name}")
            if self.running is not None and self.running.done():
                self._collect_batch()
                busy = True
            if self.running is None:
                self._apply_staged()  # new requests always start on the newest weights
                for tag in self.eval_tags:
                    self._evaluate(tag)
                self.eval_tags = []
                if self.stopping:
                    break
                if self.queue and self.have_weights:
                    self._start_batch()
                    busy = True
            self._write_scored()
            self._ask()
            if not busy:
                time.sleep(self.mail.idle_sleep_s)
        self.mail.send(0, Tag.BYE, {"interrupted": self.interrupted})
        self.mail.flush()

    def close(self) -> None:
        self.engine.abort()  # on an error path a batch may still be running: end it at its next step
        self.executor.shutdown(wait=True, cancel_futures=True)
        try:
            self.engine.close()
        finally:
            self.pool.close()
        self.timeline.close()
