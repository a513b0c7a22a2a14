"""Any fedfields method (`fedfields.methods`) as a Flower strategy: the one thin adapter.

`MethodStrategy` runs a round the same way whatever the method: it sends what the method's
`sent` returns with the train config (the method's `client_config` entries merged in), then
reads the replies through the round's one sum (`fedfields.flower.round.Round.sum`: gate,
plaintext or SecAgg+, DP, ledger). A method whose step starts from the mean gets the
replies' weighted mean (or a robust rule's aggregate) in the global's dtypes; any other gets
the sums of its declared reply records (or folds each checked reply itself) and takes its
step from them. The records' caps declared in `RecordSpec`s are checked here, so the generic
round never names a method. `method_strategy(MethodClass)` makes the Flower-facing class a
user imports (`fedfields.flower.FedAvg`, ...), whose keyword arguments are the method's own
and the shared `MethodOptions`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedfields.flower.protocol import BadReply, arrays_to_state, state_to_arrays
from fedfields.flower.reply_gate import CheckedReply
from fedfields.flower.round import Round, RoundOutcome
from fedfields.flower.strategy import ProtocolStrategy
from fedfields.flower.strategy_options import StrategyOptions
from fedfields.methods.base import (
    ARRAYS,
    CONFIG,
    Method,
    RoundContext,
    RoundSums,
    ServerStep,
    State,
)
from fedfields.methods.robust import (
    AGGREGATION_RULES,
    DEFAULT_TRIM_FRACTION,
    RobustRule,
    check_trim_fraction,
    robust_aggregate,
)
from fedfields.methods.states import update_norm


class MethodOptions(StrategyOptions, total=False):
    """`StrategyOptions` plus the robust rule that may replace a method's mean."""

    aggregation_rule: str
    trim_fraction: float
    num_malicious: int
    krum_select: int


