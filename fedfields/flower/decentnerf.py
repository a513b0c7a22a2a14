"""DecentNeRF learned federation (Algorithm 1 of the DecentNeRF paper) on the fedfields protocol:
the server strategy (`DecentNeRF`) and the client's half (`DecentNeRFClient`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import ERROR, WARNING
from typing import Any, Unpack

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.flower.node import NodeState
from fedfields.flower.protocol import (
    AGGREGATE_ROUND,
    ALPHA_LR,
    ALPHA_MAX,
    ALPHA_SUM,
    ARRAYS,
    CONFIG,
    GRADIENT,
    GRADIENT_COMPRESSED,
    GRADIENT_QUERY,
    SERVER_ROUND,
    STRATEGY,
    BadReply,
    ReplyParts,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.round import CheckedReply, Round, RoundOutcome
from fedfields.flower.strategy import ProtocolStrategy, StrategyOptions
from fedfields.flower.upload_compression import compressed_gradient
from fedfields.methods import (
    ALPHA_KEY,
    DECENTNERF_COST,
    alpha_update,
    alpha_weighted_payload,
    decentnerf_aggregate,
)
from fedfields.methods.base import check_scalar, update_norm
from fedfields.methods.settings import (
    NON_NEGATIVE,
    StrategySettings,
    optional_cap,
    setting,
    within,
)

DEFAULT_ALPHA_MAX = 100.0
"""Largest alpha_k a plaintext reply may carry: alphas start at 1, so 100 lets one user weigh
a hundred times an untouched one before its reply is dropped."""
ALPHA_FLOOR = 1e-6
"""A client's alpha_k never falls below alpha-max * ALPHA_FLOOR: a positive weight that
leaves its user in the sum with a negligible share, where alpha_k <= 0 would break it."""
DP_ALPHA_MARGIN = 3.0
"""Under DP the noised sum of alpha_k divides the payload's: a sum within this many noise stds
(z C) of 0 forms no aggregate rather than amplifying the noise."""
DEFAULT_MAX_GRADIENT_NORM = 1e4
"""Largest ||G_k|| a plaintext gradient reply may have: far above an honest user's, which grows
as beta-min falls (the colour loss is weighted by up to 1/(2 beta_min^2)) and shrinks as the
field trains (docs/MODES.md gives the norms measured); one oversized G_k would move every
user's alpha."""


@dataclass(frozen=True)
class DecentNeRFSettings(StrategySettings):
    """DecentNeRF's run-config keys."""

    alpha_lr: float = setting(
        1.0,
        "alpha-lr",
        "DecentNeRF eta of the learned federation (0: FedAvg weights)",
        NON_NEGATIVE,
    )
    alpha_max: float = setting(
        DEFAULT_ALPHA_MAX,
        "alpha-max",
        "DecentNeRF: a reply with alpha_k outside [alpha-max * 1e-6, alpha-max] is dropped; "
        "in [1, 1e6] (alphas start at 1; a larger one overflows the float32 payload)",
        within(1.0, 1e6),
    )
    max_gradient_norm: float = setting(
        DEFAULT_MAX_GRADIENT_NORM,
        "max-gradient-norm",
        "DecentNeRF: a gradient reply with ||G_k|| above it is dropped (0: no cap)",
        NON_NEGATIVE,
    )


