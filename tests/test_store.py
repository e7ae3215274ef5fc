"""Tests for the shard store: shard round trip, atomic publication, corruption detection, ledger, loader."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from areal_hpc.config.checks import _CHOICES
from areal_hpc.store import (
    CorruptShardError,
    Ledger,
    list_shards,
    load_trajectories,
    next_seq,
    read_shard,
    read_shard_summary,
    write_shard,
)
from areal_hpc.store import shards as shards_mod
from areal_hpc.store.columns import EPISODE_DTYPES, gather
from areal_hpc.store.shards import COMPRESSIONS, read_columns
from areal_hpc.types import FINISH_REASONS, EpisodeCounts, Trajectory

TOKEN_FIELDS = ("input_ids", "behav_logprobs", "versions", "loss_mask")
SCALAR_FIELDS = (
    "prompt_id",
    "group_id",
    "sample_idx",
    "prompt_len",
    "reward",
    "finish_reason",
    "gen_rank",
    "t_start",
    "t_end",
    "row_index",
)


def make_traj(rng: np.random.Generator, prompt_len: int, gen_len: int, version0: int = 0, **kw) -> Trajectory:
    """A random trajectory; generated tokens carry versions version0.. (non-decreasing), prompt tokens -1."""
    L = prompt_len + gen_len
    versions = np.full(L, -1, dtype=np.int32)
    versions[prompt_len:] = version0 + np.sort(rng.integers(0, 3, gen_len)).astype(np.int32)
    logp = np.zeros(L, dtype=np.float32)
    logp[prompt_len:] = -rng.exponential(1.0, gen_len).astype(np.float32)
    mask = np.zeros(L, dtype=np.uint8)
    mask[prompt_len:] = 1
    t0 = float(rng.uniform(0, 1e6))
    fields = dict(
        prompt_id=int(rng.integers(0, 2**40)),
        group_id=int(rng.integers(0, 2**40)),
        sample_idx=int(rng.integers(0, 16)),
        input_ids=rng.integers(0, 150_000, L).astype(np.int32),
        behav_logprobs=logp,
        versions=versions,
        loss_mask=mask,
        prompt_len=prompt_len,
        reward=float(np.float32(rng.normal())),
        finish_reason=str(rng.choice(FINISH_REASONS)),
        gen_rank=int(rng.integers(0, 8)),
        t_start=t0,
        t_end=t0 + float(rng.uniform(0, 100)),
        row_index=int(t0),  # no draw of its own: the stored old shards hold make_batch's earlier draws
    )
    fields.update(kw)
    return Trajectory(**fields)


def make_batch(seed: int, n: int = 5, max_gen: int = 300) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [
        make_traj(rng, int(rng.integers(1, 60)), int(rng.integers(0, max_gen)), int(rng.integers(0, 5)))
        for _ in range(n)
    ]


def datasets(f: h5py.File) -> dict[str, h5py.Dataset]:
    """Every dataset of a shard by its path (the episode table's are in the group "episodes")."""
    out = {}
    f.visititems(lambda name, obj: out.__setitem__(name, obj) if isinstance(obj, h5py.Dataset) else None)
    return out


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for f in SCALAR_FIELDS:
        assert getattr(a, f) == getattr(b, f), f
    for f in TOKEN_FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype, f
        np.testing.assert_array_equal(x, y, err_msg=f)
    assert (a.gen_len, a.version_start, a.version_end) == (b.gen_len, b.version_start, b.version_end)


# ---------------------------------------------------------------------------------------------- shards


def test_round_trip_every_field(tmp_path):
    rng = np.random.default_rng(0)
    trajs = [
        make_traj(rng, 7, 40, 3),
        make_traj(rng, 120, 1, 0),
        make_traj(rng, 15, 0, 0, finish_reason="abort"),  # prompt only: version_start/end -1
        make_traj(rng, 0, 9, 2),
        make_traj(rng, 33, 1500, 10, finish_reason="length"),
    ]
    episodes = [EpisodeCounts(t.group_id, t.sample_idx) for t in trajs]
    episodes[1] = EpisodeCounts(trajs[1].group_id, trajs[1].sample_idx, 3, 2, 1, 0.25, 1, 2)
    p = write_shard(tmp_path, trajs, gen_rank=3, seq=17, run_id="run-a", episodes=episodes)
    assert p.name == "g003-00000017.h5"
    got = read_shard(p)
    assert len(got) == len(trajs)
    for a, b in zip(trajs, got):
        assert_same(a, b)
    assert got[2].version_start == -1 and got[2].version_end == -1
    np.testing.assert_array_equal(got[0].versions[:7], -1)

    s = read_shard_summary(p)
    assert s.run_id == "run-a" and s.n_trajectories == 5
    np.testing.assert_array_equal(s.n_tokens, [len(t.input_ids) for t in trajs])
    for f in (
        "prompt_id",
        "group_id",
        "sample_idx",
        "prompt_len",
        "gen_len",
        "version_start",
        "version_end",
        "gen_rank",
        "t_start",
        "t_end",
        "finish_reason",
        "row_index",
    ):
        assert list(getattr(s, f)) == [getattr(t, f) for t in trajs], f
    # the episode table, one row per episode, round trips (the summary's and the full read's)
    for table in (s.episodes, read_columns(p).episodes):
        assert {k: a.tolist() for k, a in table.items()} == {k: [getattr(e, k) for e in episodes] for k in table}
    np.testing.assert_array_equal(s.reward, np.array([t.reward for t in trajs], dtype=np.float32))
    assert read_shard_summary(p, verify_tokens=True).n_trajectories == 5

    with h5py.File(p) as f:
        assert f.attrs["schema_version"] == 4 and f.attrs["n_trajectories"] == 5
        assert set(f["episodes"]) == set(EPISODE_DTYPES) and "turns" not in f  # not a column per trajectory
        assert f["finish_reason"].dtype == np.dtype("S8") and f["offsets"].dtype == np.int64
        assert all(d.compression is None for d in datasets(f).values())


OLD_SHARD = Path(__file__).parent / "data" / "g002-00000005.h5"  # make_batch(7, n=4), written before compression
SCHEMA1_SHARD = Path(__file__).parent / "data" / "g001-00000003.h5"  # make_batch(8, n=3) by commit 048366c^'s code
SCHEMA3_SHARD = Path(__file__).parent / "data" / "g003-00000011.h5"  # schema3_batch() by commit 8f289ca's code


def test_compressed_shards_read_back_identical_and_old_ones_still_read(tmp_path):
    trajs = make_batch(7, n=4, max_gen=3000)
    paths = {
        c: write_shard(tmp_path / c, trajs, 2, 5, run_id="schema2-uncompressed", compression=c) for c in COMPRESSIONS
    }
    sizes = {c: p.stat().st_size for c, p in paths.items()}
    assert sizes["lzf"] < 0.8 * sizes["none"] and sizes["gzip"] < 0.8 * sizes["none"], sizes
    plain = read_shard(paths["none"])
    with h5py.File(paths["none"]) as f:
        checksum = f.attrs["checksum"]
    for c, p in paths.items():
        for a, b, c_ in zip(trajs, read_shard(p), plain, strict=True):
            assert_same(a, b)
            assert_same(b, c_)
        s = read_shard_summary(p, verify_tokens=True)
        np.testing.assert_array_equal(s.offsets, read_shard_summary(paths["none"]).offsets)
        with h5py.File(p) as f:
            # only the token columns are filtered (rank 0's summary reads never decompress); the checksums
            # are over the data, so every filter stores the same
            packed = {k for k, d in datasets(f).items() if d.compression}
            assert packed == (set() if c == "none" else set(TOKEN_FIELDS)), c
            assert f.attrs["checksum"] == checksum
    # a column that compresses below the file's size is no damaged header: 300k equal tokens
    rng = np.random.default_rng(1)
    flat = make_traj(rng, 10, 300_000, 0, input_ids=np.zeros(300_010, np.int32))
    flat.behav_logprobs[:] = -0.5
    p = write_shard(tmp_path / "flat", [flat], 0, 0, compression="gzip")
    assert p.stat().st_size < flat.input_ids.nbytes
    assert_same(flat, read_shard(p)[0])
    # a shard written before shards could be compressed (by the code of commit 9c548aa), read by today's code
    old = read_shard(OLD_SHARD)
    for a, b in zip(make_batch(7, n=4), old, strict=True):
        a.row_index = -1  # schema 2 kept no dataset row
        assert_same(a, b)
    assert read_shard_summary(OLD_SHARD, verify_tokens=True).run_id == "schema2-uncompressed"
    with pytest.raises(KeyError):
        write_shard(tmp_path, trajs, 0, 9, compression="zstd")  # config_checks refuses it in one line first
    assert set(COMPRESSIONS) == set(_CHOICES["store.compression"])


def test_shards_of_every_earlier_schema_still_read_with_defaults_for_what_they_lack(tmp_path):
    # schema 1 (no episode counts, no row index) and 2 (no row index): a resumed run's store, an old run's analysis
    with h5py.File(SCHEMA1_SHARD) as f:
        assert f.attrs["schema_version"] == 1 and "turns" not in f and "row_index" not in f
    for a, b in zip(make_batch(8, n=3), read_shard(SCHEMA1_SHARD), strict=True):
        a.row_index = -1
        assert_same(a, b)
        assert b.row_index == -1
    s = read_shard_summary(SCHEMA1_SHARD, verify_tokens=True)
    assert s.run_id == "schema1" and list(s.row_index) == [-1] * 3
    assert list(s.episodes["turns"]) == [1] * 3 and list(s.episodes["tool_calls"]) == [0] * 3
    # beside new shards in one store, loaded as one frame: the old rows' row_index is -1
    rd = tmp_path / "rollouts"
    rd.mkdir()
    for old in (SCHEMA1_SHARD, OLD_SHARD):
        (rd / old.name).write_bytes(old.read_bytes())
    new = make_batch(9, n=2)
    write_shard(rd, new, 3, 0)
    df = load_trajectories(tmp_path)
    assert list(df["row_index"]) == [-1] * 3 + [-1] * 4 + [t.row_index for t in new]
    assert df["row_index"].dtype == np.int64 and list(df["turns"][:3]) == [1] * 3
    # a schema this code does not know is refused as corrupt, in one line naming the ones it reads
    p = write_shard(tmp_path / "x", new, 0, 0)
    with h5py.File(p, "r+") as f:
        f.attrs["schema_version"] = 5
    with pytest.raises(CorruptShardError, match="schema_version 5, expected 1 to 4"):
        read_shard_summary(p)


def schema3_batch() -> list[Trajectory]:
    """make_batch(11, n=4) with trajectory 2 a second transcript (branch()) of trajectory 1's episode, the counts
    as schema 3 kept them: on an episode's first trajectory, 0 on its others (the fields are gone since)."""
    trajs = make_batch(11, n=4)
    trajs[2].group_id, trajs[2].sample_idx = trajs[1].group_id, trajs[1].sample_idx
    return trajs


def test_a_schema3_shard_gives_its_per_trajectory_counts_as_an_episode_table(tmp_path):
    with h5py.File(SCHEMA3_SHARD) as f:
        assert f.attrs["schema_version"] == 3 and list(f["turns"]) == [1, 3, 0, 2] and "episodes" not in f
    trajs = schema3_batch()
    for a, b in zip(trajs, read_shard(SCHEMA3_SHARD), strict=True):
        assert_same(a, b)
    c = read_columns(SCHEMA3_SHARD)
    assert {k: a.tolist() for k, a in c.episodes.items()} == {
        "group_id": [trajs[i].group_id for i in (0, 1, 3)],
        "sample_idx": [trajs[i].sample_idx for i in (0, 1, 3)],
        "turns": [1, 3, 2],
        "tool_calls": [0, 2, 0],
        "tool_errors": [0, 1, 0],
        "tool_s": [0.0, 0.5, 0.0],
        "reward_timeouts": [0, 1, 0],
        "reward_errors": [0, 0, 1],
    }
    # the branch's counts go with its first transcript, however the trajectories are dealt
    assert gather([(c, [2, 3])]).episodes["turns"].tolist() == [2]
    assert gather([(c, [1]), (c, [2])]).episodes["tool_calls"].tolist() == [2]
    # the loader joins them back onto each episode's first trajectory
    rd = tmp_path / "rollouts"
    rd.mkdir()
    (rd / SCHEMA3_SHARD.name).write_bytes(SCHEMA3_SHARD.read_bytes())
    df = load_trajectories(tmp_path)
    assert list(df["turns"]) == [1, 3, 0, 2] and list(df["tool_s"]) == [0.0, 0.5, 0.0, 0.0]
    # a table that is not one row per episode is refused
    with pytest.raises(ValueError, match="not the trajectories' 3"):
        write_shard(tmp_path, trajs, 0, 0, episodes=[EpisodeCounts(t.group_id, t.sample_idx) for t in trajs[:2]])
    with pytest.raises(ValueError, match="twice"):
        write_shard(tmp_path, trajs, 0, 0, episodes=[EpisodeCounts(t.group_id, t.sample_idx) for t in trajs])


def test_write_shard_errors_and_listing(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        write_shard(tmp_path, [], 0, 0)
    bad = make_batch(1, n=1)[0]
    bad.loss_mask = bad.loss_mask[:-1]
    with pytest.raises(ValueError, match="loss_mask"):
        write_shard(tmp_path, [bad], 0, 0)
    write_shard(tmp_path, make_batch(2, n=2), 0, 0)
    with pytest.raises(FileExistsError):
        write_shard(tmp_path, make_batch(3, n=2), 0, 0)
    write_shard(tmp_path, make_batch(4, n=1), 1, 5)
    write_shard(tmp_path, make_batch(5, n=1), 0, 2)
    (tmp_path / "g000-00000009.h5.123.tmp").write_bytes(b"partial")
    assert [p.name for p in list_shards(tmp_path)] == ["g000-00000000.h5", "g000-00000002.h5", "g001-00000005.h5"]
    assert next_seq(tmp_path, 0) == 3 and next_seq(tmp_path, 1) == 6 and next_seq(tmp_path, 7) == 0
    assert list_shards(tmp_path / "nope") == []
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp") and "123" not in n]


def _corrupt_truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _corrupt_empty(p: Path) -> None:
    p.write_bytes(b"")


def _corrupt_garbage(p: Path) -> None:
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())


def _flip_byte_in(dataset: str, at: int = 5):
    def corrupt(p: Path) -> None:
        with h5py.File(p) as f:
            ds = f[dataset].id  # contiguous: the data's byte position in the file; compressed: its first chunk's
            off = ds.get_offset() if ds.get_offset() is not None else ds.get_chunk_info(0).byte_offset
        with open(p, "r+b") as fh:
            fh.seek(off + at)
            b = fh.read(1)
            fh.seek(off + at)
            fh.write(bytes([b[0] ^ 0x40]))

    return corrupt


def _delete_dataset(name: str):
    def corrupt(p: Path) -> None:
        with h5py.File(p, "r+") as f:
            del f[name]

    return corrupt


def _bad_schema(p: Path) -> None:
    with h5py.File(p, "r+") as f:
        f.attrs["schema_version"] = 99


def _bad_offsets_consistent_checksum(p: Path) -> None:
    # Offsets that disagree with the data while the checksums match: only the structure check can catch it.
    with h5py.File(p, "r+") as f:
        arrays = {k: d[()] for k, d in datasets(f).items()}
        arrays["offsets"][1] += 1
        f["offsets"][...] = arrays["offsets"]
        hdr = shards_mod._header(1, f.attrs["run_id"], int(f.attrs["n_trajectories"]))
        f.attrs["checksum"] = shards_mod._checksum(arrays, shards_mod.CHECKSUM_ORDER, hdr)
        f.attrs["summary_checksum"] = shards_mod._checksum(arrays, shards_mod.SUMMARY_ORDER, hdr)


def _episode_table_consistent_checksum(p: Path) -> None:
    # An episode table naming another episode while the checksums match: only the table's check can catch it.
    with h5py.File(p, "r+") as f:
        arrays = {k: d[()] for k, d in datasets(f).items()}
        arrays["episodes/sample_idx"][0] += 100
        f["episodes/sample_idx"][...] = arrays["episodes/sample_idx"]
        hdr = shards_mod._header(shards_mod.SCHEMA_VERSION, f.attrs["run_id"], int(f.attrs["n_trajectories"]))
        f.attrs["checksum"] = shards_mod._checksum(arrays, shards_mod.CHECKSUM_ORDER, hdr)
        f.attrs["summary_checksum"] = shards_mod._checksum(arrays, shards_mod.SUMMARY_ORDER, hdr)


def _wrong_dtype(p: Path) -> None:
    with h5py.File(p, "r+") as f:
        data = f["input_ids"][()]
        del f["input_ids"]
        f["input_ids"] = data.astype(np.int64)


def _not_a_file(p: Path) -> None:
    p.unlink()
    p.mkdir()


CORRUPTIONS = {
    "truncated": (_corrupt_truncate, True),
    "empty": (_corrupt_empty, True),
    "garbage": (_corrupt_garbage, True),
    "flip-token-data": (_flip_byte_in("input_ids"), False),  # summary without tokens cannot see this
    "flip-logprob-data": (_flip_byte_in("behav_logprobs", 2), False),
    "flip-reward-data": (_flip_byte_in("reward", 1), True),
    "flip-offsets-data": (_flip_byte_in("offsets", 9), True),
    "missing-token-dataset": (_delete_dataset("loss_mask"), False),
    "missing-traj-dataset": (_delete_dataset("t_end"), True),
    "missing-offsets": (_delete_dataset("offsets"), True),
    "flip-episode-data": (_flip_byte_in("episodes/tool_calls", 1), True),
    "missing-episode-dataset": (_delete_dataset("episodes/turns"), True),
    "episode-table": (_episode_table_consistent_checksum, True),
    "bad-schema": (_bad_schema, True),
    "bad-offsets": (_bad_offsets_consistent_checksum, True),
    "wrong-dtype": (_wrong_dtype, False),
    "directory": (_not_a_file, True),
}


@pytest.mark.parametrize("compression", ["none", "lzf"])
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_detected(tmp_path, kind, compression):
    corrupt, summary_sees_it = CORRUPTIONS[kind]
    p = write_shard(tmp_path, make_batch(10, n=4), 0, 1, compression=compression)
    read_shard(p)
    corrupt(p)
    readers = [read_shard, lambda q: read_shard_summary(q, verify_tokens=True)]
    if summary_sees_it:
        readers.append(read_shard_summary)
    for reader in readers:
        with pytest.raises(CorruptShardError) as ei:
            reader(p)
        msg = str(ei.value)
        assert p.name in msg and "\n" not in msg and ei.value.path == p
    if kind == "bad-offsets":
        assert "offsets" in str(ei.value)
    if kind == "episode-table":
        assert "are not the trajectories' 4" in str(ei.value)


def test_missing_file_is_corrupt_error(tmp_path):
    with pytest.raises(CorruptShardError, match="does not exist"):
        read_shard(tmp_path / "g000-00000000.h5")


# ------------------------------------------------------------------------------- concurrent readers


N_CONCURRENT = 50


def _writer(rollout_dir: str, start_evt, n: int) -> None:
    start_evt.wait(30)
    for seq in range(n):
        write_shard(rollout_dir, make_batch(1000 + seq, n=6, max_gen=3000), gen_rank=seq % 2, seq=seq)


def _reader(rollout_dir: str, start_evt, n: int, result_q) -> None:
    seen: dict[str, int] = {}
    errors: list[str] = []
    polls = 0
    start_evt.set()
    deadline = time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        polls += 1
        for p in list_shards(rollout_dir):
            if p.name in seen:
                continue
            try:
                trajs = read_shard(p)
                seq = int(p.name[5:13])
                want = make_batch(1000 + seq, n=6, max_gen=3000)
                for a, b in zip(want, trajs, strict=True):
                    assert_same(a, b)
                seen[p.name] = len(trajs)
            except Exception as e:  # report everything; the parent fails on any
                errors.append(f"{p.name}: {type(e).__name__}: {e}")
                seen[p.name] = -1
    result_q.put((seen, errors, polls))


def test_concurrent_writer_and_reader(tmp_path):
    ctx = mp.get_context("spawn")
    start_evt, q = ctx.Event(), ctx.Queue()
    rd = str(tmp_path / "rollouts")
    w = ctx.Process(target=_writer, args=(rd, start_evt, N_CONCURRENT))
    r = ctx.Process(target=_reader, args=(rd, start_evt, N_CONCURRENT, q))
    w.start()
    r.start()
    seen, errors, polls = q.get(timeout=90)
    w.join(30)
    r.join(30)
    assert w.exitcode == 0 and r.exitcode == 0
    assert errors == []
    assert len(seen) == N_CONCURRENT and all(v == 6 for v in seen.values())
    assert polls > 1  # the reader really was polling while the writer wrote
    assert not [n for n in os.listdir(rd) if n.endswith(".tmp")]


# ------------------------------------------------------------------------------------------- ledger


def test_ledger_exactly_once(tmp_path):
    led = Ledger(tmp_path)
    assert led.versions() == [] and led.last_version() == -1 and led.consumed() == {}
    led.record(0, [("g000-00000000.h5", 0), ("g000-00000000.h5", 1)])
    led.record(1, [("g000-00000000.h5", 2), (tmp_path / "rollouts" / "g001-00000000.h5", np.int64(0))])
    assert (tmp_path / "ledger" / "v00000001.json").exists()
    with pytest.raises(ValueError, match="already has version 1"):
        led.record(1, [("g002-00000000.h5", 0)])
    with pytest.raises(ValueError, match="already consumed by version 0"):
        led.record(2, [("g002-00000000.h5", 0), ("g000-00000000.h5", 1)])
    with pytest.raises(ValueError, match="twice"):
        led.record(2, [("g002-00000000.h5", 0), ("g002-00000000.h5", 0)])
    with pytest.raises(ValueError):
        led.record(3, [("x.h5", 1.5)])
    assert led.versions() == [0, 1]  # refused records left nothing behind

    # Survives re-open; stray temporaries and unrelated files are ignored.
    (tmp_path / "ledger" / "v00000002.json.999.tmp").write_text("{garbage")
    (tmp_path / "ledger" / "README").write_text("hi")
    led2 = Ledger(tmp_path)
    want = {
        ("g000-00000000.h5", 0): 0,
        ("g000-00000000.h5", 1): 0,
        ("g000-00000000.h5", 2): 1,
        ("g001-00000000.h5", 0): 1,
    }
    assert led2.consumed() == want and led2.versions() == [0, 1] and led2.last_version() == 1
    assert led2.entries(1) == [("g000-00000000.h5", 2), ("g001-00000000.h5", 0)]
    with pytest.raises(ValueError, match="already consumed"):
        led2.record(2, [("g001-00000000.h5", 0)])

    # Resume from a checkpoint at version 0: version 1's trajectories become consumable again.
    led2.record(2, [("g002-00000000.h5", 0)])
    assert led2.truncate_after(0) == [1, 2]
    assert led2.versions() == [0] and led2.last_version() == 0
    assert sorted(os.listdir(tmp_path / "ledger")) == ["README", "v00000000.json", "v00000002.json.999.tmp"]
    led2.record(1, [("g001-00000000.h5", 0), ("g000-00000000.h5", 2)])
    led3 = Ledger(tmp_path)
    assert led3.consumed()[("g001-00000000.h5", 0)] == 1 and led3.versions() == [0, 1]
    led3.record(9, [("g003-00000000.h5", 0)])
    with pytest.raises(ValueError, match="not after the last recorded version 9"):
        led3.record(4, [("g003-00000000.h5", 1)])
    assert led3.truncate_after(-1) == [0, 1, 9] and Ledger(tmp_path).versions() == []


# ------------------------------------------------------------------------------------------- loader


def test_load_trajectories(tmp_path):
    rd = tmp_path / "rollouts"
    a = write_shard(rd, make_batch(20, n=3), 0, 0)
    b = write_shard(rd, make_batch(21, n=2), 1, 0)
    c = write_shard(rd, make_batch(22, n=2), 0, 1)
    ta, tb = read_shard(a), read_shard(b)
    led = Ledger(tmp_path)
    led.record(5, [(a.name, 0), (b.name, 1)])
    led.record(7, [(a.name, 2)])
    _flip_byte_in("input_ids")(c)

    with pytest.warns(UserWarning, match=c.name):
        df = load_trajectories(tmp_path)
    assert df.attrs["corrupt_shards"] == [c.name]
    assert len(df) == 5
    for col in (
        "prompt_id",
        "group_id",
        "sample_idx",
        "reward",
        "prompt_len",
        "gen_len",
        "version_start",
        "version_end",
        "finish_reason",
        "gen_rank",
        "t_start",
        "t_end",
        "row_index",
        "shard",
        "index",
        "consumed_version",
        "staleness",
    ):
        assert col in df.columns, col
    assert list(df["shard"]) == [a.name] * 3 + [b.name] * 2
    assert list(df["index"]) == [0, 1, 2, 0, 1]
    assert list(df["consumed_version"]) == [5, -1, 7, -1, 5]
    vs = [t.version_start for t in ta + tb]
    stale = df["staleness"].to_numpy()
    np.testing.assert_array_equal(stale[[0, 2, 4]], [5 - vs[0], 7 - vs[2], 5 - vs[4]])
    assert np.isnan(stale[[1, 3]]).all()
    assert list(df["prompt_id"]) == [t.prompt_id for t in ta + tb]
    assert list(df["finish_reason"]) == [t.finish_reason for t in ta + tb]
    assert list(df["gen_len"]) == [t.gen_len for t in ta + tb]

    # Without token verification the summary checksum still passes for the token-level flip.
    assert len(load_trajectories(tmp_path, verify_tokens=False)) == 7


def test_load_trajectories_empty(tmp_path):
    df = load_trajectories(tmp_path)
    assert len(df) == 0 and df.attrs["corrupt_shards"] == []
    assert {"prompt_id", "reward", "shard", "index", "consumed_version", "staleness"} <= set(df.columns)
