"""Shard files: one immutable, checksummed HDF5 file of finished trajectories, written atomically."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from h5py import h5d, h5s

from areal_hpc.rundir import parse_shard_name, shard_name
from areal_hpc.store.columns import (
    DTYPES,
    EPISODE_DTYPES,
    TrajectoryColumns,
    episode_problem,
    from_trajectories,
)
from areal_hpc.store.shard_schema import (
    ADDED_EPISODE_FIELDS,
    CHECKSUM_ORDER,
    EPISODE_FIELDS,
    FIELD_DTYPES,
    LEGACY_COUNTS,
    SCHEMA_FIELDS,
    SCHEMA_VERSION,
    SUMMARY_ORDER,
    TOKEN_FIELDS,
    TRAJ_DEFAULTS,
    TRAJ_FIELDS,
    todays_episode_table,
)
from areal_hpc.types import EpisodeCounts, Trajectory
from areal_hpc.utils import fsync_dir as _fsync_dir
from areal_hpc.utils import temporary_beside

# Published shards are immutable and temporaries private, so HDF5 file locks buy nothing and fail with
# errno 38 on some shared filesystems: files are opened with locking=False.
REQUIRED_ATTRS = ("schema_version", "run_id", "checksum", "summary_checksum", "n_trajectories")


@dataclass(frozen=True)
class Compression:
    """An HDF5 filter on the token datasets (the per-trajectory ones are small and stay contiguous, so
    rank 0's summary reads never decompress). h5py reads any of them, and uncompressed shards, as is."""

    filter: str | None = None  # None | lzf | gzip
    level: int | None = None  # gzip's level
    shuffle: bool = True  # byte shuffle first: an int32 token id's high bytes are mostly zero, grouped they compress

    @property
    def label(self) -> str:
        name = "none" if self.filter is None else self.filter + (f"-{self.level}" if self.level else "")
        return name + ("+shuffle" if self.filter and self.shuffle else "")

    def options(self, n: int) -> dict:
        """create_dataset's keywords for a dataset of n items (an empty one is never chunked)."""
        if self.filter is None or n == 0:
            return {}
        chunks = (min(n, CHUNK_ITEMS),)
        return {"compression": self.filter, "compression_opts": self.level, "shuffle": self.shuffle, "chunks": chunks}


# store.compression's choices; benchmarks/store_io.py --compression measured them (docs/run-dir.md)
COMPRESSIONS = {"none": Compression(), "lzf": Compression("lzf"), "gzip": Compression("gzip", 1)}
CHUNK_ITEMS = 1 << 18  # 1 MB of int32 per chunk: a typical shard's token columns in a few chunks
# deflate's largest possible ratio is about 1032:1; a filtered dataset claiming more items than that
# allows for the whole file has a damaged header (the contiguous ones are bounded by the file size)
MAX_FILTER_RATIO = 1100


class CorruptShardError(Exception):
    """A shard file that cannot be trusted: unreadable, incomplete, inconsistent or failing its checksum."""

    def __init__(self, path: os.PathLike | str, reason: str):
        super().__init__(str(path), reason)  # args kept so the error pickles across processes
        self.path = Path(path)
        self.reason = " ".join(str(reason).split())  # one line, whatever the underlying error said

    def __str__(self) -> str:
        return f"corrupt shard {self.path}: {self.reason}"


@dataclass
class ShardSummary:
    """The per-trajectory arrays of one shard (no token data), as the scheduler and loader need them.

    `columns` holds one array per name in TRAJ_FIELDS (finish_reason as str), also readable as attributes
    (`summary.group_id`); `episodes` the episode table (EPISODE_DTYPES, one row per episode).
    """

    path: Path
    run_id: str
    offsets: np.ndarray  # int64 [N+1]
    columns: dict[str, np.ndarray]
    episodes: dict[str, np.ndarray]

    def __getattr__(self, name: str) -> np.ndarray:
        columns = self.__dict__.get("columns", {})
        if name in columns:
            return columns[name]
        raise AttributeError(f"ShardSummary has no field {name!r}")

    @property
    def n_trajectories(self) -> int:
        return len(self.prompt_id)

    @property
    def n_tokens(self) -> np.ndarray:
        """Sequence length (prompt + generated) of each trajectory."""
        return np.diff(self.offsets)


def list_shards(rollout_dir: os.PathLike | str) -> list[Path]:
    """Complete shard files in rollout_dir, ordered by (gen_rank, seq); temporaries are never listed."""
    d = Path(rollout_dir)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        key = parse_shard_name(name)
        if key is not None:
            found.append((key, name))
    found.sort()
    return [d / name for _, name in found]


def next_seq(rollout_dir: os.PathLike | str, gen_rank: int) -> int:
    """First unused sequence number for gen_rank (for a generator resuming after a requeue)."""
    keys = [parse_shard_name(p.name) for p in list_shards(rollout_dir)]
    seqs = [seq for rank, seq in keys if rank == gen_rank]
    return max(seqs) + 1 if seqs else 0


def _checksum(arrays: dict[str, np.ndarray], order: tuple[str, ...], header: str) -> str:
    # crc32 runs at several GB/s (blake2b under 1 GB/s): enough against torn or flipped bytes.
    crc = zlib.crc32(header.encode())
    for name in order:
        a = np.ascontiguousarray(arrays[name])
        crc = zlib.crc32(f"{name}:{a.dtype.str}:{a.shape}".encode(), crc)
        crc = zlib.crc32(memoryview(a).cast("B"), crc)
    return f"crc32:{crc:08x}"


def _header(schema_version: int, run_id: str, n: int) -> str:
    return f"areal-hpc-shard|{schema_version}|{run_id}|{n}"


def to_columns(trajectories: list[Trajectory], episodes: list[EpisodeCounts] | None = None) -> TrajectoryColumns:
    """Trajectories and their episodes' counts as a shard stores them (its dtypes, the derived fields computed);
    ValueError on bad lengths or an episode table that is not one row per episode."""
    return from_trajectories(trajectories, DTYPES, episodes)


def _pack(trajectories: list[Trajectory], episodes: list[EpisodeCounts] | None) -> dict[str, np.ndarray]:
    c = to_columns(trajectories, episodes)
    return {"offsets": c.offsets, **c.tokens, **c.seqs, **{f"episodes/{k}": a for k, a in c.episodes.items()}}


def write_shard(
    rollout_dir: os.PathLike | str,
    trajectories: list[Trajectory],
    gen_rank: int,
    seq: int,
    run_id: str = "",
    compression: str | Compression = "none",
    episodes: list[EpisodeCounts] | None = None,
) -> Path:
    """Write trajectories as shard g{gen_rank:03d}-{seq:08d}.h5 atomically; returns its path.

    The file appears complete or not at all (tmp + fsync + os.replace). An existing shard is never
    overwritten (FileExistsError): shards are immutable once published and may already be consumed.
    gen_rank and seq name the file (and are kept as file attributes); each trajectory's own gen_rank field
    is stored as it is. `compression`: a name in COMPRESSIONS (store.compression) or a Compression; the
    checksums are over the data, so they are the same whichever filter wrote it. `episodes`: one EpisodeCounts
    per (group_id, sample_idx) among the trajectories (None: defaults, as for plain generate calls).
    """
    if not trajectories:
        raise ValueError("write_shard: empty trajectories list")
    d = Path(rollout_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / shard_name(gen_rank, seq)
    if final.exists():
        raise FileExistsError(f"shard {final} already exists; shards are immutable")
    arrays = _pack(trajectories, episodes)
    n = len(trajectories)
    comp = COMPRESSIONS[compression] if isinstance(compression, str) else compression
    tmp = temporary_beside(final)
    try:
        with h5py.File(tmp, "w", locking=False) as f:
            for name in CHECKSUM_ORDER:
                a = arrays[name]
                f.create_dataset(name, data=a, **(comp.options(len(a)) if name in TOKEN_FIELDS else {}))
            f.attrs["schema_version"] = SCHEMA_VERSION
            f.attrs["run_id"] = run_id
            f.attrs["n_trajectories"] = n
            f.attrs["gen_rank"] = gen_rank
            f.attrs["seq"] = seq
            header = _header(SCHEMA_VERSION, run_id, n)
            f.attrs["checksum"] = _checksum(arrays, CHECKSUM_ORDER, header)
            f.attrs["summary_checksum"] = _checksum(arrays, SUMMARY_ORDER, header)
            f.flush()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # data durable before the name points at it
        finally:
            os.close(fd)
        os.replace(tmp, final)
        _fsync_dir(d)  # make the rename itself durable
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return final


def _read_verified(path: Path, full: bool) -> tuple[dict[str, np.ndarray], str]:
    """Read and verify a shard's datasets (all of them if full, else the summary ones); a field its schema
    version predates comes back filled with the Trajectory's default, and an older schema's episode table made
    from its per-trajectory counts."""
    try:
        f = h5py.File(path, "r", locking=False)
    except FileNotFoundError:
        raise CorruptShardError(path, "file does not exist") from None
    except Exception as e:  # h5py reports truncation / bad signature as OSError, others vary
        raise CorruptShardError(path, f"cannot open as HDF5 ({type(e).__name__}: {e})") from None
    try:
        with f:
            attrs = {}
            for a in REQUIRED_ATTRS:
                if a not in f.attrs:
                    raise CorruptShardError(path, f"missing attribute {a!r}")
                attrs[a] = f.attrs[a]
            try:
                schema = int(attrs["schema_version"])
            except (TypeError, ValueError):
                raise CorruptShardError(path, f"bad schema_version {attrs['schema_version']!r}") from None
            if schema not in SCHEMA_FIELDS:
                raise CorruptShardError(path, f"schema_version {schema}, expected 1 to {SCHEMA_VERSION}")
            added = _added_episode_fields(path, f) if schema == SCHEMA_VERSION else ()
            summary_order = ("offsets", *SCHEMA_FIELDS[schema], *added)
            order = (*TOKEN_FIELDS, *summary_order) if full else summary_order
            run_id = attrs["run_id"]
            run_id = run_id.decode() if isinstance(run_id, bytes) else str(run_id)
            n = int(attrs["n_trajectories"])
            file_size = f.id.get_filesize()
            arrays: dict[str, np.ndarray] = {}
            # the summary's datasets first: the token datasets' length must then match offsets before any
            # allocation (their sizes can exceed the file's when compressed)
            for name in (*summary_order, *(TOKEN_FIELDS if full else ())):
                # Low-level API: the high-level one costs ~2x per dataset, and most datasets here are small.
                try:
                    ds = h5d.open(f.id, name.encode())
                except KeyError:
                    raise CorruptShardError(path, f"missing dataset {name!r}") from None
                want = FIELD_DTYPES[name]
                shape, dtype = ds.shape, ds.dtype
                if dtype != want or len(shape) != 1:
                    raise CorruptShardError(path, f"dataset {name!r} is {dtype}{shape}, expected 1-d {want}")
                nbytes = shape[0] * want.itemsize
                # a damaged header must not trigger a huge allocation (the filter is looked up only when needed)
                if nbytes > file_size and (
                    nbytes > file_size * MAX_FILTER_RATIO or not ds.get_create_plist().get_nfilters()
                ):
                    raise CorruptShardError(path, f"dataset {name!r} claims {shape[0]} items, more than the file holds")
                if name in TOKEN_FIELDS and len(arrays["offsets"]) and shape[0] != arrays["offsets"][-1]:
                    raise CorruptShardError(
                        path, f"dataset {name!r} has length {shape[0]}, offsets end at {arrays['offsets'][-1]}"
                    )
                arr = np.empty(shape, dtype=want)
                if shape[0]:
                    ds.read(h5s.ALL, h5s.ALL, arr)
                arrays[name] = arr
            stored = attrs["checksum" if full else "summary_checksum"]
            stored = stored.decode() if isinstance(stored, bytes) else str(stored)
    except CorruptShardError:
        raise
    except Exception as e:  # any low-level read failure means the file is damaged
        raise CorruptShardError(path, f"read failed ({type(e).__name__}: {e})") from None
    for name in [f for f in TRAJ_FIELDS if f not in arrays]:  # an older schema's shard: the fields it predates
        arrays[name] = np.full(n, TRAJ_DEFAULTS[name], dtype=FIELD_DTYPES[name])
    _check_structure(path, arrays, n, full)
    actual = _checksum(arrays, order, _header(schema, run_id, n))
    if actual != stored:
        raise CorruptShardError(path, f"checksum mismatch (stored {stored}, computed {actual})")
    arrays |= todays_episode_table(arrays, schema)
    if (problem := episode_problem(arrays, _episodes(arrays))) is not None:
        raise CorruptShardError(path, problem)
    return arrays, run_id


def _added_episode_fields(path: Path, f: h5py.File) -> tuple[str, ...]:
    """The counts added since schema 4 began that this shard holds; CorruptShardError on a column of the episode
    table that this version does not know (a count from a newer version)."""
    if unknown := sorted(f"episodes/{k}" for k in f["episodes"] if f"episodes/{k}" not in EPISODE_FIELDS):
        raise CorruptShardError(path, f"episode table column {unknown[0]!r} unknown to this version")
    return tuple(name for name in ADDED_EPISODE_FIELDS if name in f)


def _check_structure(path: Path, arrays: dict[str, np.ndarray], n: int, full: bool) -> None:
    offsets = arrays["offsets"]
    if n < 1:
        raise CorruptShardError(path, f"n_trajectories is {n}")
    if len(offsets) != n + 1:
        raise CorruptShardError(path, f"offsets has length {len(offsets)}, expected {n + 1}")
    if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise CorruptShardError(path, "offsets do not start at 0 and increase")
    for name in [*TRAJ_FIELDS, *(k for k in LEGACY_COUNTS if k in arrays)]:
        if len(arrays[name]) != n:
            raise CorruptShardError(path, f"dataset {name!r} has length {len(arrays[name])}, expected {n}")
    lens = np.diff(offsets)
    pl, gl = arrays["prompt_len"].astype(np.int64), arrays["gen_len"].astype(np.int64)
    if np.any(pl < 0) or np.any(pl + gl != lens):
        raise CorruptShardError(path, "prompt_len + gen_len disagrees with offsets")
    if full:
        for name in TOKEN_FIELDS:
            if len(arrays[name]) != offsets[-1]:
                raise CorruptShardError(
                    path, f"dataset {name!r} has length {len(arrays[name])}, offsets end at {offsets[-1]}"
                )


def read_columns(path: os.PathLike | str) -> TrajectoryColumns:
    """A shard's trajectories as columns, after checking schema, structure and checksum (else CorruptShardError)."""
    a, _ = _read_verified(Path(path), full=True)
    seqs = {k: a[k] for k in TRAJ_FIELDS}
    return TrajectoryColumns(a["offsets"], {k: a[k] for k in TOKEN_FIELDS}, seqs, _episodes(a))


def _episodes(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: arrays[f"episodes/{k}"] for k in EPISODE_DTYPES}


def read_shard(path: os.PathLike | str) -> list[Trajectory]:
    """All trajectories of a shard as records (views into its columns); checked as read_columns."""
    return read_columns(path).trajectories()


def read_shard_summary(path: os.PathLike | str, verify_tokens: bool = False) -> ShardSummary:
    """Per-trajectory arrays of a shard without token data; verified by the summary checksum.

    verify_tokens=True also reads the token arrays to check the full checksum (costs a full read).
    """
    path = Path(path)
    a, run_id = _read_verified(path, full=verify_tokens)
    columns = {k: a[k] for k in TRAJ_FIELDS}
    columns["finish_reason"] = np.char.decode(a["finish_reason"], "ascii", errors="replace").astype(str)
    return ShardSummary(path=path, run_id=run_id, offsets=a["offsets"], columns=columns, episodes=_episodes(a))
