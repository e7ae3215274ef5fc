"""The control messages between rank 0 (scheduler), generators and trainers, and a non-blocking mailbox.

Every control message goes to or from rank 0 over MPI as a small pickled dict; bulk data never does
(rollouts go through the shard store, weights through the weight-sync group or files).

generator -> scheduler
  WANT        {"k": n}                         n more prompts wanted (free group slots not yet asked for)
  GROUPS_DONE {"shard": name, "groups": [{"indices": [...], "prompt_id", "group_id", "n_tokens",
               "gen_tokens", "version_start", "uniform": r|None, <GROUP_COUNTS>: n,
               "failure_kinds": {kind: n}, "logged": {name: (sum, n)}}, ...]}
                                               finished, rewarded groups now in a shard file; "uniform":
                                               the reward all n samples got when equal, else None (rank 0
                                               may reject the group, and counts such groups); the
                                               counts of its episodes (count_schema.GROUP_COUNTS: how
                                               many, and a sum per count the schema sends) and the
                                               numbers they logged (sum over n episodes), added up by
                                               rank 0 whatever becomes of it
  EVAL_RESULT {"tag": str, "version": v|None, "version_end": w, "acc": float|None, "reward_mean": float|None,
               "tool_share": float|None, "reward_timeouts": n, "reward_errors": n, "agent_failures": f,
               "cut": c}
                                               held-out accuracy (the share of episodes whose reward is
                                               >= logging.eval_threshold), mean reward, the share of its
                                               episodes that called a tool, its reward calls that timed out
                                               or raised, its episodes f whose agent or workflow failed
                                               (left out of the figures); started on weights v, its last
                                               tokens from w >= v;
                                               acc None: superseded by a later evaluation, never run;
                                               c episodes cut unfinished (logging.eval_timeout_s, a stop),
                                               left out of the figures
  EVAL_PROGRESS {"tag": str, "done": n, "total": t, "reward_timeouts": r}
                                               a running evaluation's episodes finished so far, every second
  WEIGHTS_OK  {"version": v, "checksum": int|None, "load_s": s|None, "skipped": bool, "prefill_tokens": n,
               "prefill_shared": m}
                                               weights applied (skipped: received but replaced by a newer
                                               version first, or pruned from disk; load_s None then);
                                               n: tokens the engine prefilled since its previous WEIGHTS_OK,
                                               m: prompt tokens it served from its prefix cache or a
                                               group's shared prefill instead (not in n)
scheduler -> generator
  GRANT       {"prompts": [(dataset index, group id), ...]}   join the engine at the next step
  NEW_VERSION {"version": v}                   join the weight transfer of version v now
  EVAL        {"tag": str}                     greedy held-out accuracy, run in the generation stream
trainer -> scheduler
  READY       {"version": v, "raw_gbps": f|None}  start-up done (warm start or checkpoint loaded), weights v
                                               published next; raw_gbps: one-buffer broadcast bandwidth
                                               (trainer 0 with the broadcast sync, else None)
  TRAIN_DONE  {"version": v+1, "stats": {...}} one policy version trained (every trainer sends it)
  SYNC_DONE   {"version": v, "sync_s": s, "bytes": n, "checksum": int|None}  trainer 0: weights sent
  CKPT_DONE   {"version": v, "path": str}
scheduler -> trainer
  BATCH       {"version": v, "share": [[(shard, [indices]), ...], ...]}  this trainer's token-balanced
                                               share, one list per PPO minibatch
  CHECKPOINT  {"version": v}
any -> scheduler
  HEARTBEAT   {}                               still here (from the role loop, every cluster.hang_timeout_s / 4)
  BYE         {"interrupted": n, "versions_checked": n, "versions_mismatched": n}
                                               answer to STOP: this rank sends nothing more (generators: how
                                               many requests they aborted for new weights, how many tokens'
                                               versions their engine stamped itself and how many of those
                                               differed from the version expected; trainers: 0)
scheduler -> any
  STOP        {"stop_eval_s": s|None}          finish: answer BYE and exit (rank 0 drains until every BYE);
                                               s: a stop request's bound on the final evaluation (generators)

Ordering: MPI keeps the order of messages between one pair of ranks, so a generator always handles
NEW_VERSION v before a later GRANT, EVAL or STOP.

`FIELDS` below is this table in code: every send is checked against it (tests/test_house_order.py checks
the table against this text), so the documentation cannot drift from what is sent.
"""

from __future__ import annotations

import time
from enum import IntEnum

from areal_hpc.count_schema import GROUP_COUNTS


class Tag(IntEnum):
    WANT = 1
    GROUPS_DONE = 2
    EVAL_RESULT = 3
    WEIGHTS_OK = 4
    EVAL_PROGRESS = 5
    GRANT = 10
    NEW_VERSION = 11
    EVAL = 12
    READY = 20
    TRAIN_DONE = 21
    SYNC_DONE = 22
    CKPT_DONE = 23
    BATCH = 30
    CHECKPOINT = 31
    HEARTBEAT = 89
    BYE = 90
    STOP = 91