class MethodStrategy(ProtocolStrategy):
    """A `fedfields.methods.base.Method` run through Flower 1.41's message API.

    Train messages carry ARRAYS (the method's `sent`: the global or a lookahead), any other
    record the method sends (a control variate) and CONFIG ("server-round",
    "strategy", "local-steps", the method's `client_config` and the user's train config);
    replies carry the method's `reply_records` and METRICS (a positive "num-examples" when
    the method weighs by it). A bad reply (`fedfields.flower.reply_gate`, or a record above
    its declared cap) is dropped and counted and the round aggregates the rest; failed
    replies are dropped, as in Flower's FedAvg. With no reply left the global stays.

    Args:
        method: the method's server half; None builds `method_class` from the method's own
            keyword arguments among `**options`.
        fraction_train: fraction of the connected nodes sampled for training (Flower's FedAvg).
        fraction_evaluate: fraction sampled for federated evaluation (0 skips it).
        min_train_nodes: at least this many nodes are sampled for training.
        min_evaluate_nodes: at least this many nodes are sampled for evaluation.
        min_available_nodes: sampling waits until this many nodes are connected.
        local_steps: local optimisation steps per round, sent as "local-steps"; None (default)
            takes "local-steps" from the train config given to `start`, else 1.
        secure_aggregation: SecAgg+ settings; set, the server only learns the sums of what
            the clients hold back (clients put their weight inside the masked vector).
            Refused for a method whose step reads each client's own values.
        node_timeout: seconds a round waits for nodes to connect (None: forever).
        sampling_seed: seeds the strategy's own node-sampling RNG (None: fresh entropy), so
            a run samples the same nodes with or without SecAgg+, whose workflow shuffles
            with Python's global `random`.
        max_num_examples: a reply whose "num-examples" exceeds it is dropped (0/None: no cap).
        max_update_norm: a reply with ||g_k - g|| > max_update_norm * max(||g||, 1) is dropped
            (g: the arrays sent; 0/None: no bound).
        aggregation_rule: "mean" (the weighted mean, folded in as replies arrive), or the
            coordinate-wise "median" or "trimmed-mean", or "krum", "multi-krum" or "bulyan"
            (`fedfields.methods.robust`, as Flower's Krum, MultiKrum and Bulyan); these hold
            every reply of the round in memory, and only Krum's and Multi-Krum's means weigh
            by "num-examples". Only for methods whose step starts from the mean; not with
            secure aggregation (the server never sees one client's state) nor DP.
        trim_fraction: share of the replies cut from each end of each coordinate by
            "trimmed-mean", in [0, 0.5).
        num_malicious: f, the malicious clients Krum, Multi-Krum and Bulyan assume; a Bulyan
            round with fewer than 4f + 3 checked replies forms no aggregate.
        krum_select: m, the states Multi-Krum averages (0: n - f).
        differential_privacy: client-level DP (`fedfields.privacy.dp.DPConfig`): each
            update clipped to C, uniform weights, N(0, (z C)^2) on the sum (by the server, or
            in shares by the clients under secure aggregation); epsilon is accounted per
            round (docs/PRIVACY.md). "mean" only.
        compression: the scheme replies compress their updates with (None: sent whole).
    """

    method_class: ClassVar[type[Method]]
    shared_keys = {
        "aggregation-rule": "aggregation_rule",
        "trim-fraction": "trim_fraction",
        "num-malicious": "num_malicious",
        "krum-select": "krum_select",
    }

    def __init__(
        self,
        *,
        method: Method | None = None,
        aggregation_rule: str = "mean",
        trim_fraction: float = DEFAULT_TRIM_FRACTION,
        num_malicious: int = 0,
        krum_select: int = 0,
        **options: Any,
    ) -> None:
        own = method_arguments(self.method_class, options)
        if method is None:
            method = self.method_class(**own)
        elif own:
            raise TypeError(f"pass {sorted(own)} to the method, not beside `method`")
        self.method = method
        self.weight_metric = method.weight_metric
        self.delta_records = tuple(spec.name for spec in method.reply_records() if spec.delta)
        refuse_unsupported(self.strategy_name, method, options)
        super().__init__(**options)
        self.aggregation_rule = checked_rule(
            self.strategy_name, method, aggregation_rule, self.dp is not None,
            self.secure_aggregation is not None,
        )  # fmt: skip
        self.trim_fraction = check_trim_fraction(trim_fraction)
        self.robust_rule = (
            None
            if aggregation_rule == "mean"
            else RobustRule(aggregation_rule, trim_fraction, num_malicious, krum_select)
        )
        """The robust rule's settings; None for the mean."""

    def summary(self) -> None:
        """Log the method and its settings, then the shared summary."""
        log(INFO, "\t├──> method: %s", self.method.describe())
        super().summary()

    def protocol_config(self) -> dict[str, int | float | str]:
        """The shared entries plus the method's `client_config`."""
        return {**super().protocol_config(), **self.method.client_config()}

    def open_train_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[Round, list[Message]]:
        """Sample nodes; the round and its messages: what the method's `sent` returns with the
        train config."""
        global_state = arrays_to_state(arrays)
        records = self.method.sent(global_state, server_round)
        sent = arrays if records[ARRAYS] is global_state else state_to_arrays(records[ARRAYS])
        train_round = self.begin_round(server_round, sent, grid)
        train_config = self.train_config(train_round, config)
        train_round.context = RoundContext(
            server_round, global_state, dict(train_config), train_round.ledger.num_nodes_total
        )
        content = RecordDict(
            {
                ARRAYS: sent,
                **{name: state_to_arrays(s) for name, s in records.items() if name != ARRAYS},
                CONFIG: train_config,
            }
        )
        return train_round, self.messages(train_round, content, MessageType.TRAIN)

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """The method's server step over the round's mean or sums, as the round's outcome."""
        context, method = train_round.context, self.method
        assert context is not None, "configure_train opens the round's context"
        if method.from_mean:
            mean = self.mean(train_round, replies)
            step = None if mean is None else method.step_from_mean(context, mean)
        else:
            step = self.step_from_sums(train_round, replies, context)
        if step is None or step.new_global is None:
            return train_round.outcome(None, None if step is None else step.metrics)
        return train_round.outcome(state_to_arrays(step.new_global), step.metrics)

    def step_from_sums(
        self, train_round: Round, replies: Iterable[Message], context: RoundContext
    ) -> ServerStep | None:
        """The method's step from the sums of its reply records (or its own fold of each
        checked reply); None when nothing was summed."""
        method, shapes = self.method, train_round.shapes
        fold = method.fold(context)
        summed = train_round.sum(
            replies,
            {spec.name: shapes for spec in method.reply_records()},
            scalars=method.reply_scalars(context) or None,
            fold=None if fold is None else lambda r: fold(r.states, r.weight, r.scalars),
        )
        if summed is None:
            return None
        sums = RoundSums(summed.sums, summed.weight, len(summed.node_ids))
        return method.step_from_sums(context, sums)

    def mean(self, train_round: Round, replies: Iterable[Message]) -> State | None:
        """sum_k n_k x_k / sum_k n_k of the replies' ARRAYS in the global's dtypes (the
        round's sum: checked and folded in as they arrive, or SecAgg+'s), or the robust rule
        over all of them; None: no aggregate."""
        if self.robust_rule is not None:
            return self.robust_mean(train_round, replies, self.robust_rule)
        summed = train_round.sum(replies, {ARRAYS: train_round.shapes})
        if summed is None:
            return None
        return train_round.in_global_dtypes(summed.mean(ARRAYS))

    def robust_mean(
        self, train_round: Round, replies: Iterable[Message], rule: RobustRule
    ) -> State | None:
        """The coordinate-wise robust rule over every checked reply of the round's sum (it
        needs all at once); None below the rule's fewest states."""
        states: list[State] = []
        shapes = {ARRAYS: train_round.shapes}
        summed = train_round.sum(replies, shapes, fold=lambda r: states.append(r.states[ARRAYS]))
        if summed is None:
            return None
        if len(states) < rule.least_states():
            log(WARNING, "round %d: %s with num-malicious = %d needs %d checked replies, got %d: "
                "no aggregate", train_round.ledger.server_round, rule.name, rule.num_malicious,
                rule.least_states(), len(states))  # fmt: skip
            return None
        return robust_aggregate(rule, states, summed.weights)

    def compressed_records(self) -> frozenset[str]:
        """The method's reply records declared `compressed` (`RecordSpec`)."""
        return frozenset(spec.name for spec in self.method.reply_records() if spec.compressed)

    def check_update(self, train_round: Round, reply: CheckedReply) -> None:
        """The update-norm bound on ARRAYS, then each reply record's declared norm cap."""
        super().check_update(train_round, reply)
        for spec in self.method.reply_records():
            record = reply.states.get(spec.name)
            if spec.norm_cap is None or record is None:
                continue
            if not update_norm(record) <= spec.norm_cap:
                raise BadReply(
                    spec.norm_check,
                    f"reply from node {reply.node_id}, record {spec.name!r}: its norm exceeds "
                    f"the cap {spec.norm_cap:g} ({spec.norm_check})",
                )

    def drop_reason(self, check: str) -> str:
        """A declared record check's reason, else the gate's."""
        for spec in self.method.reply_records():
            if spec.norm_check == check and spec.drop_reason:
                return spec.drop_reason
        return super().drop_reason(check)

    def resumable_state(self) -> dict[str, Any]:
        """The shared state plus the method's (`Method.state`)."""
        return {**super().resumable_state(), **self.method.state()}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back the shared state and the method's."""
        super().restore_state(state)
        self.method.restore(state)


