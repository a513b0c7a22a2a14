"""One federated round as a value: its reply gate, its one sum, client-level DP and its ledger.

`ProtocolStrategy.begin_round` samples the round's nodes and opens a `Round` over them. The
strategy's `aggregate` hook reads the replies through it: `sum` checks each reply
(`checked`: the reply gate, then the strategy's `check_update`) and folds it into the one sum
of `fedfields.flower.round`, in plaintext or through SecAgg+, clipped and noised under
DP; a server step that is not linear in the records (a method's own fold, the robust rules)
passes its own `ReplyFold`, and still each reply is checked, counted and summed once. The
round ends in `outcome`: the new global arrays (None: the global stays; an aggregate that is
not finite in the global's dtypes is refused), the round's train metrics (`metrics`: client
means, counts, traffic, epsilon) and its ledger. The loop hands that `RoundOutcome` to
evaluation, observers, checkpoint and report; nobody reads a round's results off the
strategy."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.compression import CompressionConfig
from fedfields.flower.protocol import (
    ARRAYS,
    BYTES_DOWN,
    BYTES_UP,
    DP_CLIP_NORM,
    DP_COUNT_STDDEV,
    DP_GRADIENT_CLIP_NORM,
    DP_NOISE_MULTIPLIER,
    DP_UNCLIPPED,
    DROPPED_PREFIX,
    GRADIENT,
    HELD,
    HELD_METRICS,
    HELD_RECORDS,
    METRICS,
    NON_FINITE_AGGREGATE,
    NUM_DROPPED,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_MISSING,
    NUM_REPLIES,
    PROTOCOL_HELD_METRICS,
    RESERVED_METRIC_PREFIXES,
    SECURE_AGGREGATION,
    SECURE_DELTA,
    SECURE_DELTA_SCALE,
    SECURE_WEIGHT,
    TRAIN_STEPS,
    WEIGHT_KEY,
    BadReply,
    Shapes,
    arrays_to_state,
    check_metric_names,
    check_metrics,
    content_bytes,
    fallback_key,
    finite_arrays,
    reply_metric,
    reply_state,
)
from fedfields.flower.secagg_workflow import SecureSum
from fedfields.flower.upload_compression import decompressed_reply_state
from fedfields.methods.base import RoundContext, RunningSum, update_norm
from fedfields.privacy.accountant import EPSILON_METRIC, DPAccountant, RoundCharge, check_plan
from fedfields.privacy.adaptive_clipping import next_clip_norm, update_noise_multiplier
from fedfields.privacy.dp import (
    CLIP_NORM_KEY,
    MAX_NOISE_RATIO_KEY,
    NOISE_TAIL,
    DPConfig,
    central_noise_std,
    clip_records,
    combined_noise_multiplier,
    distributed_noise_range,
    effective_noise_multiplier,
    noise_generator,
    noise_ratio,
    noised_records,
    scaled_difference,
    share_std,
)
from fedfields.privacy.secagg_plan import (
    SecureAggregationConfig,
    SecureAggregationError,
    payload_layout,
)

UpdateCheck = Callable[["Round", "CheckedReply"], None]
"""A strategy's own check of a checked reply (`ProtocolStrategy.check_update`): raises
`protocol.BadReply` to drop it."""


@dataclass(frozen=True)
class RoundOutcome:
    """What a round leaves: the new global arrays (None: no aggregate, the global stays), its
    train metrics and its ledger (who was asked, what came back, what it cost)."""

    arrays: ArrayRecord | None
    metrics: dict[str, float]
    ledger: RoundLedger

    @property
    def server_round(self) -> int:
        """The round this is the outcome of."""
        return self.ledger.server_round


@dataclass(frozen=True)
class SumRules:
    """How a strategy's replies are summed: the metric each is weighted by ("": 1; not under
    DP, whose sum weighs every reply 1), the records sent as differences from the arrays
    received, and under DP the key s of the ARRAYS record whose update is x - s g."""

    weight_metric: str = ""
    delta_records: tuple[str, ...] = ()
    dp_delta_scale: str = ""
    secure_bits: int = 0
    """b of compression 'quantise' under SecAgg+: the payload goes as packed b-bit codes of
    the update (ARRAYS as x - s g, s the `dp_delta_scale` entry or 1); 0: SecAgg+'s floats."""

    def deltas(self, privacy: RoundPrivacy | None) -> tuple[str, ...]:
        """Records summed as differences from what was sent: the strategy's, and ARRAYS too
        under DP (what DP clips is the update) or quantised codes (what is coded is the update)."""
        if privacy is None and not self.secure_bits:
            return self.delta_records
        return self.delta_records if ARRAYS in self.delta_records else (*self.delta_records, ARRAYS)

    def secure_config(self, privacy: RoundPrivacy | None) -> dict[str, int | float | str]:
        """The train-config entries telling SecAgg+ clients how to hold their replies back for
        this sum: the weight they apply, the records they send as differences, DP's shares."""
        own: dict[str, int | float | str] = {SECURE_AGGREGATION: True}
        if self.weight_metric and privacy is None:
            own[SECURE_WEIGHT] = self.weight_metric
        if deltas := self.deltas(privacy):
            own[SECURE_DELTA] = list(deltas)
        if self.secure_bits and self.dp_delta_scale:
            own[SECURE_DELTA_SCALE] = self.dp_delta_scale
        return own if privacy is None else own | privacy.client_config()