class DecentNeRF(ProtocolStrategy):
    """DecentNeRF: g^(m) = sum_k alpha_k g_k / sum_k alpha_k from summed payloads only.

    Round m >= 2 opens with a gradient query (message type GRADIENT_QUERY carrying ARRAYS =
    g^(m-1) and CONFIG) to the sampled nodes; their GRADIENT replies G_k are summed and
    G = sum_k G_k goes out with the train messages under GRADIENT, with the summed alpha
    A^(m-1) that normalised g^(m-1) ("alpha-sum") and its round ("aggregate-round"). G sums
    the users sampled in round m, so L in dL/dalpha is theirs. Clients own alpha_k: they
    update it (`alpha_update`, exact through the normalised aggregation), train, and reply
    ARRAYS = alpha_k g_k plus alpha_k under `ALPHA_KEY` (`alpha_weighted_payload`). The
    server only sums (the round's sum, plaintext or SecAgg+) and divides by the
    summed alpha (`decentnerf_aggregate`): it never reads one client's alpha and ignores
    "num-examples". A failed or missing reply is left out of a sum; dividing by the
    remaining clients' summed alpha keeps the aggregate's scale. If no gradient reply
    arrives, no GRADIENT is sent and clients keep their alpha. Without secure aggregation a
    bad reply is dropped before it reaches a sum (`fedfields.flower.round`): besides
    the shared checks, a payload's alpha_k must lie in [alpha_max * 1e-6, alpha_max] and its g_k =
    payload / alpha_k obeys `max_update_norm`; a gradient reply's ||G_k|| must not exceed
    `max_gradient_norm`. Under DP (`differential_privacy`) a payload is summed as
    (alpha_k (g_k - g), alpha_k), clipped to C jointly, and G_k is clipped to C; both sums are
    noised, so a round from 2 on is charged z / sqrt(2) (docs/PRIVACY.md).

    Args:
        alpha_lr: eta in alpha_k <- alpha_k - eta dL/dalpha_k, sent as "alpha-lr". The paper
            gives no value; dL/dalpha scales with the model and the users' losses, so tune
            eta per setting (docs/BENCHMARKS.md gives the values measured).
        query_timeout: seconds to wait for gradient replies; None takes `node_timeout`
            (None there too waits for all).
        alpha_max: a plaintext reply whose alpha_k is outside [alpha_max * 1e-6, alpha_max]
            is dropped.
        max_gradient_norm: a plaintext gradient reply with ||G_k|| above it is dropped (0 or
            None: no cap); raise it with beta-min far below NeRF-W's 0.03.
        **options: sampling and "local-steps" (`StrategyOptions`), as for `fedfields.flower.FedAvg`.
    """

    strategy_name = "decentnerf"
    dp_delta_scale = ALPHA_KEY
    settings_class = DecentNeRFSettings
    cost_model = DECENTNERF_COST

    def __init__(
        self,
        *,
        alpha_lr: float = 1.0,
        query_timeout: float | None = None,
        alpha_max: float = DEFAULT_ALPHA_MAX,
        max_gradient_norm: float | None = DEFAULT_MAX_GRADIENT_NORM,
        **options: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**options)
        self.alpha_max = check_scalar(alpha_max, "alpha_max")
        self.max_gradient_norm = optional_cap(max_gradient_norm, "max_gradient_norm")
        self.last_aggregate: tuple[int, float] | None = None
        """(round, summed alpha) of the latest aggregate this strategy formed."""
        self.alpha_lr = check_scalar(alpha_lr, "alpha_lr", positive=False)
        if self.alpha_lr < 0:
            raise ValueError(f"alpha_lr must be >= 0 (0 freezes alpha), got {alpha_lr}")
        self.query_timeout = self.node_timeout if query_timeout is None else query_timeout

    def protocol_config(self) -> dict[str, int | float | str]:
        """The shared entries plus "alpha-lr" and "alpha-max" (the clients' clamp)."""
        return {**super().protocol_config(), ALPHA_LR: self.alpha_lr, ALPHA_MAX: self.alpha_max}

    def dp_sums_per_round(self, server_round: int) -> int:
        """Under DP a round from 2 on noises two sums of its sampled users: the gradient
        query's sum_k G_k and the payload's (charged as one multiplier z / sqrt(2))."""
        return 2 if server_round >= 2 else 1

    def resumable_state(self) -> dict[str, Any]:
        """The shared state plus (round, summed alpha) of the latest aggregate."""
        return {**super().resumable_state(), "last-aggregate": self.last_aggregate}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back the shared state and the latest aggregate's bookkeeping."""
        super().restore_state(state)
        last = state["last-aggregate"]
        self.last_aggregate = None if last is None else (int(last[0]), float(last[1]))

    def open_train_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[Round, list[Message]]:
        """Sample nodes; from round 2 first sum their gradients, then the round and its
        messages carrying g^(m-1) and G."""
        train_round = self.begin_round(server_round, arrays, grid)
        train_config = self.train_config(train_round, config)
        records: dict[str, ArrayRecord | ConfigRecord] = {ARRAYS: arrays, CONFIG: train_config}
        if server_round >= 2 and train_round.ledger.node_ids:
            gradient_sum = self.gradient_sum(train_round, arrays, train_config, grid)
            if gradient_sum is not None:
                if self.privacy is not None:  # G leaves before the round is charged
                    self.privacy.write_ahead(train_round.ledger)
                records[GRADIENT] = self.gradient_record(server_round, gradient_sum, train_config)
                if self.last_aggregate is not None:
                    train_config[AGGREGATE_ROUND], train_config[ALPHA_SUM] = self.last_aggregate
        return train_round, self.messages(train_round, RecordDict(records), MessageType.TRAIN)

    def gradient_sum(
        self, train_round: Round, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[str, Tensor] | None:
        """G = sum_k dL_k/dg at g^(m-1) over the sampled nodes (Algorithm 1, line 10)."""
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        queries = self.messages(train_round, content, GRADIENT_QUERY)
        replies = grid.send_and_receive(queries, timeout=self.query_timeout)
        summed = train_round.sum(replies, {GRADIENT: train_round.shapes})
        if summed is None:
            return None
        if self.downloads is not None:  # they rebuilt this round's global for the query
            self.downloads.hold(train_round.ledger.summed_users)
        gradient = train_round.in_global_dtypes(summed.sums[GRADIENT])
        if not all(bool(torch.isfinite(value).all()) for value in gradient.values()):
            log(ERROR, "round %d: the summed gradient G holds NaN or infinite values in the "
                "global's dtypes and is not sent", train_round.ledger.server_round)  # fmt: skip
            return None
        return gradient

    def gradient_record(
        self, server_round: int, gradient: dict[str, Tensor], config: ConfigRecord
    ) -> ArrayRecord:
        """G as the train message carries it: whole, or under compressed downloads compressed
        on its way down as the global is (`DownloadSender.gradient`; `config` then says so)."""
        if self.downloads is None:
            return state_to_arrays(gradient)
        config[GRADIENT_COMPRESSED] = True
        return self.downloads.gradient(server_round, gradient)

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """g^(m) = sum_k alpha_k g_k / sum_k alpha_k from the summed payload alone (Algorithm 1,
        line 18; the round's sum: under secure aggregation no alpha_k or g_k is ever seen);
        metrics unweighted."""
        payload_shapes = {**train_round.shapes, ALPHA_KEY: (1,)}
        summed = train_round.sum(replies, {ARRAYS: payload_shapes})
        if summed is None:
            return train_round.outcome(None)
        payload_sum = summed.sums[ARRAYS]
        alpha_sum = float(payload_sum[ALPHA_KEY].double().sum())
        resolution = summed.resolution.get(ARRAYS, {}).get(ALPHA_KEY, 0.0)
        if not (math.isfinite(alpha_sum) and alpha_sum > resolution):
            train_round.fail_sum("the summed alpha_k is not positive: no aggregate")
            return train_round.outcome(None)
        if self.dp is not None and alpha_sum <= DP_ALPHA_MARGIN * self.dp_noise_std:
            log(WARNING, "round %d: the noised alpha sum lies within %g noise stds of 0; "
                "dividing by it would blow the noise up, no aggregate",
                train_round.ledger.server_round, DP_ALPHA_MARGIN)  # fmt: skip
            return train_round.outcome(None)
        aggregate = train_round.in_global_dtypes(decentnerf_aggregate(payload_sum))
        self.last_aggregate = (train_round.ledger.server_round, alpha_sum)
        return train_round.outcome(state_to_arrays(aggregate))

    @property
    def alpha_floor(self) -> float:
        """The least alpha_k a reply may carry: the clients' clamp (`clamped_alpha`), less a
        float32 rounding; alpha_k divides the payload, so a subnormal one is refused."""
        return self.alpha_max * ALPHA_FLOOR * (1 - 1e-6)

    @property
    def dp_noise_std(self) -> float:
        """Std z C of the DP noise on each entry of the latest payload sum, the alpha sum's
        included (at the C it was clipped to)."""
        assert self.privacy is not None
        return self.privacy.payload_noise_std

    def check_update(self, train_round: Round, reply: CheckedReply) -> None:
        """A payload's alpha_k in [alpha_max * 1e-6, alpha_max], then the update-norm bound on
        its g_k = payload / alpha_k; a gradient reply's ||G_k|| at most `max_gradient_norm`."""
        payload = reply.states.get(ARRAYS)
        if payload is None:
            gradient = reply.states.get(GRADIENT)
            if gradient is not None and self.max_gradient_norm is not None:
                if not update_norm(gradient) <= self.max_gradient_norm:
                    raise BadReply(
                        "gradient-norm",
                        f"reply from node {reply.node_id}, record {GRADIENT!r}: ||G_k|| exceeds "
                        f"max-gradient-norm = {self.max_gradient_norm:g}",
                    )
            return
        alpha = float(payload[ALPHA_KEY].double().reshape(()))
        if not self.alpha_floor <= alpha <= self.alpha_max:
            raise BadReply(
                "alpha",
                f"reply from node {reply.node_id}, record {ARRAYS!r}: {ALPHA_KEY!r} is outside "
                f"[alpha-max * {ALPHA_FLOOR:g}, alpha-max = {self.alpha_max:g}]",
            )
        train_round.check_update_norm(reply.node_id, payload, scale=alpha)

    def drop_reason(self, check: str) -> str:
        """DecentNeRF's own checks in a user's words; the shared ones as the base's."""
        reasons = {
            "alpha": "DecentNeRF replies carried an alpha_k outside [alpha-max * 1e-6, alpha-max]",
            "gradient-norm": "gradient replies' ||G_k|| exceeded max-gradient-norm",
        }
        return reasons.get(check) or super().drop_reason(check)


ALPHA_STATE = "decentnerf-alpha"
"""Node-state values of the user's alpha_k and its history [[round, alpha], ...]."""
PREVIOUS_GLOBAL = "decentnerf-previous-global"
"""Node-state tensors: the user's last local global field g_k^(m-1), for Eq. 2."""


class DecentNeRFClient:
    """The client half of DecentNeRF: answers the gradient query with G_k, keeps alpha_k and
    g_k^(m-1) in the node's private state, updates alpha_k (Algorithm 1, line 12) and replies
    alpha_k g_k with alpha_k (line 15). The model and its loss stay the caller's.
    """

    def __init__(self, state: NodeState, alpha_lr: float = 1.0) -> None:
        self.state = state
        self.alpha_lr = alpha_lr
        """eta when the message carries no "alpha-lr" (a DecentNeRF server always sends it)."""

    @staticmethod
    def sent_by_decentnerf(msg: Message) -> bool:
        """Whether `msg` comes from a DecentNeRF server (its CONFIG names the strategy)."""
        return msg.content[CONFIG].get(STRATEGY) == DecentNeRF.strategy_name

    @staticmethod
    def answer_gradient_query(
        msg: Message,
        loss_gradient: Callable[[dict[str, Tensor]], Mapping[str, Tensor]],
        seed: int = 0,
    ) -> Message:
        """Reply G_k = `loss_gradient(g)`, the user's loss gradient at the received g^(m-1),
        compressed when the query asks for compression (`compressed_gradient`; `seed` seeds
        quantise's rounding)."""
        parts = DecentNeRFClient.gradient_parts(msg, loss_gradient)
        return compressed_gradient(msg, parts, seed).message(msg)

    @staticmethod
    def gradient_parts(
        msg: Message, loss_gradient: Callable[[dict[str, Tensor]], Mapping[str, Tensor]]
    ) -> ReplyParts:
        """`answer_gradient_query`'s reply before it is sent: G_k under GRADIENT."""
        received = arrays_to_state(msg.content[ARRAYS])
        gradient = dict(loss_gradient(received))
        if gradient.keys() != received.keys():
            raise ValueError(
                f"loss_gradient returned keys {sorted(gradient)}, "
                f"not the global's {sorted(received)}"
            )
        return ReplyParts({GRADIENT: state_to_arrays(gradient)})

    @property
    def alpha(self) -> float:
        """This user's current alpha_k (1 before its first round)."""
        return float(self._kept()["alpha"])

    @property
    def history(self) -> list[list[float]]:
        """[[round, alpha_k], ...] of the rounds this user trained in."""
        return list(self._kept()["history"])

    def keep_alpha(self, alpha: float) -> None:
        """Start this user at alpha_k = `alpha` instead of 1 (before its first round): a fixed
        weight when the server's alpha-lr is 0 (DecentNeRF(-L) with chosen weights)."""
        if self.history:
            raise ValueError("keep_alpha: this user has already trained; its alpha_k is its own")
        self.state.put_values(ALPHA_STATE, {"alpha": float(alpha), "history": [], "uploaded": 0})

    def train_reply(
        self, msg: Message, local_state: Mapping[str, Tensor], metrics: Mapping[str, float]
    ) -> Message:
        """The train reply: alpha_k g_k plus alpha_k (ARRAYS) and `metrics` (METRICS).

        alpha_k is first updated from the message's G when the stored g_k^(m-1) went into
        the aggregate the message carries (`_updated_alpha`); `local_state` is then stored
        as the next round's g_k^(m-1).
        """
        return self.train_parts(msg, local_state, metrics).message(msg)

    def train_parts(
        self, msg: Message, local_state: Mapping[str, Tensor], metrics: Mapping[str, float]
    ) -> ReplyParts:
        """`train_reply` before it is sent (an app adds its own metrics in one place)."""
        alpha = self._updated_alpha(msg)
        self.state.put_tensors(PREVIOUS_GLOBAL, local_state)
        payload = state_to_arrays(alpha_weighted_payload(local_state, alpha))
        return ReplyParts({ARRAYS: payload}, dict(metrics))

    def _kept(self) -> dict[str, Any]:
        """The stored alpha, history and round of the last upload, or the initial alpha_k = 1."""
        return self.state.values(ALPHA_STATE) or {"alpha": 1.0, "history": [], "uploaded": 0}

    def _updated_alpha(self, msg: Message) -> float:
        """alpha_k <- alpha_k - eta dL/dalpha_k clamped into [alpha-max * ALPHA_FLOOR,
        alpha-max] (the message's "alpha-max", else DEFAULT_ALPHA_MAX), stored with the
        round in the history: a server takes no alpha_k outside that range.

        With "alpha-sum" the derivative is the normalised aggregation's <G, g_k - g> / A,
        else Eq. 2's <G, g_k>. A stale g_k (this user's last upload predates the aggregate's
        round: it was not sampled then) took no part in g^(m-1), so dL/dalpha_k = 0 and
        alpha_k is kept.
        """
        kept = self._kept()
        alpha = float(kept["alpha"])
        previous = self.state.tensors(PREVIOUS_GLOBAL)
        config = msg.content[CONFIG]
        aggregate_round = config.get(AGGREGATE_ROUND)
        current = aggregate_round is None or int(aggregate_round) == int(kept.get("uploaded", 0))
        if GRADIENT in msg.content and previous is not None and current:
            gradient_sum = arrays_to_state(msg.content[GRADIENT])
            alpha_lr = float(config.get(ALPHA_LR, self.alpha_lr))
            aggregate, alpha_sum = None, None
            if ALPHA_SUM in config:
                aggregate = arrays_to_state(msg.content[ARRAYS])
                alpha_sum = float(config[ALPHA_SUM])
            alpha = alpha_update(alpha, gradient_sum, previous, alpha_lr, aggregate, alpha_sum)
        alpha = clamped_alpha(alpha, float(config.get(ALPHA_MAX, DEFAULT_ALPHA_MAX)))
        server_round = int(config[SERVER_ROUND])
        history = [*kept["history"], [server_round, alpha]]
        self.state.put_values(
            ALPHA_STATE, {"alpha": alpha, "history": history, "uploaded": server_round}
        )
        return alpha


def clamped_alpha(alpha: float, alpha_max: float) -> float:
    """`alpha` clamped into [alpha_max * ALPHA_FLOOR, alpha_max], the range a server takes."""
    if not (math.isfinite(alpha_max) and alpha_max > 0):
        raise ValueError(f"train config {ALPHA_MAX!r} must be positive and finite")
    return min(max(alpha, alpha_max * ALPHA_FLOOR), alpha_max)
