"""Weights as they travel between ranks: the checksum both ends compute, and a tied tensor's second names."""

from __future__ import annotations

import struct
import zlib

import torch


class WeightSyncTimeout(RuntimeError):
    """A step of a weight sync passed its time limit; the message names the step, the version and the ranks."""


def tensor_crc(t: torch.Tensor) -> int:
    """crc32 of one tensor's bytes, wherever it lives."""
    return zlib.crc32(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


class Checksum:
    """The weights checksum built one tensor at a time, in any order: a receiver that loads bucket by bucket (and
    never holds every weight at once) adds each tensor as it passes and gets what the sender computed whole."""

    def __init__(self) -> None:
        self.crcs: dict[str, int] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        self.crcs[name] = tensor_crc(t)

    @property
    def value(self) -> int:
        # crc32 over each tensor's crc in name order: equal on both ends iff every tensor is equal
        return zlib.crc32(b"".join(struct.pack("<I", self.crcs[n]) for n in sorted(self.crcs)))


def weights_checksum(state_dict: dict[str, torch.Tensor]) -> int:
    """The checksum of a whole state dict (every name, tied aliases included)."""
    c = Checksum()
    for name, t in state_dict.items():
        c.add(name, t)
    return c.value


def tied_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    """alias -> kept name, for each name whose tensor is the same view as an earlier name's (a tied output layer).

    Only the kept name travels: the first in the model's own order, the input embedding, which is the name vLLM
    loads (it skips a tied lm_head). The receiver gives the alias the same tensor."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, t in state_dict.items():
        if t.numel() == 0 or t.is_meta:  # a meta tensor has no storage to share (every data_ptr is 0)
            continue
        # the view, not the storage: ZeRO-1/2 parameters are distinct views into one flat buffer
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def with_aliases(state_dict: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The state dict with every alias naming its kept tensor again (what the engines and checksums expect)."""
    return state_dict | {alias: state_dict[kept] for alias, kept in aliases.items()}


def shared_names(model: torch.nn.Module) -> dict[str, str]:
    """alias -> first name, for parameters registered under two names (tied embeddings), found by identity: works
    on a model on the meta device too, where tied_aliases cannot compare storage."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases
