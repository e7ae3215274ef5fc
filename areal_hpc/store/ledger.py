"""The consumption ledger: which (shard, index) trajectories each training version consumed, exactly once."""

from __future__ import annotations

import json
import operator
import os
from pathlib import Path

from areal_hpc.rundir import RunDir
from areal_hpc.utils import atomic_write_text
from areal_hpc.utils import fsync_dir as _fsync_dir

Entry = tuple[str, int]


def version_entries(run_dir: os.PathLike | str, version: int) -> list[Entry]:
    """One version's entries, its file read alone (a trainer's shard cache; a Ledger reads every file)."""
    doc = json.loads(RunDir(run_dir).ledger_file(version).read_text())
    return [_norm_entry(e) for e in doc["entries"]]


class LedgerError(ValueError):
    """A ledger file on disk that is unreadable or contradicts the others."""


def _norm_entry(entry) -> Entry:
    try:
        shard, idx = entry
        if isinstance(idx, bool) or not isinstance(shard, (str, os.PathLike)):
            raise TypeError
        idx = operator.index(idx)  # accepts numpy integers, rejects floats
    except (TypeError, ValueError):
        raise ValueError(f"ledger entry {entry!r} is not a (shard name, index) pair") from None
    if idx < 0:
        raise ValueError(f"ledger entry {entry!r} has a negative index")
    # Keyed by the file name only: all shards live in one directory, so a path and a name are the same shard.
    return os.path.basename(os.fspath(shard)), idx


class Ledger:
    """RUN_DIR/ledger/v{version:08d}.json files, one per training version, each written atomically.

    A trajectory (shard file name, index within shard) may be consumed by one version only, and versions are
    recorded in increasing order. The state is cached in memory; call reload() to see another process's writes.
    """

    def __init__(self, run_dir: os.PathLike | str):
        self.run = RunDir(run_dir)
        self.dir = self.run.ledger
        self.reload()

    def path_for(self, version: int) -> Path:
        return self.run.ledger_file(version)

    def reload(self) -> None:
        """Re-read every ledger file (ignoring *.tmp and unrelated files)."""
        self._entries: dict[int, list[Entry]] = {}
        self._consumed: dict[Entry, int] = {}
        for version, p in self.run.ledger_files():
            try:
                doc = json.loads(p.read_text())
                if int(doc["version"]) != version:
                    raise LedgerError(f"ledger file {p} says version {doc['version']}")
                entries = [_norm_entry(e) for e in doc["entries"]]
            except LedgerError:
                raise
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise LedgerError(f"unreadable ledger file {p}: {type(e).__name__}: {e}") from None
            for e in entries:
                if e in self._consumed:
                    raise LedgerError(f"ledger file {p}: entry {e} already consumed by version {self._consumed[e]}")
                self._consumed[e] = version
            self._entries[version] = entries

    def record(self, version: int, entries: list[tuple[str, int]]) -> Path:
        """Durably record that `version` consumed `entries`; refuses repeats (version or entry)."""
        try:
            if isinstance(version, bool):
                raise TypeError
            version = operator.index(version)
        except TypeError:
            raise ValueError(f"ledger version must be an int, got {version!r}") from None
        if version < 0:
            raise ValueError(f"ledger version must be non-negative, got {version}")
        final = self.path_for(version)
        if version in self._entries or final.exists():
            raise ValueError(f"ledger already has version {version}")
        if version <= self.last_version():
            raise ValueError(f"ledger version {version} is not after the last recorded version {self.last_version()}")
        norm = [_norm_entry(e) for e in entries]
        seen: set[Entry] = set()
        for e in norm:
            if e in self._consumed:
                raise ValueError(f"entry {e} was already consumed by version {self._consumed[e]}")
            if e in seen:
                raise ValueError(f"entry {e} appears twice in version {version}")
            seen.add(e)
        data = json.dumps({"version": version, "entries": [list(e) for e in norm]}, separators=(",", ":"))
        atomic_write_text(final, data)
        self._entries[version] = norm
        for e in norm:
            self._consumed[e] = version
        return final

    def consumed(self) -> dict[Entry, int]:
        """(shard name, index) -> version that consumed it."""
        return dict(self._consumed)

    def entries(self, version: int) -> list[Entry]:
        """The entries recorded for one version (KeyError if none)."""
        return list(self._entries[version])

    def versions(self) -> list[int]:
        return sorted(self._entries)

    def last_version(self) -> int:
        return max(self._entries) if self._entries else -1

    def truncate_after(self, version: int) -> list[int]:
        """Forget versions > version (resume from a checkpoint); returns the removed versions.

        Newest first, so a crash part-way still leaves a prefix of versions.
        """
        removed = []
        for v in sorted((v for v in self._entries if v > version), reverse=True):
            try:
                os.unlink(self.path_for(v))
            except FileNotFoundError:
                pass
            for e in self._entries.pop(v):
                del self._consumed[e]
            removed.append(v)
        if removed:
            _fsync_dir(self.dir)
        return sorted(removed)
