"""The one shape of every role's loop: drain waiting messages into a handler table, then one tick of the role's work."""

from __future__ import annotations

import time
from collections.abc import Callable

from areal_hpc.config import Config
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.comm.layout import Layout
from areal_hpc.runtime.comm.liveness import Liveness
from areal_hpc.runtime.comm.protocol import Mailbox, Tag
from areal_hpc.runtime.comm.timeline import Timeline
from areal_hpc.runtime.failures import loop_started

Handler = Callable[[int, dict], None]  # (source rank, message body)


class RoleLoop:
    """A rank's main loop. A role gives its handler table, its `tick` and when it is `finished`.

    Handlers never block for long and `tick` does one unit of work (one engine step, one grant round),
    so the rank keeps answering MPI. A message no handler takes is a protocol error, raised at once.
    """

    role = "rank"
    listen_to: int | None = None  # None: every rank (rank 0); 0: only the scheduler
    busy_poll_s = 0.0
    """While ticks keep finding work, look for messages at most this often (0: before every tick)."""

    def __init__(self, cfg: Config, run_dir: RunDir, comm, layout: Layout, resume: bool):
        self.cfg, self.run_dir, self.layout, self.resume = cfg, RunDir(run_dir), layout, resume
        self.rank = comm.Get_rank()
        self.index = layout.index(self.rank)  # among the ranks of this role
        self.mail = Mailbox(comm)
        self.timeline = Timeline(self.run_dir, self.rank, self.role)
        self._handlers: dict[Tag, Handler] | None = None  # built on first use, once the role is set up
        self.liveness = Liveness(
            self.rank,
            cfg.cluster.hang_timeout_s,
            describe=layout.describe,
            heartbeat_file=self.run_dir.heartbeat if self.listen_to is None else None,
        )

    def handlers(self) -> dict[Tag, Handler]:
        raise NotImplementedError

    def tick(self) -> bool:
        """One unit of the role's own work; True if it did any (then the loop does not sleep)."""
        return False

    def finished(self) -> bool:
        raise NotImplementedError

    def drain(self) -> bool:
        """Handle every waiting message; True if there was any."""
        if self._handlers is None:
            self._handlers = self.handlers()
        got = False
        while (msg := self.mail.poll(self.listen_to)) is not None:
            src, tag, body = msg
            self.liveness.heard(src)
            if tag == Tag.HEARTBEAT:
                continue
            if tag == Tag.BYE:
                self.liveness.forget(src)
            handler = self._handlers.get(tag)
            if handler is None:
                raise RuntimeError(f"{self.role} got unexpected message {tag.name} from rank {src}")
            handler(src, body)
            got = True
        if self.listen_to is None:
            self.liveness.check()
        elif self.liveness.beat_due():
            self.mail.send(0, Tag.HEARTBEAT)
        return got

    def loop(self) -> None:
        loop_started.set()  # what fails from here on is not a start-up error; rank 0 beats from here
        working, next_drain = False, 0.0
        while not self.finished():
            got = False
            if not working or time.monotonic() >= next_drain:
                got = self.drain()
                next_drain = time.monotonic() + self.busy_poll_s
            working = self.tick()
            if working or got:
                self.mail.backoff.reset()
            else:
                self.mail.backoff.sleep()
