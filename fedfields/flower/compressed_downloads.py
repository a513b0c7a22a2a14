"""Compressed downloads on Flower records: the strategy sends each node the global's change since
the round it last trained in, the node's mod rebuilds the global before anything reads it.
Train messages and a method's gradient query go this way; evaluation messages go whole.

Server (`DownloadSender`, kept by `ProtocolStrategy` when `CompressionConfig.download` is on):
each round advances `fedfields.download_chain.ReferenceChain` with what the strategy sends, T_t, and
gives each node's train message its own ARRAYS for the reference R_t the nodes will hold: R_t
whole, or the chain of records from the version the server last summed a reply of that user
for (a reply summed proves the node rebuilt that version; a sampled user whose reply was not
summed gets R_t whole next time). CONFIG carries "download-version" t and "download-base" b
(0: whole); the chain's record of version v travels as ArrayRecord entries "<v>:<key>:<part>".
The round reads each reply as T_t plus the update the node computed from R_t. A gradient
query's sum G (`Method.gradient_query`), new each round, goes down compressed once with the
run's scheme and no feedback (`DownloadSender.gradient`; CONFIG "gradient-compressed"): a
node reads G only in inner products (<G, g_k - g>), and quantise's unbiased rounding keeps
them unbiased.

Node (`compressed_download_mod`, outermost of the ClientApp's mods): rebuilds R_t from the
reference it keeps in its private state (`NodeState`, under DOWNLOAD_REFERENCE) and puts it in the
message's ARRAYS, so the handler, the upload compression and the SecAgg+ mod all read the global as
if it had come whole, and decompresses a compressed G into GRADIENT. A node that does not hold
version b (its state was wiped, or it trained in a round a resumed server rolled back) refuses the
message with a `ValueError` saying so; its reply is an error, counted, and the server sends it R_t
whole the next time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from torch import Tensor

from fedfields.compression import SEPARATOR, CompressionConfig, Record, compress, decompress
from fedfields.download_chain import ReferenceChain, rebuilt_chain
from fedfields.flower.node import NodeState
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    DOWNLOAD_BASE,
    DOWNLOAD_VERSION,
    GRADIENT,
    GRADIENT_COMPRESSED,
    GRADIENT_QUERY,
    arrays_to_state,
    content_bytes,
    state_to_arrays,
)
from fedfields.flower.upload_compression import record_arrays, requested_compression

DOWNLOAD_REFERENCE = "download-reference"
"""Node-state tensors: the reference R_v the node rebuilt last; its version under
DOWNLOAD_HELD ({"version": v})."""
DOWNLOAD_HELD = "download-held"
DOWNLOAD_TYPES = (MessageType.TRAIN, GRADIENT_QUERY)
"""Messages whose ARRAYS may come compressed: train, and a gradient query (the same
version: a node that answered the query is sent nothing more for the round's train message)."""


class DownloadSender:
    """The server's half: the reference chain and, per user key, the version last summed."""

    @classmethod
    def of(cls, config: CompressionConfig | None, seed: int | None) -> DownloadSender | None:
        """The sender for `config` when it compresses downloads, else None."""
        return cls(config, seed or 0) if config is not None and config.download else None

    def __init__(self, config: CompressionConfig, seed: int = 0) -> None:
        self.chain = ReferenceChain(config)
        self.seed = seed
        self.held: dict[str, int] = {}
        """User key -> the version of the last round that summed the user's reply."""

    def advance(self, server_round: int, arrays: ArrayRecord) -> None:
        """Advance the chain to R_t for `server_round`'s target `arrays` (what the strategy
        sends; the round reads its replies against it: a node's update from R_t, added to T_t)."""
        self.chain.advance(server_round, arrays_to_state(arrays), self.generator(server_round))

    def gradient(self, server_round: int, gradient: Mapping[str, Tensor]) -> ArrayRecord:
        """A gradient query's sum G of `server_round` compressed for its way down (module
        docstring), its rounding drawn from a stream of the server's seed apart from the
        chain's."""
        record = compress(gradient, self.chain.config, self.generator(server_round, stream=1))
        return record_arrays(record)

    def generator(self, server_round: int, stream: int = 0) -> torch.Generator:
        """The seeded generator of `server_round`'s random rounding: stream 0 the chain's,
        1 the gradient's; one seed gives one run."""
        return torch.Generator().manual_seed((self.seed * 100_003 + server_round) * 2 + stream)

    def content(self, content: RecordDict, user: str, whole: ArrayRecord) -> RecordDict:
        """`content` with ARRAYS (`whole`, R_t, or the user's chain: `ReferenceChain.download`)
        and CONFIG's download entries for the node of `user`."""
        download = self.chain.download(self.held.get(user, 0))
        arrays = whole if download.whole is not None else chain_arrays(download.records)
        config = ConfigRecord(
            {**content[CONFIG], DOWNLOAD_VERSION: download.version, DOWNLOAD_BASE: download.base}
        )
        return RecordDict({**content, ARRAYS: arrays, CONFIG: config})

    def contents(self, content: RecordDict, users: Iterable[str]) -> tuple[list[RecordDict], int]:
        """Each user's `content` and the bytes of all of them."""
        whole = state_to_arrays(self.chain.reference)
        contents = [self.content(content, user, whole) for user in users]
        return contents, sum(content_bytes(each) for each in contents)

    def hold(self, users: Iterable[str]) -> None:
        """`users` hold the current version (a reply of theirs to it was summed)."""
        for user in users:
            self.held[user] = self.chain.version

    def round_ended(self, sampled: Iterable[str], summed: Iterable[str]) -> None:
        """The users whose replies the round summed hold its version; the other sampled users
        hold what the server cannot know, and get the next version whole."""
        for user in sampled:
            self.held.pop(user, None)
        self.hold(summed)

    def state(self) -> dict[str, Any]:
        """The chain and the held versions (a checkpoint's strategy state)."""
        return {"chain": self.chain.state(), "held": dict(self.held)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what `state` returned."""
        self.chain.restore(state["chain"])
        self.held = {str(user): int(version) for user, version in state["held"].items()}


def chain_arrays(records: Mapping[int, Record]) -> ArrayRecord:
    """A chain of records as ARRAYS: each record's entries under "<version>:"."""
    wire = ArrayRecord()
    for version, record in records.items():
        for name, array in record.items():
            wire[f"{version}{SEPARATOR}{name}"] = Array(np.ascontiguousarray(array))
    return wire


def chain_records(arrays: ArrayRecord) -> dict[int, Record]:
    """The records of a chained download's ARRAYS, by version; ValueError for a malformed name."""
    records: dict[int, Record] = {}
    for name, array in arrays.items():
        version, _, entry = name.partition(SEPARATOR)
        if not version.isdigit() or not entry:
            raise ValueError(f"download entry {name!r} is not '<version>{SEPARATOR}<entry>'")
        records.setdefault(int(version), {})[entry] = array.numpy()
    return records


def received_state(
    arrays: ArrayRecord,
    config: ConfigRecord,
    held: tuple[int, Mapping[str, Tensor]] | None,
    compression: CompressionConfig,
) -> tuple[int, dict[str, Tensor]]:
    """(t, R_t) of a train message's download, given the (version, reference) a node holds;
    ValueError saying why when it cannot be rebuilt, when its version lies below its base, or
    when what it rebuilds is not finite."""
    version, base = int(config[DOWNLOAD_VERSION]), int(config[DOWNLOAD_BASE])
    if not 0 <= base <= version:
        raise ValueError(f"the download's version {version} is below its base {base}")
    if held is not None and version < held[0]:
        raise ValueError(
            f"the download's version {version} is older than the version {held[0]} this node holds"
        )
    if base == 0:
        return version, finite_state(arrays_to_state(arrays), version)
    if held is None or held[0] != base:
        have = "no version" if held is None else f"version {held[0]}"
        raise ValueError(
            f"the download of version {version} is the change since version {base}, and this "
            f"node holds {have} (its state was reset, or the server resumed): it cannot "
            "rebuild the global; the server sends it whole next time"
        )
    records = chain_records(arrays)
    return version, finite_state(
        rebuilt_chain(held[1], base, records, version, compression), version
    )


def finite_state(state: dict[str, Tensor], version: int) -> dict[str, Tensor]:
    """`state` if every floating entry is finite; ValueError naming the version and key."""
    for key, value in state.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"the rebuilt global of version {version} is not finite at {key!r}")
    return state


def compressed_download_mod(
    msg: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """Rebuild a compressed download's global into ARRAYS (module docstring), keep it as the
    node's reference, then run the handler."""
    config = msg.content.config_records.get(CONFIG) if msg.has_content() else None
    if msg.metadata.message_type not in DOWNLOAD_TYPES or config is None:
        return call_next(msg, context)
    if DOWNLOAD_VERSION not in config:
        return call_next(msg, context)
    compression = requested_compression(config)
    if compression is None:
        raise ValueError("a compressed download needs the message's compression settings")
    state = NodeState(context)
    held_values, reference = state.values(DOWNLOAD_HELD), state.tensors(DOWNLOAD_REFERENCE)
    held = None
    if held_values is not None and reference is not None:
        held = (int(held_values["version"]), reference)
    version, received = received_state(msg.content[ARRAYS], config, held, compression)
    content = {**msg.content, ARRAYS: state_to_arrays(received)}
    if config.get(GRADIENT_COMPRESSED):
        content[GRADIENT] = received_gradient(msg.content[GRADIENT], received, compression)
    state.put_tensors(DOWNLOAD_REFERENCE, received)
    state.put_values(DOWNLOAD_HELD, {"version": version})
    msg.content = RecordDict(content)
    return call_next(msg, context)


def received_gradient(
    arrays: ArrayRecord, received: Mapping[str, Tensor], compression: CompressionConfig
) -> ArrayRecord:
    """A gradient query's sum G from its compressed record, shaped as the global `received`;
    ValueError naming the record and why for a record the scheme could not have sent."""
    shapes = {key: tuple(value.shape) for key, value in received.items()}
    try:
        gradient = decompress({name: a.numpy() for name, a in arrays.items()}, shapes, compression)
    except ValueError as error:
        raise ValueError(f"record {GRADIENT!r}: {error}") from None
    return state_to_arrays(gradient)


def followed(
    held: tuple[int, dict[str, Tensor]] | None, messages: Iterable[Message]
) -> tuple[int, dict[str, Tensor]] | None:
    """(t, R_t) from the train messages of one round, for a reader of every round's messages
    (a simulation's audit) that holds `held` (None: nothing yet): a whole download, or any
    chain that starts at or below the held version. `held` when none of them is a download."""
    for msg in messages:
        config = msg.content.config_records.get(CONFIG)
        if config is None or DOWNLOAD_VERSION not in config:
            continue
        version, base = int(config[DOWNLOAD_VERSION]), int(config[DOWNLOAD_BASE])
        if base == 0:
            return version, arrays_to_state(msg.content[ARRAYS])
        if held is not None and base <= held[0] <= version:
            compression = requested_compression(config)
            assert compression is not None, "a download names its compression"
            records = chain_records(msg.content[ARRAYS])
            return version, rebuilt_chain(held[1], held[0], records, version, compression)
    return held