class Round:
    """One round opened over `ledger`'s sampled nodes: gate -> sum -> privacy -> ledger."""

    def __init__(
        self,
        ledger: RoundLedger,
        gate: ReplyGate,
        check_update: UpdateCheck,
        rules: SumRules,
        secure_aggregation: SecureAggregationConfig | None,
        privacy: RoundPrivacy | None,
    ) -> None:
        self.ledger = ledger
        self.gate = gate
        self.check_update = check_update
        self.rules = rules
        self.secure_aggregation = secure_aggregation
        self.privacy = privacy
        self.summed: RoundSum | None = None
        """The round's last sum (its payload's; a method may sum a query's replies first)."""
        self.context: RoundContext | None = None
        """What the method's server step knows of the round (`MethodStrategy` sets it)."""

    @classmethod
    def open(
        cls,
        ledger: RoundLedger,
        arrays: ArrayRecord,
        gate: ReplyGate,
        check_update: UpdateCheck,
        rules: SumRules,
        secure_aggregation: SecureAggregationConfig | None,
        privacy: RoundPrivacy | None,
    ) -> Round:
        """The round over `ledger`'s sampled nodes, sending `arrays`: the ledger takes their
        dtypes, SecAgg+'s t for the sample, and in plaintext or under DP read-only views of
        them, the update-norm check's and the DP updates' reference."""
        ledger.dtypes = {key: str(array.dtype) for key, array in arrays.items()}
        if secure_aggregation is not None:
            ledger.min_holders = secure_aggregation.min_holders(len(ledger.node_ids))
        if secure_aggregation is None or privacy is not None or rules.secure_bits:
            ledger.reference = arrays_to_state(arrays, copy=False)
            if gate.max_update_norm is not None:
                ledger.reference_norm = update_norm(ledger.reference)
        return cls(ledger, gate, check_update, rules, secure_aggregation, privacy)

    def messages(self, contents: list[RecordDict], sent: int, message_type: str) -> list[Message]:
        """One message per sampled node, in `ledger.node_ids`' order, carrying its `contents`;
        the ledger counts `sent` bytes down."""
        ledger = self.ledger
        ledger.bytes_down += sent
        return [
            Message(
                content=content,
                dst_node_id=node_id,
                message_type=message_type,
                group_id=str(ledger.server_round),
            )
            for node_id, content in zip(ledger.node_ids, contents, strict=True)
        ]

    @property
    def server_round(self) -> int:
        """The round's number."""
        return self.ledger.server_round

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The global arrays' shapes, the records' expected ones."""
        return self.ledger.shapes

    @property
    def reference(self) -> dict[str, Tensor]:
        """The arrays sent (read-only views; {} under secure aggregation without DP)."""
        return self.ledger.reference

    @property
    def deltas(self) -> tuple[str, ...]:
        """Records summed as differences from what was sent: the strategy's, and under DP
        ARRAYS too (what DP clips is the update, not the model)."""
        return self.rules.deltas(self.privacy)

    def checked(
        self,
        replies: Iterable[Message],
        records: Mapping[str, Shapes],
        scalars: Mapping[str, tuple[float, float]] | None = None,
    ) -> Iterator[CheckedReply]:
        """The plaintext replies that pass every check, the strategy's `check_update` last
        (`ReplyGate.checked`), weighted by the weight metric when the sum is."""
        weighted = bool(self.rules.weight_metric) and self.privacy is None
        return self.gate.checked(
            self.ledger,
            replies,
            records,
            lambda reply: self.check_update(self, reply),
            weighted=weighted,
            scalars=scalars,
        )

    def check_update_norm(
        self, node_id: int, state: Mapping[str, Tensor], scale: float = 1.0
    ) -> None:
        """The update-norm check of `state` / `scale` (a payload sent scaled by the client's
        own weight s is divided by it)."""
        self.gate.check_update_norm(self.ledger, node_id, state, scale)

    def sum(
        self,
        replies: Iterable[Message],
        records: Mapping[str, Shapes],
        *,
        scalars: Mapping[str, tuple[float, float]] | None = None,
        fold: ReplyFold | None = None,
    ) -> RoundSum | None:
        """sum_k w_k x_k of each of `records` over the round's replies, and sum_k w_k.

        Plaintext: each reply is checked in full (`checked`, with the metrics of `scalars`
        within their bounds), then folded in as it arrives: into the sums, or into `fold`.
        With secure aggregation: Flower SecAgg+'s sum of what the clients hold back, so the
        server never sees one client's record. w_k is the reply's weight metric (else 1);
        `deltas` records are differences from the arrays sent, in both modes. Under DP each
        update is clipped and the sum noised (`fedfields.flower.round`). None when
        nothing was summed (the ledger counts why).
        """
        ledger, privacy = self.ledger, self.privacy
        ledger.summed_nodes = []
        deltas = tuple(name for name in self.deltas if name in records)
        payload = ARRAYS in records  # not a query sum of GRADIENT records
        if self.secure_aggregation is None:
            summed = plain_sum(
                self.checked(replies, records, scalars),
                records,
                ledger.reference,
                deltas=deltas,
                privacy=None if privacy is None else privacy.central(payload),
                fold=fold,
            )
        else:
            summed = None
            held = list(self.gate.successful(ledger, replies))  # metrics: payloads held
            if held:
                noise = None if privacy is None else privacy.distributed(ledger, payload)
                bits = self.rules.secure_bits
                summed = masked_sum(
                    self.gate, ledger, self.secure_aggregation, held, records, noise, bits
                )
                if summed is not None and bits and ARRAYS in records:
                    restored = [name for name in deltas if name not in self.rules.delta_records]
                    with_reference(summed, ledger.reference, restored, self.rules.dp_delta_scale)
        if summed is not None:
            ledger.summed_nodes = list(summed.node_ids)
            if privacy is not None:
                summed = privacy.released(summed, ledger, deltas, self.rules.delta_records)
        self.summed = summed
        return summed

    def fail_sum(self, reason: str) -> None:
        """Count a sum that formed no usable aggregate (a summed weight that is not positive)
        and log why."""
        sum_failure(self.ledger, reason)

    def in_global_dtypes(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """`state` cast to the global arrays' dtypes (sums are float64); other keys as they are."""
        dtypes = self.ledger.dtypes
        return {
            key: value.to(getattr(torch, dtypes[key])) if key in dtypes else value
            for key, value in state.items()
        }

    def metrics(self) -> dict[str, float]:
        """The round's train metrics: the summed replies' metric means, counts and traffic
        (`round_metrics`), and under DP the accountant's charge for the round."""
        summed, secure = self.summed, self.secure_aggregation is not None
        if summed is None:
            record = round_metrics(self.ledger, [], None, secure)
        else:
            record = round_metrics(self.ledger, summed.metrics, summed.weights, secure)
        if self.privacy is not None:
            record |= self.privacy.charge(self.ledger)
        return record

    def outcome(
        self, arrays: ArrayRecord | None, extra: Mapping[str, float] | None = None
    ) -> RoundOutcome:
        """The round's end: `arrays` as the new global (None: none formed), the train metrics
        with the strategy's `extra` ones. An aggregate that is NaN or infinite in the global's
        dtypes is refused: the global stays and "non-finite-aggregate" is 1."""
        metrics = self.metrics() | dict(extra or {})
        if arrays is not None and not finite_arrays(arrays):
            where = f"round {self.ledger.server_round}"
            log(ERROR, "%s: the aggregate holds NaN or infinite values in the global's dtypes "
                "and is refused; the global model stays", where)  # fmt: skip
            metrics[NON_FINITE_AGGREGATE] = 1
            arrays = None
        return RoundOutcome(arrays, metrics, self.ledger)