# The keys each message's body carries, exactly (the table above).
FIELDS: dict[Tag, tuple[str, ...]] = {
    Tag.WANT: ("k",),
    Tag.GROUPS_DONE: ("shard", "groups"),
    Tag.EVAL_RESULT: (
        "tag",
        "version",
        "version_end",
        "acc",
        "reward_mean",
        "tool_share",
        "reward_timeouts",
        "reward_errors",
        "agent_failures",
        "cut",
    ),
    Tag.EVAL_PROGRESS: ("tag", "done", "total", "reward_timeouts"),
    Tag.WEIGHTS_OK: ("version", "checksum", "load_s", "skipped", "prefill_tokens", "prefill_shared"),
    Tag.GRANT: ("prompts",),
    Tag.NEW_VERSION: ("version",),
    Tag.EVAL: ("tag",),
    Tag.READY: ("version", "raw_gbps"),
    Tag.TRAIN_DONE: ("version", "stats"),
    Tag.SYNC_DONE: ("version", "sync_s", "bytes", "checksum"),
    Tag.CKPT_DONE: ("version", "path"),
    Tag.BATCH: ("version", "share"),
    Tag.CHECKPOINT: ("version",),
    Tag.HEARTBEAT: (),
    Tag.BYE: ("interrupted", "versions_checked", "versions_mismatched"),
    Tag.STOP: ("stop_eval_s",),
}
# The keys of each entry of GROUPS_DONE's "groups": the group, its episodes' counts (episode_counts.group_counts)
GROUP_FIELDS = (
    ("indices", "prompt_id", "group_id", "n_tokens", "gen_tokens", "version_start", "uniform")
    + GROUP_COUNTS
    + ("failure_kinds", "logged")
)


class ProtocolError(RuntimeError):
    """A message whose fields are not the documented ones: a bug in the sender, caught before it is sent."""


def check_fields(tag: Tag, body: dict) -> None:
    want = FIELDS[tag]
    if set(body) != set(want):
        raise ProtocolError(f"{tag.name} carries {sorted(body)}, the protocol says {sorted(want)}")
    if tag == Tag.GROUPS_DONE:
        for g in body["groups"]:
            if set(g) != set(GROUP_FIELDS):
                raise ProtocolError(f"GROUPS_DONE group carries {sorted(g)}, the protocol says {sorted(GROUP_FIELDS)}")


class Backoff:
    """The sleep between polls that found nothing: from `min_s`, doubling up to `max_s`; `reset` after work.

    Ranks are not pinned and share a node's cores, so each wake-up of an idle rank can preempt a busy
    one on its core: two ranks waking every 2 ms cost a generator on this 2-core machine 4-9% of its
    engine's throughput. Backing off to 10 ms wakes idle ranks 5x less often and delays a message to
    an idle rank by at most 10 ms.
    """

    def __init__(self, min_s: float = 0.002, max_s: float = 0.01):
        self.min_s, self.max_s = min_s, max(min_s, max_s)
        self.nap = min_s

    def sleep(self) -> None:
        time.sleep(self.nap)
        self.nap = min(2 * self.nap, self.max_s)

    def reset(self) -> None:
        self.nap = self.min_s


class Mailbox:
    """Non-blocking sends (requests kept until complete) and polled receives on one communicator.

    Polling with Iprobe plus a sleep that backs off while nothing comes (`Backoff`), not a blocking
    receive: a busy-waiting rank would steal the cores the generators and trainers need.
    """

    def __init__(self, comm, idle_sleep_s: float = 0.002, idle_sleep_max_s: float = 0.01):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.idle_sleep_s, self.idle_sleep_max_s = idle_sleep_s, idle_sleep_max_s
        self.backoff = Backoff(idle_sleep_s, idle_sleep_max_s)  # the role loop's, between its idle turns
        self._pending: list = []

    def send(self, dest: int, tag: Tag, body: dict | None = None) -> None:
        body = body or {}
        check_fields(tag, body)
        self._pending.append(self.comm.isend(body, dest=dest, tag=int(tag)))
        self._pending = [r for r in self._pending if not r.Test()]

    def poll(self, source: int | None = None) -> tuple[int, Tag, dict] | None:
        """One waiting message (source, tag, body), or None."""
        MPI = self._MPI
        status = MPI.Status()
        src = MPI.ANY_SOURCE if source is None else source
        if not self.comm.Iprobe(source=src, tag=MPI.ANY_TAG, status=status):
            return None
        body = self.comm.recv(source=status.Get_source(), tag=status.Get_tag())
        return status.Get_source(), Tag(status.Get_tag()), body

    def wait(self, source: int | None = None, timeout_s: float | None = None) -> tuple[int, Tag, dict]:
        """Block (politely) until a message arrives."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        nap = Backoff(self.idle_sleep_s, self.idle_sleep_max_s)
        while True:
            msg = self.poll(source)
            if msg is not None:
                return msg
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"rank {self.rank}: no message within {timeout_s} s")
            nap.sleep()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every send has completed: before exit, and before blocking outside MPI (a gloo
        collective, a long computation), because between nodes MPI progresses messages only inside MPI calls."""
        end = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < end:
            self._pending = [r for r in self._pending if not r.Test()]
            time.sleep(self.idle_sleep_s)
