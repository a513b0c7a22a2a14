"""The ClientApp: decodes each message once, lets the run's client half answer, sends one reply.

Every message becomes a `clients.client_call.ClientCall` (run-config parsed once, node state and
device resolved); the half registered for run-config `mode` and `task` (`clients.halves`:
`clients.scene_client` for task scene, `clients.meta_client` for faces, photos, video and
objects, `clients.split_client` for mode split) computes the reply's parts, and this module
builds the reply in one place: a federated round's train reply also carries "client-seconds"
(the train handler's wall seconds plus this round's gradient query's, kept in the node's
state) and the CLIENT record naming the client, which a simulation's audit pairs with its
data; when the server asks for compression, ARRAYS goes as the compressed update with the
node's residual (`fedfields.flower.upload_compression.compressed_parts`), a control
variate's delta and a gradient query's G_k as their compressed records; a compressed download
is rebuilt into the global first
(`fedfields.flower.compressed_downloads.compressed_download_mod`). The server's
"query.user_key" is answered with the node's user key (`fedfields.flower.node.answer_user_key`), by
which it samples and sums. With run-config
`secure-aggregation` on, `secure_aggregation_mod` holds all of it back
for Flower's SecAgg+ (`fedfields.flower.secure_aggregation`).
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from clients.client_call import ClientCall
from clients.halves import half_for
from fedfields.flower import compressed_download_mod, secure_aggregation_mod
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import (
    CLIENT,
    CLIENT_INDEX,
    CLIENT_SECONDS,
    USER_KEY_ACTION,
    ReplyParts,
)
from fedfields.flower.upload_compression import compressed_gradient, compressed_parts
from fedfields.train.builders import client_seed

QUERY_TIMING = "query-timing"  # node-state values: {"round", "seconds"} of the last G_k query

app = ClientApp(mods=[compressed_download_mod, secure_aggregation_mod])
app.query(USER_KEY_ACTION)(answer_user_key)  # which user this node is: the server samples by it


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train with the run's client half; a round's reply also carries the client's seconds."""
    started = time.perf_counter()
    call = ClientCall.decode(msg, context)
    half = half_for(call.config)
    parts = half.train(call)
    if half.round_reply:
        parts = _round_reply(call, parts, time.perf_counter() - started)
    return parts.message(msg)


@app.query("gradient")
def gradient(msg: Message, context: Context) -> Message:
    """A gradient query's G_k (compressed if the server asks); its wall seconds are kept for this
    round's train reply's "client-seconds" (the reply to the query carries nothing but G_k)."""
    started = time.perf_counter()
    call = ClientCall.decode(msg, context)
    half = half_for(call.config)
    if half.gradient is None:
        raise ValueError(f"{call.node}: the {half.name} client answers no gradient query")
    seed = client_seed(call.config.common.seed, call.client, call.federated_round())
    parts = compressed_gradient(msg, half.gradient(call), seed)
    timing = {"round": call.federated_round(), "seconds": time.perf_counter() - started}
    call.state.put_values(QUERY_TIMING, timing)
    return parts.message(msg)


def _round_reply(call: ClientCall, parts: ReplyParts, seconds: float) -> ReplyParts:
    """A round's train reply: the half's parts (ARRAYS compressed if the server asks),
    "client-seconds" (`seconds` plus this round's gradient query's) in METRICS, and CLIENT
    naming the client for the audit."""
    query = call.state.values(QUERY_TIMING)
    if query is not None and query["round"] == call.federated_round():
        seconds += float(query["seconds"])
    seed = client_seed(call.config.common.seed, call.client, call.federated_round())
    parts = compressed_parts(call.msg, parts, call.state, seed)
    return ReplyParts(
        {**parts.records, CLIENT: ConfigRecord({CLIENT_INDEX: call.client})},
        {**(parts.metrics or {}), CLIENT_SECONDS: seconds},
    )