# The ledger of a federated round: who was asked, what came back, what it cost.
#
# A `RoundLedger` is opened by the strategy's `begin_round` and filled by the reply gate (drops,
# failures, bytes up) and the sums (secure sums done or failed); `round_metrics` turns it and the
# clients' metrics into the round's train metrics. `EmptyTally` counts consecutive rounds that
# formed no aggregate, for `EmptyRoundsError`'s message.


SECURE_SUMS = "secure-sums"
"""Train metric: secure sums completed this round (present when secure aggregation is on)."""
SECURE_FAILURES = "secure-sum-failures"
"""Train metric: secure sums that halted this round (the round's aggregate is then skipped)."""


@dataclass
class RoundLedger:
    """What `configure_train` fixed for one round, and what its replies did to it."""

    server_round: int
    node_ids: list[int]
    num_nodes_total: int
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    grid: Grid
    users: list[str] = field(default_factory=list)
    """The sampled nodes' user keys, in `node_ids`' order (`fedfields.flower.strategy.UserKeys`)."""
    summed_nodes: list[int] = field(default_factory=list)
    """The nodes whose replies the round's (last) aggregate summed, in summation order."""
    bytes_down: int = 0
    bytes_up: int = 0
    num_failures: int = 0
    num_missing: int = 0
    """Sampled nodes that sent no reply before the timeout, over the round's exchanges."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Replies dropped by a check, per check ("non-finite", "shape", ...)."""
    secure_sums: int = 0
    failed_sums: int = 0
    """Sums that formed nothing usable: halted or unusable secure sums, and summed weights
    that were not positive (`sum_failure`)."""
    sum_error: str = ""
    """Why the round's last failed sum failed (value-free), for `EmptyRoundsError`."""
    secure_metrics: dict[str, float] | None = None
    min_holders: int = 2
    """Under secure aggregation, t: the fewest clients a sum of this round may be unmasked
    from, fixed when the round sampled (`SecureAggregationConfig.min_holders`)."""
    unmasked_holders: list[int] = field(default_factory=list)
    """Holders of each secure sum the server unmasked this round, released or refused after."""
    reference: dict[str, Tensor] = field(default_factory=dict)
    """The arrays sent (read-only views): the update-norm check's and the plaintext deltas'
    reference; {} under secure aggregation."""
    reference_norm: float = 0.0
    dp_multipliers: list[float] = field(default_factory=list)
    """Noise multiplier of each plaintext DP sum the round released (secure sums are charged
    from `unmasked_holders`)."""
    dp_charged: bool = False
    """Whether the accountant has charged this round."""

    @property
    def summed_users(self) -> list[str]:
        """The user keys of `summed_nodes`, in summation order."""
        keys = dict(zip(self.node_ids, self.users, strict=True))
        return [keys.get(node_id, fallback_key(node_id)) for node_id in self.summed_nodes]

    def count_drop(self, check: str) -> None:
        """One reply left out by `check`: a failure and a drop of that check."""
        self.num_failures += 1
        self.dropped[check] = self.dropped.get(check, 0) + 1


def round_metrics(
    ledger: RoundLedger,
    metrics: Sequence[Mapping[str, Any]],
    weights: Sequence[float] | None,
    secure: bool,
) -> dict[str, float]:
    """Mean of the clients' scalar metrics (weighted by `weights` if given; secure means
    included) plus the round's counts and traffic.

    Adds "num-replies", "num-failures" (error, unexpected and dropped replies), "num-missing"
    when some sampled node sent no reply before the timeout, "num-dropped" with a
    "dropped-<check>" count per check that dropped one, "bytes-up" and "bytes-down",
    and under secure aggregation "secure-sums" and "secure-sum-failures"; "num-examples" itself
    is not averaged.
    """
    weights = [1.0] * len(metrics) if weights is None else weights
    entries: dict[str, list[tuple[float, float]]] = {
        key: [(1.0, value)] for key, value in (ledger.secure_metrics or {}).items()
    }
    for values, weight in zip(metrics, weights, strict=True):
        for key, value in values.items():
            if key != NUM_EXAMPLES and not isinstance(value, list):
                entries.setdefault(key, []).append((weight, float(value)))
    secure_counts = {}
    if secure:
        secure_counts = {
            SECURE_SUMS: ledger.secure_sums,
            SECURE_FAILURES: ledger.failed_sums,
        }
    return {
        **{key: weighted_mean(pairs) for key, pairs in entries.items()},
        NUM_REPLIES: len(metrics),
        NUM_FAILURES: ledger.num_failures,
        **({NUM_MISSING: ledger.num_missing} if ledger.num_missing else {}),
        NUM_DROPPED: sum(ledger.dropped.values()),
        **{DROPPED_PREFIX + check: count for check, count in ledger.dropped.items()},
        BYTES_UP: ledger.bytes_up,
        BYTES_DOWN: ledger.bytes_down,
        **secure_counts,
    }


def weighted_mean(pairs: Sequence[tuple[float, float]]) -> float:
    """sum_k w_k v_k / sum_k w_k of finite (w_k > 0, v_k) pairs without overflow: weights and
    values are scaled to at most 1 first, so two clients' 1e308 average to 1e308, not inf."""
    weight_scale = max(weight for weight, _ in pairs)
    value_scale = max(abs(value) for _, value in pairs) or 1.0
    shares = [weight / weight_scale for weight, _ in pairs]
    scaled = math.fsum(
        share * (value / value_scale) for share, (_, value) in zip(shares, pairs, strict=True)
    )
    return scaled / math.fsum(shares) * value_scale


