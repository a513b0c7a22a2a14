"""The reply gate: every check a reply passes before any of it reaches a sum.

A plaintext reply with NaN/Inf, wrong shapes, missing or extra keys, integer or bool arrays
where the global's are float (float16/32/64 arrays are cast to the global's dtype:
`protocol.checked_dtype`), a NaN/Inf metric, a non-positive or absurd "num-examples" (above
`max_num_examples`) or an update ||g_k - g|| above `max_update_norm` * max(||g||, 1) is dropped,
logged at WARNING with node and check, and counted in the round's ledger ("num-failures",
"num-dropped", "dropped-<check>"). Under secure aggregation a reply that holds nothing back
is dropped ("held"). A metric under a name the server writes (`protocol.reserved_metric`,
"dp-epsilon" say) drops its reply ("reserved-metric"). With compression on, a compressed ARRAYS
record (or DecentNeRF's G_k) is first rebuilt into the state it stands for
(`fedfields.flower.upload_compression`), so every
check runs on what will be summed; a malformed one is dropped ("compression"). `drop_reason`
says in a user's words what a dropped reply lacked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

from flwr.app import Message
from flwr.common.logger import log
from torch import Tensor

from fedfields.compression import CompressionConfig
from fedfields.flower.protocol import (
    ARRAYS,
    GRADIENT,
    HELD,
    HELD_METRICS,
    HELD_RECORDS,
    METRICS,
    NUM_EXAMPLES,
    PROTOCOL_HELD_METRICS,
    RESERVED_METRIC_PREFIXES,
    TRAIN_STEPS,
    BadReply,
    Shapes,
    check_metric_names,
    check_metrics,
    content_bytes,
    reply_metric,
    reply_state,
)
from fedfields.flower.round_ledger import RoundLedger
from fedfields.flower.upload_compression import decompressed_reply_state
from fedfields.methods.states import update_norm


@dataclass
class CheckedReply:
    """A plaintext reply that passed every check: its records as read-only tensors (views of
    the message's bytes; never write into them), its weight, the scalars asked for and a
    copy of its METRICS. It holds no reference to the message itself."""

    node_id: int
    states: dict[str, dict[str, Tensor]]
    weight: float = 1.0
    scalars: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def reply_metrics(reply: Message) -> dict[str, Any]:
    """A copy of a reply's METRICS record: all the ledger needs once the reply is gone."""
    return dict(reply.content.metric_records.get(METRICS, {}))


@dataclass(frozen=True)
class ReplyGate:
    """The caps a reply must stay within (None: no cap) and the compression its ARRAYS record
    arrives under (None: sent whole); the checks write into the round."""

    max_num_examples: float | None
    max_update_norm: float | None
    compression: CompressionConfig | None = None
    delta_scale: str = ""
    """The ARRAYS key s of a payload s x (DecentNeRF's alpha_k): its update is s x - s g."""
    compressed: frozenset[str] = frozenset({ARRAYS, GRADIENT})
    """Records that travel compressed under compressed uploads (the strategy's
    `compressed_records`): ARRAYS as the update, the others on their own."""

    def successful(self, ledger: RoundLedger, replies: Iterable[Message]) -> Iterator[Message]:
        """Replies of sampled nodes without errors, yielded as they come; every other reply
        is logged and left out.

        An error reply (a ClientApp that raised, or the SuperLink answering for a node that
        went away) counts in "num-failures"; so does a reply from a node that was not sampled
        or a second reply of one node. A reply with a NaN or infinite metric is dropped
        ("non-finite-metric", `check_metrics`). A sampled node that sent no reply at all
        before the timeout counts in "num-missing", with a WARNING naming the timeout.
        """
        seen: set[int] = set()
        answered: set[int] = set()
        where = f"round {ledger.server_round}"
        for reply in replies:
            node_id = reply.metadata.src_node_id
            answered.add(node_id)
            if reply.has_error():
                ledger.num_failures += 1
                log(WARNING, "%s: reply from node %d failed and is left out: %s", where, node_id,
                    reply.error.reason)  # fmt: skip
                continue
            if node_id not in ledger.node_ids or node_id in seen:
                ledger.num_failures += 1
                log(WARNING, "%s: unexpected reply from node %d (not sampled, or a second "
                    "reply) is left out", where, node_id)  # fmt: skip
                continue
            seen.add(node_id)
            ledger.bytes_up += content_bytes(reply.content)
            try:
                check_metrics(reply)
            except BadReply as bad:
                self.drop(ledger, reply, bad)
                continue
            yield reply
        if missing := sorted(set(ledger.node_ids) - answered):
            ledger.num_missing += len(missing)
            log(WARNING, "%s: no reply before the timeout (run-config round-timeout) from "
                "nodes %s: their updates are missing from this round", where, missing)  # fmt: skip

    def checked(
        self,
        ledger: RoundLedger,
        replies: Iterable[Message],
        records: Mapping[str, Shapes],
        check_update: Callable[[CheckedReply], None],
        *,
        weighted: bool = False,
        scalars: Mapping[str, tuple[float, float]] | None = None,
    ) -> Iterator[CheckedReply]:
        """The successful plaintext replies that pass every check, yielded as they come.

        Checks, in order: finite metrics (`successful`); each of `records` present with
        exactly the expected keys, shapes and dtypes (the global's, floats cast) and finite
        values (`reply_state`); if `weighted`, a "num-examples" in (0, `max_num_examples`]
        (the reply's `weight`, else 1); each metric of `scalars` within its (floor, cap),
        both inclusive, and positive; then the strategy's `check_update` (the update-norm
        bound, or its own).
        """
        for reply in self.successful(ledger, replies):
            try:
                states = {
                    name: self.record_state(ledger, reply, name, shapes)
                    for name, shapes in records.items()
                }
                checked = CheckedReply(reply.metadata.src_node_id, states)
                if weighted:
                    checked.weight = reply_metric(
                        reply, NUM_EXAMPLES, positive=True, at_most=self.max_num_examples
                    )
                checked.scalars = {
                    key: reply_metric(reply, key, positive=True, at_least=floor, at_most=cap)
                    for key, (floor, cap) in (scalars or {}).items()
                }
                check_update(checked)
            except BadReply as bad:
                self.drop(ledger, reply, bad)
                continue
            checked.metrics = reply_metrics(reply)
            yield checked

    def record_state(
        self, ledger: RoundLedger, reply: Message, name: str, shapes: Shapes
    ) -> dict[str, Tensor]:
        """Record `name` of `reply` as checked tensors (`reply_state`); a compressed ARRAYS
        record is first decompressed onto the arrays sent, another compressed record on its
        own (`decompressed_reply_state`)."""
        if self.compression is None or name not in self.compressed:
            return reply_state(reply, name, shapes, ledger.dtypes)
        reference = ledger.reference if name == ARRAYS else None
        return decompressed_reply_state(
            reply, shapes, reference, ledger.dtypes, self.compression, self.delta_scale, name
        )

    def check_update_norm(
        self, ledger: RoundLedger, node_id: int, state: Mapping[str, Tensor], scale: float
    ) -> None:
        """Raise `BadReply` ("update-norm") if `state` / `scale` moved further than
        `max_update_norm` * max(||g||, 1) from the arrays sent (g); no-op when off."""
        if self.max_update_norm is None or not ledger.reference:
            return
        bound = self.max_update_norm * max(ledger.reference_norm, 1.0)
        if not update_norm(state, ledger.reference, scale) <= bound:
            raise BadReply(
                "update-norm",
                f"reply from node {node_id}, record {ARRAYS!r}: the update's norm exceeds "
                f"max-update-norm = {self.max_update_norm:g} times max(||global||, 1)",
            )

    def holding(
        self, ledger: RoundLedger, replies: Sequence[Message], records: Mapping[str, Shapes]
    ) -> list[Message]:
        """The secure-mode replies that hold every one of `records` back; others dropped."""
        holding = []
        for reply in replies:
            held = reply.content.config_records.get(HELD)
            where = f"reply from node {reply.metadata.src_node_id}, record {HELD!r}"
            missing = sorted(set(records) - set((held or {}).get(HELD_RECORDS, [])))
            if held is None or missing:
                bad = BadReply("held", f"{where}: does not hold the records {missing}")
                self.drop(ledger, reply, bad)
                continue
            try:
                names = set(held.get(HELD_METRICS, [])) - PROTOCOL_HELD_METRICS
                check_metric_names(names, where)
            except BadReply as bad:
                self.drop(ledger, reply, bad)
                continue
            holding.append(reply)
        return holding

    @staticmethod
    def drop(ledger: RoundLedger, reply: Message, bad: BadReply) -> None:
        """Leave `reply` out of the round: count it and log node and check at WARNING."""
        ledger.count_drop(bad.check)
        log(WARNING, "round %d: reply from node %d dropped (check %r): %s",
            ledger.server_round, reply.metadata.src_node_id, bad.check, bad)  # fmt: skip

    def drop_reason(self, check: str, strategy: str) -> str:
        """What a reply dropped by `check` lacked, in a user's words (`strategy` names the
        class that needed it)."""
        mismatch = "the replies' arrays did not match the global model's keys and shapes"
        reasons = {
            NUM_EXAMPLES: (
                f"the clients must report a positive, finite {NUM_EXAMPLES!r} metric (at most "
                f"max-num-examples = {self.max_num_examples or math.inf:g})"
            ),
            TRAIN_STEPS: (
                f"the clients must report {TRAIN_STEPS!r} (the local steps each took, from 1 "
                f"to the 'local-steps' sent) in their {METRICS!r} record: {strategy} "
                "normalises by it"
            ),
            "update-norm": (
                f"updates exceeded max-update-norm = {self.max_update_norm or math.inf:g} "
                "times max(||global||, 1)"
            ),
            "non-finite": "the replies' arrays held NaN or infinite values",
            "non-finite-metric": "the replies' metrics held NaN or infinite values",
            "reserved-metric": (
                "the replies' metrics took names the server writes (num-replies, bytes-up, "
                f"round, seconds, {', '.join(p + '*' for p in RESERVED_METRIC_PREFIXES)})"
            ),
            "dtype": "the replies' arrays were integer or bool where the global model's are float",
            "held": "secure-mode replies held nothing back (is secure_aggregation_mod installed?)",
            "missing-record": f"the replies lacked their {ARRAYS!r} record",
            "shape": mismatch,
            "missing-key": mismatch,
            "extra-key": mismatch,
            "decode": "the replies' arrays could not be decoded",
            "compression": (
                "the replies' compressed updates were malformed (wrong rank or shape, a scale "
                "not finite, top-k indices out of range or repeated, or a bit width or scheme "
                "the server did not ask for)"
            ),
            "alpha": (
                "DecentNeRF replies carried an alpha_k outside [alpha-max * 1e-6, alpha-max]"
            ),
            "gradient-norm": "gradient replies' ||G_k|| exceeded max-gradient-norm",
        }
        return reasons.get(check, f"the replies failed the {check!r} check")
