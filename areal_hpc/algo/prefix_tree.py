"""Sequences that share token prefixes laid out as prefix trees, and packed by the tokens actually computed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from areal_hpc.algo.packing import pack_microbatches


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of sequence `seq`, laid down once for every sequence whose path passes through it."""

    seq: int
    start: int  # also the position id of its first token: a segment continues its parent
    end: int
    parent: int  # index of the parent segment in the layout, -1 for a root

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class PrefixLayout:
    """Segments in layout order (a parent before its children) and, per sequence, the segment it ends in.

    A sequence's tokens are those of the segments on the path from a root to its leaf, in order. A segment
    attends to the tokens of its ancestors and causally to its own, never to a sibling's."""

    segments: list[Segment]
    leaf: list[int]

    @property
    def computed(self) -> int:
        """Token positions a forward over this layout computes."""
        return sum(s.length for s in self.segments)

    def offsets(self) -> list[int]:
        """Each segment's first position in the laid-out row."""
        out, k = [], 0
        for s in self.segments:
            out.append(k)
            k += s.length
        return out

    def ancestors(self, seg: int) -> list[int]:
        """The segments above `seg`, root first."""
        path = []
        p = self.segments[seg].parent
        while p >= 0:
            path.append(p)
            p = self.segments[p].parent
        return path[::-1]

    def positions(self, seq: int, offsets: list[int] | None = None) -> np.ndarray:
        """Where each token of sequence `seq` sits in the laid-out row (`offsets`: self.offsets(), if at hand)."""
        offsets = self.offsets() if offsets is None else offsets
        path = [*self.ancestors(self.leaf[seq]), self.leaf[seq]]
        return np.concatenate([np.arange(offsets[s], offsets[s] + self.segments[s].length) for s in path])


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _tokens(seqs) -> list[np.ndarray]:
    return [np.asarray(s, dtype=np.int64) for s in seqs]  # one width: their bytes order like their tokens


def _sorted(seqs: list[np.ndarray], idx: list[int]) -> list[int]:
    """Lexicographic order (of the tokens' bytes: any fixed-width order does): sequences sharing k tokens are
    then neighbours, for every k."""
    return sorted(idx, key=lambda i: seqs[i].tobytes())


def shares_a_prefix(seqs, min_shared: int) -> bool:
    """Whether two of the sequences open with the same `min_shared` tokens: exactly when `prefix_layout` lays a
    segment down once for several. A cheap look (no sort, no layout) that lets a micro-batch sharing nothing
    take the plain packed path."""
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1, got {min_shared}")
    heads = [np.asarray(s[:min_shared], dtype=np.int64).tobytes() for s in seqs if len(s) >= min_shared]
    return len(set(heads)) < len(heads)


def prefix_layout(seqs: list[np.ndarray], min_shared: int) -> PrefixLayout:
    """Lay the sequences out so that every prefix of at least `min_shared` tokens that several share is
    computed once. A shorter common run is repeated in each sequence: its own segment would cost an
    attention call per layer for little saving.

    In lexicographic order the sequences below any tree node are a contiguous range, and the common prefix
    of a range is the smallest of its neighbours' common prefixes: the tree is built from those, with a stack
    (a session whose every call extends the last one nests as deep as it has calls)."""
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1, got {min_shared}")
    seqs = _tokens(seqs)
    order = _sorted(seqs, list(range(len(seqs))))
    lcp = [_lcp(seqs[a], seqs[b]) for a, b in zip(order, order[1:])]
    segments: list[Segment] = []
    leaf = [-1] * len(seqs)
    # ("build", lo, hi, start, parent): order[lo:hi] shares tokens [0, start), laid down by `parent` and above;
    # ("emit", lo, hi, start, parent): order[lo:hi] is one node below `parent`
    todo: list[tuple] = [("build", 0, len(seqs), 0, -1)] if seqs else []
    while todo:
        task, lo, hi, start, parent = todo.pop()
        if task == "build":  # cut where neighbours share fewer than min_shared more tokens
            cuts = [k + 1 for k in range(lo, hi - 1) if lcp[k] - start < min_shared]
            runs = list(zip([lo, *cuts], [*cuts, hi]))
            todo += [("emit", a, b, start, parent) for a, b in reversed(runs)]  # popped in order: parent first
            continue
        if hi - lo == 1:
            i = order[lo]
            segments.append(Segment(i, start, len(seqs[i]), parent))
            leaf[i] = len(segments) - 1
            continue
        end = min(lcp[lo : hi - 1])  # the run's common prefix
        segments.append(Segment(order[lo], start, end, parent))
        me = len(segments) - 1
        while lo < hi and len(seqs[order[lo]]) == end:  # all of it shared (a duplicate, or others' prefix)
            leaf[order[lo]] = me  # such sequences sort first in their run
            lo += 1
        if lo < hi:
            todo.append(("build", lo, hi, end, me))
    return PrefixLayout(segments, leaf)


def clusters(seqs: list[np.ndarray], min_shared: int) -> list[list[int]]:
    """Sequences that share a prefix of at least `min_shared` tokens, transitively, in lexicographic order."""
    seqs = _tokens(seqs)
    order = _sorted(seqs, list(range(len(seqs))))
    out: list[list[int]] = []
    for k, i in enumerate(order):
        if k and _lcp(seqs[order[k - 1]], seqs[i]) >= min_shared:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _split(seqs: list[np.ndarray], cluster: list[int], budget: int, min_shared: int) -> list[list[int]]:
    """A cluster whose tree exceeds the budget, cut into parts (each keeping its own copy of the prefix)
    in lexicographic order, so the sequences sharing most stay together."""
    parts: list[list[int]] = [[]]
    cost = 0
    for k, i in enumerate(cluster):
        # in lexicographic order a sequence shares most with its predecessor: the tree grows by the rest
        shared = _lcp(seqs[cluster[k - 1]], seqs[i]) if parts[-1] else 0
        grow = len(seqs[i]) - (shared if shared >= min_shared else 0)
        if parts[-1] and grow and cost + grow > budget:  # a duplicate costs nothing more
            parts.append([])
            cost, grow = 0, len(seqs[i])
        parts[-1].append(i)
        cost += grow
    out = []
    for part in parts:  # the estimate can fall short where a shared run is split by the threshold: check
        over = max(budget, max(len(seqs[i]) for i in part))  # a sequence longer than the budget is one anyway
        if len(part) > 1 and prefix_layout([seqs[i] for i in part], min_shared).computed > over:
            half = len(part) // 2
            out += _split(seqs, part[:half], budget, min_shared) + _split(seqs, part[half:], budget, min_shared)
        else:
            out.append(part)
    return out


def pack_shared(seqs: list[np.ndarray], budget: int, min_shared: int) -> list[list[int]]:
    """Micro-batches (sorted sequence indices) whose prefix trees stay within `budget` computed tokens.

    Sequences sharing a prefix stay together where their tree fits; a cluster that does not fit is cut into
    parts that do. Parts are then packed as pack_microbatches packs sequences (a part too long for the
    budget, a single long sequence, gets a micro-batch of its own)."""
    seqs = _tokens(seqs)
    units: list[list[int]] = []
    for c in clusters(seqs, min_shared):
        units += _split(seqs, c, budget, min_shared) if len(c) > 1 else [c]
    costs = [prefix_layout([seqs[i] for i in u], min_shared).computed for u in units]
    return [sorted(i for u in bin_ for i in units[u]) for bin_ in pack_microbatches(costs, budget)]