@dataclass
class EmptyTally:
    """What went wrong in consecutive rounds that formed no aggregate."""

    rounds: list[int] = field(default_factory=list)
    sampled: int = 0
    kept: int = 0
    failures: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    failed_sums: int = 0
    sum_error: str = ""
    non_finite: int = 0
    """Aggregates refused because they held NaN or infinite values."""

    def add(self, ledger: RoundLedger, kept: int, *, non_finite: bool = False) -> None:
        """Count one empty round; `kept` replies passed the checks (yet nothing came of it,
        or, if `non_finite`, an aggregate that was refused)."""
        self.rounds.append(ledger.server_round)
        self.non_finite += non_finite
        self.sampled += len(ledger.node_ids)
        self.kept += kept
        self.dropped.update(ledger.dropped)
        self.failures += ledger.num_failures - sum(ledger.dropped.values())
        self.failed_sums += ledger.failed_sums
        self.sum_error = ledger.sum_error or self.sum_error

    def commonest_cause(self) -> str | None:
        """The check that dropped most replies, "failed" (error replies) or "failed-sum"."""
        causes = Counter(self.dropped)
        if self.failures:
            causes["failed"] = self.failures
        if self.failed_sums:
            causes["failed-sum"] = self.failed_sums
        if self.non_finite:
            causes[NON_FINITE_AGGREGATE] = self.non_finite
        return causes.most_common(1)[0][0] if causes else None

    def counts(self, secure: bool) -> str:
        """Replies asked, kept, dropped (per check), failed, and secure sums failed."""
        drops = ", ".join(f"{DROPPED_PREFIX}{check} {n}" for check, n in self.dropped.most_common())
        line = (
            f"{self.sampled} replies asked, {self.kept} kept, {sum(self.dropped.values())} "
            f"dropped{f' ({drops})' if drops else ''}, {self.failures} failed"
        )
        return line + (f", {self.failed_sums} secure sums failed" if secure else "")


def round_counts(outcome_metrics: Mapping[str, Any], aggregated: bool) -> str:
    """A round's one log line, as Flower's strategies print theirs: the replies summed, those
    a check dropped, those that failed (errors, unexpected replies), the nodes that sent
    nothing, and whether an aggregate formed."""
    dropped = int(outcome_metrics.get(NUM_DROPPED, 0))
    failed = int(outcome_metrics.get(NUM_FAILURES, 0)) - dropped
    missing = int(outcome_metrics.get(NUM_MISSING, 0))
    line = (
        f"aggregate_train: {int(outcome_metrics.get(NUM_REPLIES, 0))} replies summed, "
        f"{dropped} dropped, {failed} failed"
    )
    line += f", {missing} missing" if missing else ""
    return line + ("" if aggregated else "; no aggregate, the global model stays")


# The reply gate: every check a reply passes before any of it reaches a sum.
#
# A plaintext reply with NaN/Inf, wrong shapes, missing or extra keys, integer or bool arrays
# where the global's are float (float16/32/64 arrays are cast to the global's dtype:
# `protocol.checked_dtype`), a NaN/Inf metric, a non-positive or absurd "num-examples" (above
# `max_num_examples`) or an update ||g_k - g|| above `max_update_norm` * max(||g||, 1) is dropped,
# logged at WARNING with node and check, and counted in the round's ledger ("num-failures",
# "num-dropped", "dropped-<check>"). Under secure aggregation a reply that holds nothing back
# is dropped ("held"). A metric under a name the server writes (`protocol.reserved_metric`,
# "dp-epsilon" say) drops its reply ("reserved-metric"). With compression on, a compressed ARRAYS
# record (or a GRADIENT record) is first rebuilt into the state it stands for
# (`fedfields.flower.upload_compression`), so every
# check runs on what will be summed; a malformed one is dropped ("compression"). `drop_reason`
# says in a user's words what a dropped reply lacked.


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


MIN_NUM_EXAMPLES = 1e-6
"""Least "num-examples" a weighted reply may carry: smaller weights (down to 5e-324) make the
products w_k x_k subnormal, and a mean of them off by tens of percent."""


@dataclass(frozen=True)
class ReplyGate:
    """The caps a reply must stay within (None: no cap) and the compression its ARRAYS record
    arrives under (None: sent whole); the checks write into the round."""

    max_num_examples: float | None
    max_update_norm: float | None
    compression: CompressionConfig | None = None
    delta_scale: str = ""
    """The ARRAYS key s of a payload s x (the client's own weight): its update is s x - s g."""
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
                        reply,
                        NUM_EXAMPLES,
                        positive=True,
                        at_least=MIN_NUM_EXAMPLES,
                        at_most=self.max_num_examples,
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
                f"the clients must report a finite {NUM_EXAMPLES!r} metric of at least "
                f"{MIN_NUM_EXAMPLES:g} (at most max-num-examples = "
                f"{self.max_num_examples or math.inf:g})"
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
        }
        return reasons.get(check, f"the replies failed the {check!r} check")


# One sum of a round's replies, in plaintext or through Flower's SecAgg+.
#
# Every fedfields strategy aggregates through it (`fedfields.flower.round.Round.sum`). A server
# step linear in the clients' records (the mean's methods, and those summing records of their
# own) takes sum_k w_k x_k and sum_k w_k: the plaintext sum folds each checked reply in as it
# arrives (`RunningSum`, O(model) memory), the secure sum is SecAgg+'s over what the clients
# hold back, so the server never sees one client's record. Records the clients send as
# differences from what they received (`deltas`) are summed as such in both modes. A method's
# own fold and the robust rules pass their `ReplyFold` to the plaintext sum, which checks and
# counts each reply as for any other. A halted or unusable secure sum is logged, counted in the
# round's "secure-sum-failures" and gives None: nothing raises.
#
# Central DP (`CentralPrivacy`, plaintext): each checked reply's update (its `deltas` records
# as differences from the arrays sent, the others as they are) is clipped to C over all its
# records jointly and summed with weight 1, and N(0, (z C)^2) is added to every entry of the
# sum. Under secure aggregation the clients do both (`fedfields.flower.secure_aggregation`).


@dataclass
class RoundSum:
    """sum_k w_k x_k per record (float64), sum_k w_k, and what the summed replies reported."""

    sums: dict[str, dict[str, Tensor]]
    """Per record, sum_k w_k x_k; {} when a `ReplyFold` took the replies instead."""
    weight: float
    node_ids: list[int]
    metrics: list[dict[str, Any]]
    weights: list[float] | None = None
    """Each summed reply's weight (plaintext); None under secure aggregation."""
    resolution: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per record and key, the secure sum's error bound (a sum within it may be 0); {} plain."""
    unclipped: float | None = None
    """Under DP, how many summed updates were within the clip norm: exact (central, noised by
    the caller) or the secure sum of the clients' noised bits (adaptive clipping only)."""

    def mean(self, record: str) -> dict[str, Tensor]:
        """sum_k w_k x_k / sum_k w_k of `record` (FedAvg's weighted mean), float64."""
        return {key: value / self.weight for key, value in self.sums[record].items()}


