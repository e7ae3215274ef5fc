"""Weights from trainer rank 0 to the generators: bucketed collective broadcast, or safetensors on disk."""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from areal_hpc.engines.lora import model_skeleton
from areal_hpc.model import DTYPES
from areal_hpc.model.weights import WeightSyncTimeout, shared_names, tied_aliases, weights_checksum, with_aliases
from areal_hpc.rundir import RunDir
from areal_hpc.runtime.comm.torch_groups import store_over_mpi
from areal_hpc.runtime.comm.weight_files import prune_weights, save_weights


def published_layout(model_dir: Path, dtype: str) -> dict[str, torch.Tensor]:
    """What trainer 0 publishes for this model, as meta tensors (names, shapes, model.dtype; no memory): a tied
    output layer is left out, as it travels once under the input embedding's name."""
    skeleton = model_skeleton(model_dir)
    aliases = shared_names(skeleton)
    return cast_floating({k: v for k, v in skeleton.state_dict().items() if k not in aliases}, DTYPES[dtype])


def state_nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def cast_floating(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The state dict with its floating-point tensors in `dtype` (None: as they are)."""
    if dtype is None:
        return state_dict
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}


class WeightLayoutMismatch(ValueError):
    """What trainer 0 would publish does not fit a generator's receive buffers: refused before any broadcast."""


def layout_mismatch(sent: list, mine: list) -> str | None:
    """One line naming how two layouts ([name, shape, dtype] per tensor) differ; None when they are equal."""
    theirs, ours = {n: (tuple(s), d) for n, s, d in sent}, {n: (tuple(s), d) for n, s, d in mine}
    if theirs == ours:
        return None
    only_sent, only_mine = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    differ = sorted(n for n in set(theirs) & set(ours) if theirs[n] != ours[n])
    parts = []
    if differ:
        n = differ[0]
        (s1, d1), (s2, d2) = theirs[n], ours[n]
        parts.append(f"{len(differ)} tensor(s) differ, first {n!r}: trainer {d1} {list(s1)}, generator {d2} {list(s2)}")
    if only_sent:
        parts.append(f"{len(only_sent)} only at the trainer (first {only_sent[0]!r})")
    if only_mine:
        parts.append(f"{len(only_mine)} only at the generator (first {only_mine[0]!r})")
    return (
        "the weights trainer 0 publishes do not match this generator's model: "
        + "; ".join(parts)
        + " (both must load the same model folder; model.dtype sets the published dtype)"
    )


@dataclass
class _Slot:
    name: str
    bucket: int
    offset: int
    shape: tuple[int, ...]
    numel: int
    dtype: torch.dtype


class BucketPlan:
    """Packs a state dict into a few large pre-allocated flat buffers, one dtype per bucket.

    Both ends build the same plan from the same model layout (sorted names, shapes, dtypes), so only
    the buffers travel; `layout` is what they compare at start-up. A tied tensor travels once, under its
    first name; `views()` names it under its aliases too. With `dtype`, floating-point tensors
    are held in it (the sender casts while packing). Buffers are allocated once and reused every
    version: re-allocating them costs more than the broadcast itself on small models.
    """

    def __init__(
        self,
        state_dict: dict[str, torch.Tensor],
        bucket_bytes: int,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
    ):
        self.slots: list[_Slot] = []
        sizes: list[int] = []
        dtypes: list[torch.dtype] = []
        open_bucket: dict[torch.dtype, int] = {}
        self.aliases = tied_aliases(state_dict)
        for name in sorted(set(state_dict) - set(self.aliases)):
            t = state_dict[name]
            held = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            b = open_bucket.get(held)
            # a new bucket when this dtype has none yet or the tensor would overflow it (a tensor
            # bigger than a bucket gets a bucket of its own)
            itemsize = torch.empty(0, dtype=held).element_size()
            if b is None or (sizes[b] > 0 and (sizes[b] + t.numel()) * itemsize > bucket_bytes):
                b = len(sizes)
                sizes.append(0)
                dtypes.append(held)
                open_bucket[held] = b
            self.slots.append(_Slot(name, b, sizes[b], tuple(t.shape), t.numel(), held))
            sizes[b] += t.numel()
        self.buffers = [torch.empty(n, dtype=dt, device=device) for n, dt in zip(sizes, dtypes)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @property
    def layout(self) -> list:
        return [[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")] for s in self.slots]

    def buckets(self) -> list:
        """Per bucket [dtype name, numel, [[name, offset, shape], ...]]: what a vLLM worker needs to take a bucket
        apart as it arrives (vllm_transfer.TransferInit.buckets)."""
        out = [[str(b.dtype).removeprefix("torch."), b.numel(), []] for b in self.buffers]
        for s in self.slots:
            out[s.bucket][2].append([s.name, s.offset, list(s.shape)])
        return out

    def pack(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for s in self.slots:
                self.buffers[s.bucket][s.offset : s.offset + s.numel].copy_(state_dict[s.name].reshape(-1))

    def tensors(self) -> list[torch.Tensor]:
        """Each tensor sent, in slot order, as a view into its bucket (valid until the next transfer)."""
        return [self.buffers[s.bucket][s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def views(self) -> dict[str, torch.Tensor]:
        """The state dict as views into the buffers (valid until the next transfer), aliases included."""
        return with_aliases(dict(zip((s.name for s in self.slots), self.tensors(), strict=True)), self.aliases)


class SyncGroup:
    """A process group of {trainer rank 0 (root)} + generators, built after start-up.

    Built over a TCPStore bootstrapped through MPI (torch_groups); gloo on CPU, NCCL when the
    device is cuda (the NCCL branch is selected by device and cannot run on this CPU-only machine).
    """

    def __init__(self, comm, backend: str, timeout_s: float):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store_over_mpi(comm, timeout_s)
        prefix = dist.PrefixStore("weight_sync", self.store)
        self.backend = backend
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefix, self.rank, self.size)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, self.rank, self.size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def post(self, plan: BucketPlan) -> list:
        """Post the plan's buckets and return their Works; the backend's own threads (gloo) or stream (NCCL) move
        them."""
        return [self.pg.broadcast(buf, 0) for buf in plan.buffers]

    @property
    def peers(self) -> str:
        return "the generators"

    def posted(self, version: int) -> None:
        """Every generator takes the broadcast at its next engine step: nothing to announce (TransferGroups has)."""

    def wait_ready(self, version: int) -> None:
        """... and none has a wait of its own before it joins."""

    def check_layout(self, layout: list, device: str = "cpu") -> None:
        """Collective, once at start-up: every generator compares trainer 0's layout with its own and raises
        WeightLayoutMismatch (one line) if they differ, before a mismatched broadcast could hang or garble."""
        blob = json.dumps(layout).encode()
        n = torch.tensor([len(blob)], dtype=torch.int64, device=device)
        self.broadcast(n)
        buf = torch.zeros(int(n), dtype=torch.uint8, device=device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        self.broadcast(buf)
        if self.rank != 0:
            problem = layout_mismatch(json.loads(bytes(buf.cpu().numpy())), layout)
            if problem:
                raise WeightLayoutMismatch(problem)

    def raw_bandwidth(self, nbytes: int, device: str = "cpu", repeats: int = 3) -> float:
        """GB/s of one flat buffer of `nbytes` broadcast as is: the ceiling bucketing is measured against."""
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        self.broadcast(buf)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.broadcast(buf)
        if device == "cuda":
            torch.cuda.synchronize()
        return nbytes * repeats / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # best effort at exit
            pass


def sync_limit_s(limit_s: float, nbytes: int, first: bool) -> float:
    """Seconds one step of a weight sync (send, receive + load) may take: sync.limit_s when set, else 60 s plus
    1 s per 50 MB (gloo moves 1-4 GB/s between ranks here, a congested link or a slow filesystem 50 MB/s: a limit
    only a stall passes). The first sync of a world gets 4x that: connections open and memory is first touched
    in it, and a large model's first sync must not trip a limit made for the later ones."""
    base = limit_s or 60.0 + nbytes / 50e6
    return base * 4 if first else base


def backend_for(sync_backend: str, device: str) -> str:
    if sync_backend != "auto":
        return sync_backend
    return "nccl" if device == "cuda" else "gloo"


class WeightSender:
    """Trainer rank 0's side: publish a state dict as version v (collective or disk).

    A broadcast is posted and left to the backend: the trainer goes on training while the generators
    join at their next engine step, so it never waits for them. The bucket buffers are reused, so the
    next publish first waits for the previous one; `poll()` / `wait()` return the SYNC_DONE figures once
    a publish has completed (the time from posting to the last bucket delivered). Floating-point weights
    are cast to `dtype` (the generators' model.dtype) here, at the sender; the checksum is of what is sent.
    """

    def __init__(
        self,
        method: str,
        group: SyncGroup | None,
        run_dir: Path,
        bucket_mb: int,
        checksum: bool,
        keep_versions: int,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        limit_s: float = 0.0,
    ):
        self.method, self.group, self.run_dir = method, group, Path(run_dir)
        self.bucket_bytes = bucket_mb << 20
        self.limit_s = limit_s  # sync.limit_s: 0 = derived from the bytes sent (sync_limit_s)
        self.published = 0  # publishes posted: the first gets the first sync's longer limit
        self._failed: list[Exception] = []  # the waiter's error when a send passed its limit or failed
        self.checksum, self.keep_versions, self.device, self.dtype = checksum, keep_versions, device, dtype
        self.plan: BucketPlan | None = None
        self._pending: dict | None = None  # the publish in flight: its SYNC_DONE body, until delivered
        self._done_at: list[float] = []  # set by the waiter thread when the last bucket is delivered
        self._waiter: threading.Thread | None = None

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> dict | None:
        """Start publishing; returns the previous publish's SYNC_DONE body if nobody collected it yet."""
        previous = self.wait()  # the buffers are about to be refilled
        if self.method == "disk":
            aliases = tied_aliases(state_dict)  # before the cast, which makes each name a copy of its own
            state_dict = cast_floating(state_dict, self.dtype)
            crc = weights_checksum(state_dict) if self.checksum else None
            t0 = time.time()
            nbytes = save_weights(self.run_dir, {k: v for k, v in state_dict.items() if k not in aliases}, version)
            prune_weights(self.run_dir, self.keep_versions)
            t1 = time.time()
            self._pending = {
                "version": version,
                "sync_s": t1 - t0,
                "bytes": nbytes,
                "checksum": crc,
                "t_start": t0,
                "t_end": t1,
            }
            return previous
        self.plan_for(state_dict).pack(state_dict)
        crc = weights_checksum(self.plan.views()) if self.checksum else None
        works = self.group.post(self.plan)
        limit = sync_limit_s(self.limit_s, self.plan.nbytes, first=not self.published)
        self.published += 1
        self._pending = {"version": version, "bytes": self.plan.nbytes, "checksum": crc, "t_start": time.time()}
        self._done_at, self._failed = [], []
        # Work.wait() releases the GIL: this thread only notes when the transfer ended, or that it passed its limit
        self._waiter = threading.Thread(
            target=self._wait_for, args=(works, version, limit), name="weight-send", daemon=True
        )
        self._waiter.start()
        return previous

    def _wait_for(self, works: list, version: int, limit: float) -> None:
        try:
            self.group.posted(version)
            self.group.wait_ready(version)  # a receiver's drain is its own time; the limit is the transfer's
            deadline = time.time() + limit
            for w in works:
                w.wait(datetime.timedelta(seconds=max(0.001, deadline - time.time())))
        except Exception as err:  # gloo: "Operation timed out!"; a peer that died: a connection error
            why = str(err).splitlines()[0][:120]
            if "timed out" in why.lower():  # a stall: this limit is the failure's cause
                self._failed.append(
                    WeightSyncTimeout(
                        f"weight sync: send of version {version} from trainer 0 to {self.group.peers} passed its "
                        f"limit of {limit:.0f} s ({why})"
                    )
                )
            else:  # a receiver went away: the echo of its failure, which is the cause
                self._failed.append(RuntimeError(f"weight broadcast of version {version} failed ({why})"))
            return
        self._done_at.append(time.time())

    def use_transfer_groups(self, groups) -> None:
        """Send over vLLM's transfer groups (transfer_groups.TransferGroups, host buffers over gloo, or
        NcclTransferGroups, GPU buffers) from now on."""
        self.group = groups
        if self.plan is not None and self.device != groups.device:
            self.plan = BucketPlan(self.plan.views(), self.bucket_bytes, groups.device, self.dtype)
        self.device = groups.device

    def plan_for(self, state_dict: dict[str, torch.Tensor]) -> BucketPlan:
        """The bucket plan (built on first use): what the generators' receive buffers must match."""
        if self.plan is None:
            self.plan = BucketPlan(state_dict, self.bucket_bytes, self.device, self.dtype)
        return self.plan

    def poll(self) -> dict | None:
        """The SYNC_DONE body of a publish that has completed since the last call, else None."""
        if self._pending is None or (self._waiter is not None and self._waiter.is_alive()):
            return None
        info, self._pending = self._pending, None
        if self._waiter is not None:
            self._waiter.join()
            self._waiter = None
            if self._failed:
                raise self._failed[0]
            if not self._done_at:
                raise RuntimeError(f"weight broadcast of version {info['version']} failed (see the log)")
            info["t_end"] = self._done_at[0]
            info["sync_s"] = info["t_end"] - info["t_start"]
        return info

    def wait(self) -> dict | None:
        """Block until the publish in flight has completed; its SYNC_DONE body (None if none was in flight)."""
        if self._waiter is not None:
            self._waiter.join()
        return self.poll()


class WeightReceiver:
    """A generator's side: receive version v into reused buffers (or read its files)."""

    def __init__(
        self,
        method: str,
        group: SyncGroup | None,
        run_dir: Path,
        template: dict[str, torch.Tensor],
        bucket_mb: int,
        device: str = "cpu",
    ):
        self.method, self.group, self.run_dir = method, group, Path(run_dir)
        self.plan = BucketPlan(template, bucket_mb << 20, device) if method == "broadcast" else None
        self.aliases = tied_aliases(template)  # a tied tensor arrives once: its aliases are named here

    def receive(self, version: int) -> dict[str, torch.Tensor]:
        """Version `version` under every name of the template, a tied tensor under each of its names."""
        if self.method == "disk":
            return with_aliases(load_file(str(RunDir(self.run_dir).weights_file(version))), self.aliases)
        for buf in self.plan.buffers:
            self.group.broadcast(buf)
        return self.plan.views()
