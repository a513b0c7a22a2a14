"""One federated round as a value: its reply gate, its one sum, client-level DP and its ledger.

`ProtocolStrategy.begin_round` samples the round's nodes and opens a `Round` over them. The
strategy's `aggregate` hook reads the replies through it: `sum` checks each reply
(`checked`: the reply gate, then the strategy's `check_update`) and folds it into the one sum
of `fedfields.flower.sum_replies`, in plaintext or through SecAgg+, clipped and noised under
DP; a server step that is not linear in the records (a method's own fold, the robust rules)
passes its own `ReplyFold`, and still each reply is checked, counted and summed once. The
round ends in `outcome`: the new global arrays (None: the global stays; an aggregate that is
not finite in the global's dtypes is refused), the round's train metrics (`metrics`: client
means, counts, traffic, epsilon) and its ledger. The loop hands that `RoundOutcome` to
evaluation, observers, checkpoint and report; nobody reads a round's results off the
strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from logging import ERROR

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common.logger import log
from torch import Tensor

from fedfields.flower.protocol import (
    ARRAYS,
    NON_FINITE_AGGREGATE,
    SECURE_AGGREGATION,
    SECURE_DELTA,
    SECURE_DELTA_SCALE,
    SECURE_WEIGHT,
    Shapes,
    arrays_to_state,
    finite_arrays,
)
from fedfields.flower.reply_gate import CheckedReply, ReplyGate
from fedfields.flower.round_ledger import RoundLedger, round_metrics
from fedfields.flower.round_privacy import RoundPrivacy
from fedfields.flower.sum_replies import (
    ReplyFold,
    RoundSum,
    masked_sum,
    plain_sum,
    sum_failure,
    with_reference,
)
from fedfields.methods.base import RoundContext
from fedfields.methods.states import update_norm
from fedfields.privacy.secagg_plan import SecureAggregationConfig

UpdateCheck = Callable[["Round", CheckedReply], None]
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
        """The update-norm check of `state` / `scale` (DecentNeRF divides out alpha_k)."""
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
        update is clipped and the sum noised (`fedfields.flower.round_privacy`). None when
        nothing was summed (the ledger counts why).
        """
        ledger, privacy = self.ledger, self.privacy
        ledger.summed_nodes = []
        deltas = tuple(name for name in self.deltas if name in records)
        payload = ARRAYS in records  # not DecentNeRF's gradient query
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
        """Count a sum that formed no usable aggregate (DecentNeRF's alpha sum) and log why."""
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
        (`round_ledger.round_metrics`), and under DP the accountant's charge for the round."""
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