@dataclass(frozen=True)
class CentralPrivacy:
    """Central DP of one plaintext sum: each reply's update clipped to `clip_norm` over all
    its records jointly, weight 1, N(0, `noise_std`^2) added to the sum from `generator`;
    `delta_scale` names the key s of a delta record held as x - s g ("": x - g)."""

    clip_norm: float
    noise_std: float
    generator: torch.Generator
    delta_scale: str = ""


@dataclass(frozen=True)
class DistributedPrivacy:
    """Distributed DP of one secure sum: the SecAgg+ ranges of the noised records and of the
    metrics (`SecureSum`'s dp_range), and the metrics the server asks for (the weight, and
    under adaptive clipping the noised unclipped bits)."""

    record_range: float
    metric_range: float
    metric_keys: tuple[str, ...]


ReplyFold = Callable[[CheckedReply], None]
"""How a server step that is not linear in the records (a method's fold, the robust rules)
takes each checked reply in, instead of the sums."""


def plain_sum(
    checked: Iterable[CheckedReply],
    records: Iterable[str],
    reference: Mapping[str, Tensor],
    *,
    deltas: Sequence[str] = (),
    privacy: CentralPrivacy | None = None,
    fold: ReplyFold | None = None,
) -> RoundSum | None:
    """The `checked` replies' records summed as they arrive, each with its weight; `deltas`
    records (ARRAYS only) are summed as y_k - g with g the arrays sent (`reference`). With
    `privacy` each reply's update is clipped before it is added (weight 1) and the sum is
    noised. With `fold` each reply goes to it instead and the sum's records are {}. None when
    no reply passed."""
    for name in deltas:
        if name != ARRAYS:
            raise ValueError(f"only {ARRAYS!r} can be summed as a difference, not {name!r}")
    if privacy is not None and fold is not None:
        raise ValueError("a DP sum clips each update: no other fold bounds its sensitivity")
    totals = {} if fold is not None else {name: RunningSum() for name in records}
    node_ids, metrics, weights = [], [], []
    unclipped = 0
    for reply in checked:
        states: Mapping[str, Mapping[str, Tensor]] = reply.states
        if privacy is not None:
            states, norm = clipped_update(reply, reference, deltas, privacy)
            unclipped += norm <= privacy.clip_norm
        if fold is not None:
            fold(reply)
        for name, total in totals.items():
            total.add(states[name], reply.weight, checked=True)
        node_ids.append(reply.node_id)
        metrics.append(reply.metrics)
        weights.append(reply.weight)
    if not node_ids:
        return None
    weight = sum(weights)
    sums = {name: total.accumulated() for name, total in totals.items()}
    if privacy is not None:
        sums = noised_records(sums, privacy.noise_std, privacy.generator)
        return RoundSum(sums, weight, node_ids, metrics, weights, unclipped=unclipped)
    for name in deltas:
        sums[name] = {
            key: value - weight * reference[key].double() for key, value in sums[name].items()
        }
    return RoundSum(sums, weight, node_ids, metrics, weights)


def clipped_update(
    reply: CheckedReply,
    reference: Mapping[str, Tensor],
    deltas: Sequence[str],
    privacy: CentralPrivacy,
) -> tuple[dict[str, dict[str, Tensor]], float]:
    """The reply's update, float64: `deltas` records as x - s g (g the arrays sent), the others
    as they are, clipped to the clip norm over all records jointly; and its norm before."""
    update = {
        name: scaled_difference(state, reference, privacy.delta_scale)
        if name in deltas
        else {key: value.double() for key, value in state.items()}
        for name, state in reply.states.items()
    }
    return clip_records(update, privacy.clip_norm)


def masked_sum(
    gate: ReplyGate,
    ledger: RoundLedger,
    config: SecureAggregationConfig,
    replies: Sequence[Message],
    records: Mapping[str, Shapes],
    privacy: DistributedPrivacy | None = None,
    bits: int = 0,
) -> RoundSum | None:
    """SecAgg+'s sum of the `records` the replying clients hold (weighted on the clients),
    with the weight and their held metrics' weighted means (the round's secure metrics),
    unmasked from at least the round's `min_holders` clients; with `bits` as packed b-bit codes
    (compression 'quantise', `fedfields.privacy.packed_sum`). Under distributed DP
    (`privacy`) only its metric keys are summed beside the noised records: the clients' other
    metrics carry no noise and stay on the nodes.

    A reply that does not hold every record is dropped ("held"). A halted SecAgg+ run, a
    summed weight not above the sum's resolution or a non-finite sum is a secure-sum failure:
    logged as an ERROR, counted, None. Every unmasked sum's holders go to
    `ledger.unmasked_holders`, used or not (DP charges each).
    """
    holding = gate.holding(ledger, replies, records)
    if not holding:
        return None
    metric_keys = held_metric_keys(holding) if privacy is None else list(privacy.metric_keys)
    layout = payload_layout({**records, METRICS: dict.fromkeys(metric_keys, (1,))})
    node_ids = [reply.metadata.src_node_id for reply in holding]
    secure = SecureSum(config, bits)
    dp_range = None if privacy is None else (privacy.record_range, privacy.metric_range)
    try:
        result = secure(ledger.grid, node_ids, layout, ledger.server_round,
                        ledger.min_holders, dp_range)  # fmt: skip
    except SecureAggregationError as error:
        return sum_failure(ledger, f"SecAgg+ halted: {error}")
    ledger.unmasked_holders.append(len(result.node_ids))
    ledger.bytes_up += result.bytes_up
    held_metrics = result.sums.pop(METRICS)
    weight = float(held_metrics.pop(WEIGHT_KEY))
    unclipped = held_metrics.pop(DP_UNCLIPPED, None)
    if not (math.isfinite(weight) and weight > result.resolution[METRICS][WEIGHT_KEY]):
        return sum_failure(
            ledger, "the summed weight is not positive (not above the secure sum's resolution)"
        )
    if not all(bool(torch.isfinite(v).all()) for s in result.sums.values() for v in s.values()):
        return sum_failure(ledger, "a summed record holds NaN or infinite values")
    metric_means = {key: float(value) / weight for key, value in held_metrics.items()}
    if not all(math.isfinite(value) for value in metric_means.values()):
        return sum_failure(ledger, "a summed metric is NaN or infinite")
    ledger.secure_sums += 1
    ledger.secure_metrics = metric_means
    summed = set(result.node_ids)
    metrics = [reply_metrics(r) for r in holding if r.metadata.src_node_id in summed]
    return RoundSum(
        result.sums, weight, list(result.node_ids), metrics, None, result.resolution,
        None if unclipped is None else float(unclipped),
    )  # fmt: skip


