"""The ledger of a federated round: who was asked, what came back, what it cost.

A `RoundLedger` is opened by the strategy's `begin_round` and filled by the reply gate (drops,
failures, bytes up) and the sums (secure sums done or failed); `round_metrics` turns it and the
clients' metrics into the round's train metrics. `EmptyTally` counts consecutive rounds that
formed no aggregate, for `EmptyRoundsError`'s message.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.serverapp import Grid
from torch import Tensor

from fedfields.flower.protocol import (
    BYTES_DOWN,
    BYTES_UP,
    DROPPED_PREFIX,
    NON_FINITE_AGGREGATE,
    NUM_DROPPED,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_MISSING,
    NUM_REPLIES,
)
from fedfields.flower.user_keys import fallback_key

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
    """The sampled nodes' user keys, in `node_ids`' order (`fedfields.flower.user_keys`)."""
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
    """Sums that formed nothing usable: halted or unusable secure sums, and DecentNeRF's alpha
    sums that were not positive (`sum_replies.sum_failure`)."""
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
