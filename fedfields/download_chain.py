"""Compressed downloads: one chain of references the server advances each round.

A node cannot decode "the global's change since its last round" unless it holds exactly what
the server compressed against, so the server keeps one chain of references R_1, R_2, ...: in
round t it compresses the difference between what it sends (its target T_t: the global, or
a method's lookahead) and the last reference, and every node rebuilds the same next reference:

    c_t = C(T_t - R_(t-1)),   R_t = R_(t-1) + D(c_t)

(C, D: `fedfields.compression`'s compress and decompress; round 1 sends R_1 = T_1 whole). The
chain is its own error feedback: what c_t left out, T_t - R_t, is part of the next difference,
because the server keeps T exact and reads every reply of round t as T_t + the client's update
(the update a node computed from R_t), so nothing is lost, only delayed. A node that holds R_b
receives c_(b+1), ..., c_t and rebuilds R_t; a node that holds nothing, or a version the
server no longer keeps (`CompressionConfig.download_history` rounds), or whose chain would
cost more bytes than R_t itself, receives R_t whole. Rebuilding is elementwise arithmetic on
CPU, so server and nodes hold the same R_t bit for bit (low-rank's one matrix product per
matrix may differ in its last bits on another BLAS: harmless, as above).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from fedfields.compression import (
    CompressionConfig,
    Record,
    compress,
    decompress,
    record_bytes,
)


@dataclass(frozen=True)
class Download:
    """What one node is sent: `version` t's reference whole (`base` 0, `whole`) or the records
    taking R_base to R_t (`records`, by version)."""

    version: int
    base: int
    whole: dict[str, Tensor] | None = None
    records: dict[int, Record] = field(default_factory=dict)


@dataclass
class ReferenceChain:
    """The server's chain of download references (module docstring); `advance` once a round."""

    config: CompressionConfig
    version: int = 0
    """t: the version `reference` is (0: none yet)."""
    reference: dict[str, Tensor] = field(default_factory=dict)
    records: dict[int, Record] = field(default_factory=dict)
    """c_v of the last `history` versions v."""

    def advance(
        self, version: int, target: Mapping[str, Tensor], generator: torch.Generator
    ) -> dict[str, Tensor]:
        """R_version: the reference the nodes will hold for `target` (the chain restarts, whole,
        when it has none or the model's keys, shapes or dtypes changed)."""
        if version <= self.version:
            raise ValueError(f"download version {version} after version {self.version}")
        target = {key: value.detach().cpu() for key, value in target.items()}
        if not self._continues(target):
            self.reference = {key: value.clone() for key, value in target.items()}
            self.records, self.version = {}, version
            return self.reference
        change = {key: target[key].double() - self.reference[key].double() for key in target}
        record = compress(change, self.config, generator)
        self.reference = rebuilt(self.reference, record, self.config)
        self.records[version] = record
        self.records = {
            v: r for v, r in self.records.items() if v > version - self.config.download_history
        }
        self.version = version
        return self.reference

    def _continues(self, target: Mapping[str, Tensor]) -> bool:
        """Whether `target` has the reference's keys, shapes and dtypes."""
        return self.version > 0 and {k: (v.shape, v.dtype) for k, v in target.items()} == {
            k: (v.shape, v.dtype) for k, v in self.reference.items()
        }

    def download(self, held: int) -> Download:
        """What a node holding version `held` (0: none) is sent of the current version: nothing
        when it holds it already, the chain of records when the server keeps them all and they
        cost fewer bytes than R_t, else R_t whole."""
        if held == self.version:
            return Download(self.version, held)
        wanted = range(held + 1, self.version + 1)
        whole = Download(self.version, 0, whole=self.reference)
        if held <= 0 or held > self.version or any(v not in self.records for v in wanted):
            return whole
        records = {v: self.records[v] for v in wanted}
        full = sum(value.numel() * value.element_size() for value in self.reference.values())
        if sum(record_bytes(record) for record in records.values()) >= full:
            return whole
        return Download(self.version, held, records=records)

    def state(self) -> dict[str, object]:
        """The chain as tensors, ints and dicts (a checkpoint's strategy state)."""
        return {
            "version": self.version,
            "reference": dict(self.reference),
            "records": {
                str(v): {name: torch.from_numpy(array.copy()) for name, array in record.items()}
                for v, record in self.records.items()
            },
        }

    def restore(self, state: Mapping[str, object]) -> None:
        """Take back what `state` returned."""
        self.version = int(state["version"])  # type: ignore[call-overload]
        self.reference = dict(state["reference"])  # type: ignore[call-overload]
        records: Mapping[str, Mapping[str, Tensor]] = state["records"]  # type: ignore[assignment]
        self.records = {
            int(v): {name: tensor.numpy() for name, tensor in record.items()}
            for v, record in records.items()
        }


def rebuilt(
    reference: Mapping[str, Tensor], record: Mapping[str, np.ndarray], config: CompressionConfig
) -> dict[str, Tensor]:
    """R + D(record) in R's dtypes: the next reference (ValueError, as `decompress`, for a
    malformed record)."""
    shapes = {key: tuple(value.shape) for key, value in reference.items()}
    change = decompress(record, shapes, config)
    return {
        key: (value.double() + change[key].double()).to(value.dtype)
        for key, value in reference.items()
    }


def rebuilt_chain(
    reference: Mapping[str, Tensor],
    held: int,
    records: Mapping[int, Record],
    version: int,
    config: CompressionConfig,
) -> dict[str, Tensor]:
    """R_version from R_held and the records of versions held+1..version; ValueError naming the
    first version missing or a malformed record."""
    state = dict(reference)
    for v in range(held + 1, version + 1):
        if v not in records:
            raise ValueError(
                f"the download of version {version} lacks the record of version {v} "
                f"(the node holds version {held})"
            )
        state = rebuilt(state, records[v], config)
    return state