def with_reference(
    summed: RoundSum, reference: Mapping[str, Tensor], names: Iterable[str], scale_key: str = ""
) -> RoundSum:
    """`summed` with its `names` records, summed as differences x_k - s_k g from the arrays
    sent g, back as sum_k x_k: plus (sum_k s_k) g, s_k the record's `scale_key` entry
    (the client's own weight) or each reply's weight."""
    for name in names:
        total = summed.sums[name]
        scale = float(total[scale_key].double().sum()) if scale_key else summed.weight
        for key, value in reference.items():
            total[key] = total[key] + scale * value.double()
    return summed


def journal_charge(entry: Mapping[str, Any]) -> RoundCharge:
    """The charge of a journal entry (`RoundPrivacy.write_ahead`): its round's released sums
    combined, k of n; ValueError naming what is malformed."""
    try:
        multipliers = [float(z) for z in entry["multipliers"]]
        sampled, population = int(entry["sampled"]), int(entry["population"])
        z = combined_noise_multiplier(multipliers)
        return RoundCharge(sampled / population, z, sampled, population)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"DP journal entry is malformed: {error}") from None


def sum_failure(ledger: RoundLedger, reason: str) -> None:
    """Count a sum that cannot be used (a halted or unusable secure sum, a summed weight
    that is not positive; "secure-sum-failures" under secure aggregation) and log it; None."""
    ledger.failed_sums += 1
    ledger.sum_error = reason
    where = f"round {ledger.server_round}"
    log(ERROR, "%s: the sum failed, nothing of it is used: %s", where, reason)


def held_metric_keys(replies: Sequence[Message]) -> list[str]:
    """Metrics held by every reply (`ReplyGate.holding`), the weight included."""
    common: set[str] | None = None
    for reply in replies:
        keys = set(reply.content.config_records[HELD].get(HELD_METRICS, []))
        common = keys if common is None else common & keys
    return sorted((common or set()) | {WEIGHT_KEY})


# Client-level DP of a strategy's rounds: what each sum clips and noises, and the accountant.
#
# Plaintext sums clip each reply's update and the server adds N(0, (z C)^2) (central DP,
# `central`); under secure aggregation the clients clip and add their share of that noise
# before masking (distributed DP, `client_config`), calibrated so that t - 1 shares carry z C,
# t the fewest holders a sum of the round is unmasked from (`RoundLedger.min_holders`): every
# unmasked sum of h holders, and its neighbour with one fewer, carries at least
# z sqrt((h - 1) / (t - 1)) >= z (`effective_noise_multiplier`), and each is charged that.
# Weights are uniform. One `DPAccountant` per run is
# charged once a round with q = sampled / connected and the multiplier combined over the round's
# noised sums ("dp-epsilon" after it); a plan beyond dp-target-epsilon is refused
# (`check_plan`) and a round whose worst-case charge would exceed it is not run
# (`check_budget`, `PrivacyBudgetSpent`).


DP_EPSILON = EPSILON_METRIC
"""Train metric: epsilon at dp-delta spent by the run so far (DP runs only)."""
DP_ROUND_MULTIPLIER = "dp-round-noise-multiplier"
"""Train metric: the noise multiplier the accountant charged this round (DP runs only)."""
DP_NEXT_CLIP_NORM = "dp-next-clip-norm"
"""Train metric under adaptive clipping: the clip norm C the next round will use."""


class PrivacyBudgetSpent(RuntimeError):
    """The next round's charge would take epsilon above dp-target-epsilon: the run ends
    before it, cleanly (nothing of that round was sent; the rounds before it stand)."""


