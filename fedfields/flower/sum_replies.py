"""One sum of a round's replies, in plaintext or through Flower's SecAgg+.

Every fedfields strategy aggregates through it (`fedfields.flower.round.Round.sum`). A server
step linear in the clients' records (the mean's methods, and those summing records of their
own) takes sum_k w_k x_k and sum_k w_k: the plaintext sum folds each checked reply in as it
arrives (`RunningSum`, O(model) memory), the secure sum is SecAgg+'s over what the clients
hold back, so the server never sees one client's record. Records the clients send as
differences from what they received (`deltas`) are summed as such in both modes. A method's
own fold and the robust rules pass their `ReplyFold` to the plaintext sum, which checks and
counts each reply as for any other. A halted or unusable secure sum is logged, counted in the
round's "secure-sum-failures" and gives None: nothing raises.

Central DP (`CentralPrivacy`, plaintext): each checked reply's update (its `deltas` records
as differences from the arrays sent, the others as they are) is clipped to C over all its
records jointly and summed with weight 1, and N(0, (z C)^2) is added to every entry of the
sum. Under secure aggregation the clients do both (`fedfields.flower.secure_aggregation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import ERROR
from typing import Any

import torch
from flwr.app import Message
from flwr.common.logger import log
from torch import Tensor

from fedfields.flower.protocol import (
    ARRAYS,
    DP_UNCLIPPED,
    HELD,
    HELD_METRICS,
    METRICS,
    WEIGHT_KEY,
    Shapes,
)
from fedfields.flower.reply_gate import CheckedReply, ReplyGate, reply_metrics
from fedfields.flower.round_ledger import RoundLedger
from fedfields.flower.secagg_workflow import SecureSum
from fedfields.methods.states import RunningSum
from fedfields.privacy.dp import clip_records, noised_records, scaled_difference
from fedfields.privacy.secagg_plan import (
    SecureAggregationConfig,
    SecureAggregationError,
    payload_layout,
)


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
    (DecentNeRF's alpha_k) or each reply's weight."""
    for name in names:
        total = summed.sums[name]
        scale = float(total[scale_key].double().sum()) if scale_key else summed.weight
        for key, value in reference.items():
            total[key] = total[key] + scale * value.double()
    return summed


def sum_failure(ledger: RoundLedger, reason: str) -> None:
    """Count a sum that cannot be used (a halted or unusable secure sum, DecentNeRF's alpha sum
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
