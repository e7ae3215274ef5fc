"""The shard store: atomic HDF5 rollout shards, the consumption ledger, a pandas loader and episodes to read."""

from areal_hpc.store.episodes import EpisodeView, TextSegment, Transcript, load_episodes
from areal_hpc.store.ledger import Ledger, LedgerError
from areal_hpc.store.loader import load_trajectories
from areal_hpc.store.shard_schema import SCHEMA_VERSION
from areal_hpc.store.shards import (
    CorruptShardError,
    ShardSummary,
    list_shards,
    next_seq,
    parse_shard_name,
    read_shard,
    read_shard_summary,
    shard_name,
    write_shard,
)

__all__ = [
    "SCHEMA_VERSION",
    "CorruptShardError",
    "EpisodeView",
    "Ledger",
    "LedgerError",
    "ShardSummary",
    "TextSegment",
    "Transcript",
    "list_shards",
    "load_episodes",
    "load_trajectories",
    "next_seq",
    "parse_shard_name",
    "read_shard",
    "read_shard_summary",
    "shard_name",
    "write_shard",
]