class RoundPrivacy:
    """The DP state of one strategy's run: its settings, accountant and noise generator.

    `sums_per_round(round)` is the strategy's count of noised sums a round makes over its
    sampled clients; `delta_scale` names the key s of a record sent as x - s g (the
    client's own weight), "" for x - g.
    """

    def __init__(
        self,
        config: DPConfig,
        secure_aggregation: SecureAggregationConfig | None,
        sums_per_round: Callable[[int], int],
        delta_scale: str = "",
    ) -> None:
        self.config = config
        self.secure_aggregation = secure_aggregation
        self.sums_per_round = sums_per_round
        self.delta_scale = delta_scale
        self.accountant = DPAccountant(config.delta)
        self.stop = ""
        """Why the run stopped before its last round to stay within dp-target-epsilon."""
        self.noise: torch.Generator | None = None
        """The central DP noise's generator, secret-seeded at first use (`noise_generator`);
        tests may set a seeded one. Never seeded from run-config: the server could subtract."""
        self.clip_norm = config.clip_norm
        """C of the next sum: dp-clip-norm, moved after each round under adaptive clipping."""
        self.count_std = 0.0 if config.adaptive is None else config.adaptive.count_stddev
        """Adaptive clipping's sigma_b: as set, else fixed at the first round (`start`)."""
        self.payload_noise_std = 0.0
        """Std of the noise on each entry of the latest payload sum (at least; more holders
        add more), z C at the C it was clipped to."""
        self.journal: Callable[[dict[str, Any]], None] | None = None
        """Where a noised sum released before its round is charged is written first (a run
        directory's file, `simulations.job`), so a crash between the two cannot leave it
        uncharged: a resumed run charges what the journal holds past its checkpoint."""

    def before_round(
        self, server_round: int, num_sampled: int, connected: int, num_params: int, first: bool
    ) -> None:
        """Before anything of a round is sent: at the run's `first` round adaptive clipping's
        sigma_b (`start`) and the pre-flight noise check (`check_noise`), then the round's
        budget (`check_budget`: PrivacyBudgetSpent)."""
        if first:
            self.start(num_sampled)
            self.check_noise(num_sampled, num_params)
        self.check_budget(server_round, num_sampled, connected)

    def start(self, num_sampled: int) -> None:
        """Fix adaptive clipping's sigma_b from the first round's sample (unless set or
        resumed); ValueError naming the keys when it is too small for z."""
        adaptive = self.config.adaptive
        if adaptive is None:
            return
        if self.count_std == 0:
            self.count_std = adaptive.count_noise_std(num_sampled)
        update_noise_multiplier(self.config.noise_multiplier, self.count_std)

    @property
    def update_multiplier(self) -> float:
        """The multiplier of a payload sum's noise: z, or under adaptive clipping z_Delta, which
        with the count's sigma_b composes to z (`update_noise_multiplier`); z while sigma_b
        waits for the first round's sample (`start`)."""
        if self.config.adaptive is None or self.count_std == 0:
            return self.config.noise_multiplier
        return update_noise_multiplier(self.config.noise_multiplier, self.count_std)

    @property
    def gradient_clip_norm(self) -> float:
        """C of a query sum of GRADIENT records: dp-gradient-clip-norm, else the payload's C."""
        return self.config.gradient_clip_norm or self.clip_norm

    @classmethod
    def of_strategy(
        cls,
        config: DPConfig | None,
        secure_aggregation: SecureAggregationConfig | None,
        sums_per_round: Callable[[int], int],
        delta_scale: str,
        checks: tuple[str, int],
    ) -> RoundPrivacy | None:
        """A strategy's DP state, its settings checked against `checks`, the strategy's
        (weight metric, min-train-nodes) (`check_settings`); None without DP."""
        if config is None or not config.enabled:
            return None
        privacy = cls(config, secure_aggregation, sums_per_round, delta_scale)
        privacy.check_settings(*checks)
        return privacy

    def check_settings(self, weight_metric: str, min_train_nodes: int) -> None:
        """Log the uniform weights DP needs instead of `weight_metric`; refuse a fixed SecAgg+
        clipping range without room for the noise shares of `min_train_nodes` clients."""
        if weight_metric:
            reason = "the sum's sensitivity to one client is then the clip norm C"
            message = "differential privacy: replies weigh 1 each, not %r: %s"
            log(INFO, message, weight_metric, reason)
        secure, dp = self.secure_aggregation, self.config
        if secure is not None and secure.clipping_range > 0:
            holders = secure.min_holders(max(min_train_nodes, 2))
            needed = distributed_noise_range(dp.noise_multiplier, dp.clip_norm, holders)
            if secure.clipping_range < needed:
                raise ValueError(
                    f"secagg-clipping-range = {secure.clipping_range:g} leaves no room for the DP "
                    f"noise: a clipped value ({CLIP_NORM_KEY} = {dp.clip_norm:g}) plus "
                    f"{NOISE_TAIL:g} noise-share stds needs >= {needed:.4g}; raise it, or set it "
                    "to 0 (the range then follows from C, z and the round's holders)"
                )

    def distributed(self, ledger: RoundLedger, payload: bool) -> DistributedPrivacy:
        """A secure DP sum of `ledger`: the records' SecAgg+ range (a fixed
        secagg-clipping-range as set, else C plus the noise tail for its t holders,
        `distributed_noise_range`), the metrics' (the weight, 1 a client, and under adaptive
        clipping the noised bits) and the metrics asked for; `payload` False for a
        query sum of GRADIENT records (no bits)."""
        holders = ledger.min_holders
        adaptive = payload and self.config.adaptive is not None
        if payload:
            self.payload_noise_std = central_noise_std(self.update_multiplier, self.clip_norm)
        secure = self.secure_aggregation
        if secure is not None and secure.clipping_range > 0:
            record_range = secure.clipping_range
        else:
            clip_norm = max(self.clip_norm, self.gradient_clip_norm)
            record_range = distributed_noise_range(self.update_multiplier, clip_norm, holders)
        metric_range = 1.0
        if adaptive:
            metric_range += NOISE_TAIL * share_std(self.count_std, holders)
        keys = (WEIGHT_KEY, DP_UNCLIPPED) if adaptive else (WEIGHT_KEY,)
        return DistributedPrivacy(record_range, metric_range, keys)

    def client_config(self) -> dict[str, float | str]:
        """Train-config entries a secure client needs to clip and add its noise share (and
        under adaptive clipping its noised bit; the GRADIENT records' own clip norm when set)."""
        entries: dict[str, float | str] = {
            DP_CLIP_NORM: self.clip_norm,
            DP_NOISE_MULTIPLIER: self.update_multiplier,
        }
        if self.config.adaptive is not None:
            entries[DP_COUNT_STDDEV] = self.count_std
        if self.config.gradient_clip_norm:
            entries[DP_GRADIENT_CLIP_NORM] = self.config.gradient_clip_norm
        if self.delta_scale:
            entries[SECURE_DELTA_SCALE] = self.delta_scale
        return entries

    # The accountant: the plan, each round's budget and its charge.

    def planned_multiplier(self, server_round: int) -> float:
        """The noise multiplier a round is charged at worst: z per sum (a secure sum is never
        unmasked from fewer than the t holders its noise shares are calibrated to), combined
        over its sums."""
        sums = self.sums_per_round(server_round)
        return combined_noise_multiplier([self.config.noise_multiplier] * sums)

    def check_plan(self, first_round: int, num_rounds: int, fraction_train: float) -> float:
        """The epsilon rounds `first_round`..`num_rounds` would spend at sampling rate
        `fraction_train` (on top of what the accountant holds), logged; ValueError naming
        dp-target-epsilon when it exceeds the target, or the adaptive-clipping keys when a set
        dp-clipped-count-stddev is too small for z."""
        adaptive = self.config.adaptive
        if adaptive is not None and adaptive.count_stddev > 0:  # before anything is written
            update_noise_multiplier(self.config.noise_multiplier, adaptive.count_stddev)
        planned = [
            RoundCharge(min(fraction_train, 1.0), self.planned_multiplier(server_round))
            for server_round in range(first_round, num_rounds + 1)
        ]
        epsilon = check_plan(self.config, [*self.accountant.charges, *planned])
        plan = f"q = fraction-train {fraction_train:g}, no dropouts"
        log(INFO, "differential privacy: the plan (%s) spends epsilon %.4g at delta %g", plan,
            epsilon, self.config.delta)  # fmt: skip
        return epsilon

    def check_noise(self, num_sampled: int, num_params: int) -> float:
        """The pre-flight z sqrt(d) / n of a round of `num_sampled` clients on a model of
        `num_params` entries (`noise_ratio`): logged as a WARNING above 1, refused with a
        ValueError naming dp-max-noise-ratio above it (0: no limit)."""
        ratio = noise_ratio(self.config.noise_multiplier, num_params, num_sampled)
        limit = self.config.max_noise_ratio
        what = (
            f"the DP noise on the mean update is z sqrt(d) / n = {ratio:.3g} times the largest "
            f"update a client may send (z = {self.config.noise_multiplier:g}, d = {num_params} "
            f"entries, n = {num_sampled} clients a round)"
        )
        if limit and ratio > limit:
            raise ValueError(
                f"differential privacy: {what}, above {MAX_NOISE_RATIO_KEY} = {limit:g}: the "
                "rounds would move the model by noise. Sample more clients a round, lower z or "
                f"use a smaller model; set {MAX_NOISE_RATIO_KEY}=0 to run anyway"
            )
        if ratio > 1:
            log(WARNING, "differential privacy: %s; above 1 a round moves the model by more "
                "noise than signal", what)  # fmt: skip
        return ratio

    def check_budget(self, server_round: int, num_sampled: int, connected: int) -> None:
        """Raise PrivacyBudgetSpent when this round's worst-case charge would take epsilon
        above dp-target-epsilon (before anything of the round is sent)."""
        target = self.config.target_epsilon
        if target == 0:
            return
        sampling_rate = num_sampled / connected
        z = self.planned_multiplier(server_round)
        after = self.accountant.epsilon_after(sampling_rate, z, 1, num_sampled, connected)
        if after > target:
            self.stop = (
                f"round {server_round} not run: its charge (q = {sampling_rate:.4g}, z = {z:.4g}) "
                f"would take epsilon from {self.accountant.epsilon():.4g} to {after:.4g}, above "
                f"dp-target-epsilon = {target:g}; the run stops after round {server_round - 1}"
            )
            raise PrivacyBudgetSpent(self.stop)

    def multipliers(self, ledger: RoundLedger) -> list[float]:
        """The noise multipliers of the sums `ledger`'s round has released so far: each
        plaintext sum's, each unmasked secure sum's z sqrt((h - 1) / (t - 1)) for its h
        holders (`effective_noise_multiplier`)."""
        multipliers = list(ledger.dp_multipliers)
        if self.secure_aggregation is not None:
            z, holders = self.config.noise_multiplier, ledger.min_holders
            multipliers += [
                effective_noise_multiplier(z, holders, summed) for summed in ledger.unmasked_holders
            ]
        return multipliers

    def write_ahead(self, ledger: RoundLedger) -> None:
        """Before a noised sum leaves the server ahead of its round's charge (a query's sum
        sent with the train messages), write what the round has released so far to the
        journal; a resumed run charges it if the round never finished (`journal_charge`)."""
        if self.journal is None:
            return
        self.journal(
            {
                "round": ledger.server_round,
                "multipliers": self.multipliers(ledger),
                "sampled": len(ledger.node_ids),
                "population": ledger.num_nodes_total,
            }
        )

    def charge(self, ledger: RoundLedger) -> dict[str, float]:
        """Charge the round's noised sums once (q = sampled / connected, z combined over its
        sums: each plaintext sum released, each secure sum unmasked, used or not, at
        z sqrt((h - 1) / (t - 1)) for its h holders); the DP train metrics (epsilon three ways,
        `DPAccountant.report`). A round that unmasked and released no sum is not charged."""
        metrics: dict[str, float] = {}
        if self.config.adaptive is not None:
            metrics[DP_NEXT_CLIP_NORM] = self.clip_norm
        multipliers = self.multipliers(ledger)
        if not ledger.dp_charged and multipliers:
            ledger.dp_charged = True
            z = combined_noise_multiplier(multipliers)
            sampled, connected = len(ledger.node_ids), ledger.num_nodes_total
            self.accountant.charge(sampled / connected, z, sampled, connected)
            metrics[DP_ROUND_MULTIPLIER] = z
        return {**metrics, **self.accountant.report()}

    # The sums.

    def central(self, payload: bool = True) -> CentralPrivacy:
        """The plaintext sum's clip and noise: std z C on the sum (z_Delta C under adaptive
        clipping); a query sum of GRADIENT records (`payload` False) at its own clip norm."""
        if self.noise is None:
            self.noise = noise_generator()
        if not payload:
            clip_norm = self.gradient_clip_norm
            std = central_noise_std(self.config.noise_multiplier, clip_norm)
            return CentralPrivacy(clip_norm, std, self.noise)
        std = central_noise_std(self.update_multiplier, self.clip_norm)
        self.payload_noise_std = std
        return CentralPrivacy(self.clip_norm, std, self.noise, self.delta_scale)

    def released(
        self,
        summed: RoundSum,
        ledger: RoundLedger,
        deltas: Sequence[str],
        delta_records: tuple[str, ...],
    ) -> RoundSum:
        """Note a plaintext sum's multiplier z (a secure sum's is noted when unmasked,
        `charge`), then its ARRAYS back in the form the strategy sums (`delta_records` stays as
        differences): sum_k (x_k - s_k g) + (sum_k s_k) g, with the summed s (the noised sum of
        the clients' own weights) or the number summed."""
        if self.secure_aggregation is None:
            ledger.dp_multipliers.append(self.config.noise_multiplier)
        if self.config.adaptive is not None and ARRAYS in summed.sums:
            self.adapt(summed)
        restored = [name for name in deltas if name not in delta_records]
        return with_reference(summed, ledger.reference, restored, self.delta_scale)

    def adapt(self, summed: RoundSum) -> None:
        """Move C by the geometric update from the noised count of unclipped updates (the
        secure sum of the clients' noised bits, or the exact count plus N(0, sigma_b^2))."""
        adaptive = self.config.adaptive
        assert adaptive is not None and summed.unclipped is not None
        noised = summed.unclipped
        if self.secure_aggregation is None:
            assert self.noise is not None
            noised += float(torch.randn((), generator=self.noise, dtype=torch.float64)) * (
                self.count_std
            )
        self.clip_norm = next_clip_norm(self.clip_norm, noised, len(summed.node_ids), adaptive)

    # Resume.

    def resumable_state(self) -> dict[str, Any]:
        """The accountant's charges, so a resumed run continues its epsilon, and the clip norm
        and sigma_b adaptive clipping reached."""
        return {
            "dp-accountant": self.accountant.state_dict(),
            "dp-clip-norm": self.clip_norm,
            "dp-count-stddev": self.count_std,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what `resumable_state` returned; ValueError without it (epsilon would
        restart at 0)."""
        if "dp-accountant" not in state:
            raise ValueError("the checkpoint holds no DP accountant: epsilon would restart")
        self.accountant = DPAccountant.from_state_dict(state["dp-accountant"])
        self.clip_norm = float(state.get("dp-clip-norm", self.config.clip_norm))
        self.count_std = float(state.get("dp-count-stddev", 0.0))
