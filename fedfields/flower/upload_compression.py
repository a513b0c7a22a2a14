"""Compressed uploads on Flower records: the client half compresses, the reply gate decompresses.

The server asks for a scheme in each train message's CONFIG (`compression_entries`); the client
sends, in place of its ARRAYS state, the record of its update (state minus the ARRAYS it
received) plus the residual it kept from its last round (error feedback,
`fedfields.compression`); the residual stays in the node's private state (`NodeState`, under
`RESIDUAL`), so a node restarted on its state directory resumes it. The gate rebuilds the state
as received global + decompressed update before any other check (`decompressed_reply_state`),
so finiteness, norm and cap checks all see what will be summed; a malformed record is a
`BadReply` ("compression") naming why. A gradient query's reply G_k is compressed too, once
and with no feedback (it is recomputed every round, and the server reads only the sum G, in
inner products; quantise keeps them unbiased), and the gate decompresses it the
same way. Scaffold's control delta delta c_i is compressed once too (`compressed_control`):
the node then keeps c_i + D(C(delta c_i)) as its control, what the server adds to its c, so
c stays the clients' mean and the rounding joins the next round's delta. Every other record
travels whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from torch import Tensor

from fedfields.compression import (
    CompressionConfig,
    Record,
    compress,
    compress_with_feedback,
    decompress,
)
from fedfields.flower.node import NodeState
from fedfields.flower.protocol import (
    ARRAYS,
    COMPRESSION,
    COMPRESSION_BITS,
    COMPRESSION_DELTA_SCALE,
    COMPRESSION_FRACTION,
    COMPRESSION_RANK,
    CONFIG,
    GRADIENT,
    SECURE_AGGREGATION,
    BadReply,
    ReplyParts,
    Shapes,
    arrays_to_state,
    checked_state,
    state_to_arrays,
)
from fedfields.methods.scaffold import CLIENT_CONTROL, CONTROL_DELTA
from fedfields.privacy.dp import scaled_difference

RESIDUAL = "compression-residual"
"""Node-state tensors: what compression left out of the node's last upload (error feedback)."""


def compression_entries(
    config: CompressionConfig, delta_scale: str = ""
) -> dict[str, int | float | str]:
    """The train-config entries asking clients for `config`; with `delta_scale` the ARRAYS
    key s of a payload s x (the update is then s x - s g)."""
    entries: dict[str, int | float | str] = {
        COMPRESSION: config.scheme,
        COMPRESSION_RANK: config.rank,
        COMPRESSION_BITS: config.bits,
        COMPRESSION_FRACTION: config.fraction,
    }
    if delta_scale:
        entries[COMPRESSION_DELTA_SCALE] = delta_scale
    return entries


def requested_compression(config: ConfigRecord) -> CompressionConfig | None:
    """The compression a train message's CONFIG asks for; None when it asks for none."""
    scheme = str(config.get(COMPRESSION, "none"))
    if scheme == "none":
        return None
    return CompressionConfig(
        scheme,
        int(config[COMPRESSION_RANK]),
        int(config[COMPRESSION_BITS]),
        float(config[COMPRESSION_FRACTION]),
    )


def plaintext_compression(msg: Message) -> CompressionConfig | None:
    """The compression `msg` asks its reply's records to travel with in plaintext (None: whole;
    under SecAgg+ the secure-aggregation mod sends the codes)."""
    sent_config = msg.content.config_records.get(CONFIG, ConfigRecord())
    return None if sent_config.get(SECURE_AGGREGATION) else requested_compression(sent_config)


def compressed_gradient(msg: Message, parts: ReplyParts, seed: int) -> ReplyParts:
    """`parts` with a gradient reply's GRADIENT G_k replaced by its compressed record when `msg`
    asks for compression in plaintext: once, with no feedback (module docstring). `seed` seeds
    quantise's random rounding."""
    config = plaintext_compression(msg)
    if config is None or GRADIENT not in parts.records:
        return parts
    gradient = arrays_to_state(parts.records[GRADIENT], copy=False)
    record = compress(gradient, config, torch.Generator().manual_seed(seed))
    return ReplyParts({**parts.records, GRADIENT: record_arrays(record)}, parts.metrics)


CONTROL_STREAM = 1_000_003
"""Added to a reply's seed for its control delta's rounding: draws apart from the update's."""


def compressed_control(msg: Message, parts: ReplyParts, state: NodeState, seed: int) -> ReplyParts:
    """`parts` with Scaffold's CONTROL_DELTA delta c_i replaced by its compressed record when
    `msg` asks for compression in plaintext: once, and the node's kept control (c_i+, which
    its client hook kept) becomes c_i + D(C(delta c_i)), what the server adds."""
    config = plaintext_compression(msg)
    if config is None or CONTROL_DELTA not in parts.records:
        return parts
    delta = arrays_to_state(parts.records[CONTROL_DELTA], copy=False)
    record = compress(delta, config, torch.Generator().manual_seed(seed + CONTROL_STREAM))
    shapes = {key: tuple(value.shape) for key, value in delta.items()}
    sent = decompress(record, shapes, config)
    kept = state.tensors(CLIENT_CONTROL)
    if kept is None or kept.keys() != delta.keys():
        raise ValueError(f"a {CONTROL_DELTA!r} reply needs the node's {CLIENT_CONTROL!r} kept")
    state.put_tensors(
        CLIENT_CONTROL,
        {key: (kept[key] - delta[key] + sent[key]).to(kept[key].dtype) for key in kept},
    )
    return ReplyParts({**parts.records, CONTROL_DELTA: record_arrays(record)}, parts.metrics)