def method_arguments(method_class: type[Method], options: dict[str, Any]) -> dict[str, Any]:
    """Pop the method's own keyword arguments (its constructor's) out of `options`."""
    parameters = inspect.signature(method_class.__init__).parameters
    names = [name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    return {name: options.pop(name) for name in names if name in options}


def refuse_unsupported(name: str, method: Method, options: Mapping[str, Any]) -> None:
    """ValueError when SecAgg+ or DP is asked of a method whose step reads each client's own
    values (its update, norm or step count), which a secure or clipped sum hides."""
    if not method.secure_aggregation and options.get("secure_aggregation") is not None:
        raise ValueError(
            f"{name} needs each client's update (and its norm or step count), which secure "
            "aggregation hides; use a method whose server step reads only sums"
        )
    if not method.differential_privacy and options.get("differential_privacy") is not None:
        raise ValueError(
            f"{name} does not support client-level DP (dp-noise-multiplier > 0): its server step "
            "reads each client's own values, whose sensitivity a clipped sum does not bound"
        )


def checked_rule(name: str, method: Method, rule: str, dp: bool, secure: bool) -> str:
    """`rule` if the method and the round can take it; ValueError saying why not."""
    if rule not in AGGREGATION_RULES:
        raise ValueError(f"aggregation_rule must be one of {AGGREGATION_RULES}, got {rule!r}")
    if rule == "mean":
        return rule
    if not (method.from_mean and method.settings_class.robust_rules):
        raise ValueError(
            f"{name} aggregates with its own server step; aggregation_rule {rule!r} is for "
            "methods whose step starts from the replies' mean"
        )
    if dp:
        raise ValueError(
            f"aggregation_rule {rule!r} is not a sum of clipped updates, so client-level DP "
            "(dp-noise-multiplier > 0) does not bound it; use 'mean'"
        )
    if secure:
        raise ValueError(
            f"aggregation_rule {rule!r} needs each client's state, which secure aggregation "
            "hides; use 'mean' with secure aggregation"
        )
    return rule


@functools.cache
def method_strategy(method_class: type[Method]) -> type[MethodStrategy]:
    """The Flower strategy class of `method_class` (one per method: the same class on every
    call): named after it, its `strategy_name` the method's `name`, built from the method's
    settings (`from_settings`, `from_config`)."""
    namespace = {
        "__doc__": f"{method_class.__doc__}\n\n    As a Flower strategy: `MethodStrategy`.",
        "__module__": __name__,
        "method_class": method_class,
        "strategy_name": method_class.name,
        "settings_class": method_class.settings_class,
        "weight_metric": method_class.weight_metric,
        "cost_model": method_class.cost_model,
    }
    return type(method_class.__name__, (MethodStrategy,), namespace)