def compressed_parts(msg: Message, parts: ReplyParts, state: NodeState, seed: int) -> ReplyParts:
    """`parts` with ARRAYS replaced by the record of the compressed update, a gradient
    reply's G_k and Scaffold's delta c_i by theirs (`compressed_gradient`,
    `compressed_control`), when `msg` asks for compression (else `parts` as they are); the
    node's residual is read and kept in `state`. `seed` seeds quantise's random rounding, so
    one seed gives one reply."""
    parts = compressed_gradient(msg, parts, seed)
    parts = compressed_control(msg, parts, state, seed)
    config = plaintext_compression(msg)
    sent_config = msg.content.config_records.get(CONFIG, ConfigRecord())
    if config is None or ARRAYS not in parts.records:
        return parts
    received = arrays_to_state(msg.content[ARRAYS], copy=False)
    local = arrays_to_state(parts.records[ARRAYS], copy=False)
    scale_key = str(sent_config.get(COMPRESSION_DELTA_SCALE, ""))
    update = scaled_difference(local, received, scale_key)
    generator = torch.Generator().manual_seed(seed)
    record, residual = compress_with_feedback(update, state.tensors(RESIDUAL), config, generator)
    state.put_tensors(RESIDUAL, residual)
    return ReplyParts({**parts.records, ARRAYS: record_arrays(record)}, parts.metrics)


def record_arrays(record: Record) -> ArrayRecord:
    """A compressed record as an ArrayRecord, one Array per entry."""
    return ArrayRecord({name: Array(np.ascontiguousarray(array)) for name, array in record.items()})


def decompressed_reply_state(
    reply: Message,
    shapes: Shapes,
    reference: Mapping[str, Tensor] | None,
    dtypes: Mapping[str, str],
    config: CompressionConfig,
    scale_key: str = "",
    name: str = ARRAYS,
) -> dict[str, Tensor]:
    """The state a compressed reply record `name` stands for: s reference + decompressed update
    (s the update's `scale_key` entry, or 1), or with `reference` None the decompressed values
    themselves (G_k, delta c_i), after every check of `protocol.checked_state` (keys, shapes,
    dtypes, finiteness as summed); `BadReply` ("compression") naming the node and why a
    malformed record was refused."""
    where = f"reply from node {reply.metadata.src_node_id}, record {name!r}"
    record = reply.content.get(name)
    if not isinstance(record, ArrayRecord):
        found = "nothing" if record is None else type(record).__name__
        raise BadReply("missing-record", f"{where}: expected an ArrayRecord, found {found}")
    try:
        arrays = {name: array.numpy() for name, array in record.items()}
        update = decompress(arrays, shapes, config)
    except (TypeError, ValueError) as error:
        raise BadReply("compression", f"{where}: {config.scheme}: {error}") from None
    if reference is not None:
        return checked_state(rebuilt_arrays(reference, update, scale_key), shapes, where, dtypes)
    return checked_state(state_to_arrays(update), shapes, where, dtypes)


def uploaded_arrays(
    arrays: ArrayRecord, sent: Message, received: ArrayRecord | None = None
) -> ArrayRecord:
    """What a train reply's `arrays` stand for, given `sent`, the train message it answers:
    `arrays` themselves when `sent` asked for no compression, else the arrays the node received
    (`received`, for a compressed download the global it rebuilt; else `sent`'s) plus the
    decompressed update. For readers of replies the gate accepted (an audit's view of an
    upload); a malformed record is a ValueError."""
    sent_config = sent.content.config_records.get(CONFIG, ConfigRecord())
    config = requested_compression(sent_config)
    if config is None or sent_config.get(SECURE_AGGREGATION):
        return arrays
    received = sent.content[ARRAYS] if received is None else received
    reference = arrays_to_state(received, copy=False)
    shapes = {key: tuple(value.shape) for key, value in reference.items()}
    scale_key = str(sent_config.get(COMPRESSION_DELTA_SCALE, ""))
    if scale_key:
        shapes[scale_key] = (1,)
    update = decompress({name: array.numpy() for name, array in arrays.items()}, shapes, config)
    return rebuilt_arrays(reference, update, scale_key)


def rebuilt_arrays(
    reference: Mapping[str, Tensor], update: Mapping[str, Tensor], scale_key: str = ""
) -> ArrayRecord:
    """The state an update stands for: s reference + update in the reference's dtypes, s the
    update's `scale_key` entry (kept as sent) or 1."""
    scale = float(update[scale_key].double().reshape(())) if scale_key else 1.0
    state = {
        key: (scale * value.double() + update[key].double()).to(value.dtype)
        for key, value in reference.items()
    }
    return state_to_arrays(state | {key: update[key] for key in update if key not in reference})
