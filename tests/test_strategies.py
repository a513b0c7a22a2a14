"""The fedfields strategies through Flower's real ClientApp dispatch on an in-process grid.

Fake clients solve least-squares problems with the fedfields.methods client helpers;
Flower's own FedAvg is the oracle for ours.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategy
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.supercore.run import Run
from paper_reference import (
    fedexp_update,
    fednova_update,
    scaffold_client_control_update,
    scaffold_server_update,
    state_sum,
    weighted_mean,
)
from torch import Tensor

from fedfields.flower import (
    DecentNeRF,
    FedACG,
    FedAvg,
    FedExP,
    FedNova,
    FedProx,
    ProtocolStrategy,
    Scaffold,
)
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import (
    ARRAYS,
    BYTES_DOWN,
    BYTES_UP,
    CONFIG,
    GRADIENT,
    GRADIENT_QUERY,
    LOCAL_STEPS,
    METRICS,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_REPLIES,
    SERVER_ROUND,
    STRATEGY,
    TRAIN_LOSS,
    TRAIN_STEPS,
    USER_KEY_ACTION,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.round import Round, RoundSum
from fedfields.flower.strategy import ForwardingGrid
from fedfields.methods import (
    ALPHA_KEY,
    alpha_update,
    alpha_weighted_payload,
    decentnerf_aggregate,
    scaffold_corrected_gradient,
)
from fedfields.methods.decentnerf import ALPHA_LR
from fedfields.methods.fedexp import SERVER_STEP
from fedfields.methods.fedprox import PROXIMAL_MU
from fedfields.methods.scaffold import CONTROL_DELTA, SERVER_CONTROL
from fedfields.privacy.secagg_plan import SecureAggregationConfig
from simulations.in_process_grid import InProcessGrid
from strategies import parse_app_config

State = dict[str, Tensor]
F64 = torch.float64


# ------------------------------------------------------------------ least-squares clients


@dataclass
class LeastSquares:
    """Client k's loss f_k(w, b) = |X w + b - t|^2 / (2n)."""

    features: Tensor
    targets: Tensor

    def residual(self, state: State) -> Tensor:
        return self.features @ state["weight"] + state["bias"] - self.targets

    def loss(self, state: State) -> float:
        return float(self.residual(state).pow(2).mean() / 2)

    def gradient(self, state: State) -> State:
        residual = self.residual(state)
        return {
            "weight": self.features.T @ residual / len(residual),
            "bias": residual.mean().reshape(1),
        }


def heterogeneous_problems(count: int = 4, dim: int = 3, rows: int = 24) -> list[LeastSquares]:
    """Clients with differently scaled features and different optima (client drift)."""
    gen = torch.Generator().manual_seed(0)
    problems = []
    for k in range(count):
        features = torch.randn(rows, dim, generator=gen, dtype=F64) * (0.5 + 0.5 * k)
        optimum = torch.randn(dim, generator=gen, dtype=F64) * 2
        targets = features @ optimum + k + 0.1 * torch.randn(rows, generator=gen, dtype=F64)
        problems.append(LeastSquares(features, targets))
    return problems


def joint_minimiser(problems: Sequence[LeastSquares]) -> Tensor:
    """argmin of the clients' mean loss, (weight, bias) stacked, by the normal equations."""
    designs = [
        torch.cat([p.features, torch.ones(len(p.targets), 1, dtype=F64)], 1) for p in problems
    ]
    gram = sum(a.T @ a / len(a) for a in designs)
    moment = sum(a.T @ p.targets / len(a) for a, p in zip(designs, problems, strict=True))
    return torch.linalg.solve(gram, moment)


def flat(state: State) -> Tensor:
    return torch.cat([state["weight"], state["bias"]])


def initial_state(dim: int = 3) -> State:
    return {"weight": torch.zeros(dim, dtype=F64), "bias": torch.zeros(1, dtype=F64)}


@dataclass
class Produced:
    """What a DecentNeRF fake client held when it replied to a train message."""

    server_round: int
    node_id: int
    alpha: float
    local_state: State


def least_squares_app(
    problems: Sequence[LeastSquares],
    lr: float,
    alphas: Sequence[float] = (),
    produced: list[Produced] | None = None,
    mods: Sequence[Callable] = (),
) -> ClientApp:
    """A ClientApp running K local GD steps under each strategy's client rule.

    DecentNeRF clients start from `alphas[partition]` and append to `produced`.
    """
    app = ClientApp(mods=list(mods))
    app.query(USER_KEY_ACTION)(answer_user_key)

    def problem_of(context: Context) -> LeastSquares:
        return problems[int(context.node_config["partition-id"])]

    def reply(message: Message, records: dict[str, State], loss: float, n: int) -> Message:
        content = RecordDict({name: state_to_arrays(state) for name, state in records.items()})
        content[METRICS] = MetricRecord({NUM_EXAMPLES: n, TRAIN_LOSS: loss})
        return Message(content, reply_to=message)

    def descend(problem: LeastSquares, start: State, steps: int, step_fn: Callable) -> State:
        state = {key: value.clone() for key, value in start.items()}
        for _ in range(steps):
            state = {key: state[key] - lr * g for key, g in step_fn(problem, state).items()}
        return state

    @app.train()
    def train(message: Message, context: Context) -> Message:
        problem, config = problem_of(context), message.content[CONFIG]
        x, steps = arrays_to_state(message.content[ARRAYS]), int(config[LOCAL_STEPS])
        n = len(problem.targets)
        if config[STRATEGY] not in ("scaffold", "decentnerf"):  # FedACG: prox around x
            mu = float(config.get(PROXIMAL_MU, 0.0))

            def prox_gradient(p: LeastSquares, s: State) -> State:
                return {k: g + mu * (s[k] - x[k]) for k, g in p.gradient(s).items()}

            y = descend(problem, x, steps, prox_gradient)
            return reply(message, {ARRAYS: y}, problem.loss(y), n)
        if config[STRATEGY] == "scaffold":
            c = arrays_to_state(message.content[SERVER_CONTROL])
            stored = context.state.get("client-control")
            c_i = (
                arrays_to_state(stored)
                if stored
                else {k: torch.zeros_like(v) for k, v in x.items()}
            )

            def corrected(p: LeastSquares, s: State) -> State:
                return scaffold_corrected_gradient(p.gradient(s), c, c_i)

            y = descend(problem, x, steps, corrected)
            c_i, delta = scaffold_client_control_update(c_i, c, x, y, steps, lr)
            context.state["client-control"] = state_to_arrays(c_i)
            return reply(message, {ARRAYS: y, CONTROL_DELTA: delta}, problem.loss(y), n)
        # decentnerf: alpha and the previous local state never leave the node
        memory = context.state.get("decentnerf")
        if memory is None:
            alpha = alphas[int(context.node_config["partition-id"])]
        else:
            alpha = float(memory["alpha"])
            if GRADIENT in message.content:
                gradient_sum = arrays_to_state(message.content[GRADIENT])
                previous = arrays_to_state(context.state["previous-local"])
                alpha = alpha_update(alpha, gradient_sum, previous, float(config[ALPHA_LR]))
        g_k = descend(problem, x, steps, LeastSquares.gradient)
        context.state["decentnerf"] = ConfigRecord({"alpha": alpha})
        context.state["previous-local"] = state_to_arrays(g_k)
        if produced is not None:
            produced.append(Produced(int(config[SERVER_ROUND]), context.node_id, alpha, g_k))
        # a misleading example count: DecentNeRF must not weight by it
        misleading = 1 + 10 * int(context.node_config["partition-id"])
        payload = alpha_weighted_payload(g_k, alpha)
        return reply(message, {ARRAYS: payload}, problem.loss(g_k), misleading)

    @app.query("gradient")
    def gradient(message: Message, context: Context) -> Message:
        problem = problem_of(context)
        g = arrays_to_state(message.content[ARRAYS])
        return Message(
            RecordDict({GRADIENT: state_to_arrays(problem.gradient(g))}), reply_to=message
        )

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        problem = problem_of(context)
        loss = problem.loss(arrays_to_state(message.content[ARRAYS]))
        metrics = MetricRecord({NUM_EXAMPLES: len(problem.targets), "eval-loss": loss})
        return Message(RecordDict({METRICS: metrics}), reply_to=message)

    return app


# ------------------------------------------------------------------ fixed-reply nodes


def fixed_reply_node(records: dict[str, State], metrics: dict[str, float]) -> Callable:
    """A plain-function node that answers any message with the given records."""

    def handler(message: Message, context: Context) -> Message:
        content = RecordDict({name: state_to_arrays(state) for name, state in records.items()})
        content[METRICS] = MetricRecord(metrics)
        return Message(content, reply_to=message)

    return handler


def random_state(seed: int, dtype: torch.dtype = torch.float32) -> State:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(4, 3, generator=gen).to(dtype),
        "layer.bias": torch.randn(4, generator=gen).to(dtype),
    }


def one_round(
    strategy: ProtocolStrategy, grid: InProcessGrid, arrays: ArrayRecord, server_round: int = 1
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
    return strategy.aggregate_train(server_round, grid.send_and_receive(messages))


# ------------------------------------------------------------------ FedAvg / FedProx


def test_fedavg_equals_flower_fedavg_on_identical_replies() -> None:
    weights = [3, 10.5, 40]
    grid = InProcessGrid(
        [
            fixed_reply_node({ARRAYS: random_state(k)}, {NUM_EXAMPLES: w, TRAIN_LOSS: k + 1.0})
            for k, w in enumerate(weights)
        ]
    )
    ours = FedAvg(min_available_nodes=3)
    messages = ours.configure_train(1, state_to_arrays(random_state(9)), ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages))
    arrays, metrics = ours.aggregate_train(1, replies)
    oracle_arrays, oracle_metrics = FlowerFedAvg().aggregate_train(1, replies)
    assert arrays is not None and oracle_arrays is not None and metrics is not None
    assert list(arrays) == list(oracle_arrays)
    for key in arrays:
        got, expected = arrays[key].numpy(), oracle_arrays[key].numpy()
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(
            torch.from_numpy(got), torch.from_numpy(expected), rtol=1e-6, atol=1e-6
        )
    assert metrics[TRAIN_LOSS] == pytest.approx(oracle_metrics[TRAIN_LOSS], rel=1e-9)
    assert metrics[NUM_REPLIES] == 3 and metrics[NUM_FAILURES] == 0
    assert metrics[BYTES_DOWN] == 3 * state_to_arrays(random_state(9)).count_bytes()
    assert metrics[BYTES_UP] == sum(
        state_to_arrays(random_state(k)).count_bytes() for k in range(3)
    )


def test_refine_global_post_processes_each_new_global_and_adds_its_metrics() -> None:
    """A library user's `refine_global` (a field's structure step) gets each round's new
    global and its round; what it returns is the round's global and its metrics join the
    round's; its shapes are the method's."""
    grid = InProcessGrid([fixed_reply_node({ARRAYS: random_state(k)}, {NUM_EXAMPLES: 1.0})
                          for k in range(2)])  # fmt: skip
    seen: list[int] = []

    def shift(state, server_round):
        seen.append(server_round)
        return {name: tensor + server_round for name, tensor in state.items()}, {"shifted": 1.0}

    plain, refined = FedAvg(min_available_nodes=2), FedAvg(min_available_nodes=2,
                                                           refine_global=shift)  # fmt: skip
    arrays = state_to_arrays(random_state(9))
    results = []
    for strategy in (plain, refined):
        replies = list(
            grid.send_and_receive(strategy.configure_train(3, arrays, ConfigRecord(), grid))
        )
        results.append(strategy.aggregate_train(3, replies))
    (mean, _), (shifted, metrics) = results
    assert seen == [3] and metrics is not None and metrics["shifted"] == 1.0
    for key, value in arrays_to_state(mean).items():
        torch.testing.assert_close(arrays_to_state(shifted)[key], value + 3)


def test_fedprox_with_zero_mu_aggregates_as_fedavg_and_sends_mu() -> None:
    grid = InProcessGrid(
        [fixed_reply_node({ARRAYS: random_state(k)}, {NUM_EXAMPLES: k + 1}) for k in range(3)]
    )
    arrays = state_to_arrays(random_state(7))
    fedavg_arrays, _ = one_round(FedAvg(min_available_nodes=3), grid, arrays)
    fedprox_arrays, _ = one_round(FedProx(proximal_mu=0.0, min_available_nodes=3), grid, arrays)
    assert fedavg_arrays is not None and fedprox_arrays is not None
    for key in fedavg_arrays:
        assert (fedavg_arrays[key].numpy() == fedprox_arrays[key].numpy()).all()
    messages = FedProx(proximal_mu=0.25).configure_train(2, arrays, ConfigRecord(), grid)
    configs = [message.content[CONFIG] for message in messages]
    assert [c[PROXIMAL_MU] for c in configs] == [0.25] * 3
    assert {c[STRATEGY] for c in configs} == {"fedprox"}


def test_train_config_carries_protocol_and_user_entries_without_mutating_them() -> None:
    grid = InProcessGrid([fixed_reply_node({}, {})] * 2)
    arrays = state_to_arrays(initial_state())
    user = ConfigRecord({"lr": 0.01})

    def sent_config(strategy: ProtocolStrategy, config: ConfigRecord) -> dict:
        return dict(next(iter(strategy.configure_train(4, arrays, config, grid))).content[CONFIG])

    protocol = {STRATEGY: "fedavg", SERVER_ROUND: 4}
    assert sent_config(FedAvg(local_steps=5), user) == {"lr": 0.01, LOCAL_STEPS: 5, **protocol}
    assert sent_config(FedAvg(), user) == {"lr": 0.01, LOCAL_STEPS: 1, **protocol}
    assert sent_config(FedAvg(), ConfigRecord({LOCAL_STEPS: 8}))[LOCAL_STEPS] == 8
    assert dict(user) == {"lr": 0.01}
    with pytest.raises(ValueError, match="'local-steps'=2"):
        FedAvg(local_steps=5).configure_train(1, arrays, ConfigRecord({LOCAL_STEPS: 2}), grid)
    with pytest.raises(ValueError, match="'strategy'='scaffold'"):
        FedAvg().configure_train(1, arrays, ConfigRecord({STRATEGY: "scaffold"}), grid)
    with pytest.raises(ValueError, match="'local-steps' must be a positive integer"):
        FedAvg().configure_train(1, arrays, ConfigRecord({LOCAL_STEPS: 0.5}), grid)


# ------------------------------------------------------------------ Scaffold


def run_least_squares(strategy: ProtocolStrategy, rounds: int, lr: float = 0.05) -> State:
    problems = heterogeneous_problems()
    grid = InProcessGrid([least_squares_app(problems, lr)] * len(problems), raise_errors=True)
    result = strategy.start(grid, state_to_arrays(initial_state()), num_rounds=rounds)
    return arrays_to_state(result.arrays)


def test_scaffold_reaches_the_minimiser_where_fedavg_drifts() -> None:
    optimum = joint_minimiser(heterogeneous_problems())
    options = {"min_available_nodes": 4, "fraction_evaluate": 0.0, "local_steps": 10}
    scaffold = flat(run_least_squares(Scaffold(**options), rounds=60))
    fedavg = flat(run_least_squares(FedAvg(**options), rounds=60))
    scaffold_error = float((scaffold - optimum).norm())
    fedavg_error = float((fedavg - optimum).norm())
    assert scaffold_error < 1e-9
    assert fedavg_error > 0.1  # FedAvg's fixed point with K > 1 local steps is biased (0.31)


# ------------------------------------------------------------------ DecentNeRF


def test_decentnerf_aggregates_alpha_weighted_states_and_sums_gradients() -> None:
    problems = heterogeneous_problems()
    produced: list[Produced] = []
    app = least_squares_app(problems, lr=0.05, alphas=[0.5, 1.0, 1.5, 2.0], produced=produced)
    grid = InProcessGrid([app] * len(problems), raise_errors=True)
    aggregates: dict[int, State] = {}

    def keep(server_round: int, arrays: ArrayRecord) -> None:
        aggregates[server_round] = arrays_to_state(arrays)

    strategy = DecentNeRF(
        alpha_lr=1e-3, local_steps=3, min_available_nodes=4, fraction_evaluate=0.0
    )
    strategy.start(grid, state_to_arrays(initial_state()), num_rounds=3, evaluate_fn=keep)

    for server_round in (1, 2, 3):
        rows = [p for p in produced if p.server_round == server_round]
        assert len(rows) == 4
        total = sum(p.alpha for p in rows)
        for key in ("weight", "bias"):
            expected = sum(p.alpha * p.local_state[key] for p in rows) / total
            torch.testing.assert_close(
                aggregates[server_round][key], expected, rtol=1e-12, atol=1e-12
            )
        sent = [m for m in grid.sent if m.metadata.group_id == str(server_round)]
        queries = [m for m in sent if m.metadata.message_type == GRADIENT_QUERY]
        trains = [m for m in sent if m.metadata.message_type == "train"]
        assert len(trains) == 4
        if server_round == 1:
            assert queries == [] and all(GRADIENT not in m.content for m in trains)
            continue
        assert len(queries) == 4
        answers = [
            arrays_to_state(m.content[GRADIENT])
            for m in grid.received
            if m.metadata.group_id == str(server_round)
            and m.metadata.message_type == GRADIENT_QUERY
        ]
        gradient_sum = state_sum(answers)
        for message in trains:
            sent_sum = arrays_to_state(message.content[GRADIENT])
            for key in gradient_sum:
                torch.testing.assert_close(sent_sum[key], gradient_sum[key], rtol=0, atol=0)
    alphas = {p.node_id: p.alpha for p in produced if p.server_round == 3}
    assert alphas != {p.node_id: p.alpha for p in produced if p.server_round == 1}


class SecureSumStandIn(DecentNeRF):
    """Returns a fixed 'secure' sum, so any other read of a reply's arrays would fail."""

    def __init__(self, summed: State) -> None:
        super().__init__(min_available_nodes=2)
        self.summed = summed
        self.calls: list[tuple[str, int]] = []

    def begin_round(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> Round:
        opened = super().begin_round(server_round, arrays, grid)

        def fixed_sum(
            replies: Iterable[Message],
            records: Mapping[str, Mapping[str, tuple[int, ...]]],
            **_: object,
        ) -> RoundSum:
            replies = list(replies)
            metrics = [dict(reply.content[METRICS]) for reply in replies]
            (record_name,) = records
            self.calls.append((record_name, len(replies)))
            opened.summed = RoundSum({record_name: self.summed}, len(replies), [], metrics)
            return opened.summed

        opened.sum = fixed_sum  # type: ignore[method-assign]
        return opened


def test_decentnerf_reads_only_summed_payloads() -> None:
    summed = {
        "weight": torch.tensor([2.0, 4.0, 6.0], dtype=F64),
        "bias": torch.tensor([1.0], dtype=F64),
    }
    summed[ALPHA_KEY] = torch.tensor([4.0], dtype=F64)
    # replies carry metrics only: no per-client payload exists for the strategy to read
    grid = InProcessGrid([fixed_reply_node({}, {NUM_EXAMPLES: 5, TRAIN_LOSS: 1.0})] * 2)
    strategy = SecureSumStandIn(summed)
    arrays, metrics = one_round(strategy, grid, state_to_arrays(initial_state()))
    assert strategy.calls == [(ARRAYS, 2)]
    assert arrays is not None and metrics is not None and metrics[TRAIN_LOSS] == 1.0
    expected = decentnerf_aggregate(summed)
    for key, value in arrays_to_state(arrays).items():
        torch.testing.assert_close(value, expected[key])


def test_decentnerf_drops_a_failed_reply_and_keeps_the_scale() -> None:
    def payload(value: float, alpha: float) -> State:
        state = {
            "weight": torch.full((3,), value, dtype=F64),
            "bias": torch.full((1,), value, dtype=F64),
        }
        return alpha_weighted_payload(state, alpha)

    def failing(message: Message, context: Context) -> Message:
        raise RuntimeError("out of memory")

    grid = InProcessGrid(
        [
            fixed_reply_node({ARRAYS: payload(1.0, 1.0)}, {}),
            fixed_reply_node({ARRAYS: payload(4.0, 3.0)}, {}),
            failing,
        ]
    )
    arrays, metrics = one_round(
        DecentNeRF(min_available_nodes=3), grid, state_to_arrays(initial_state())
    )
    assert arrays is not None and metrics is not None
    assert metrics[NUM_REPLIES] == 2 and metrics[NUM_FAILURES] == 1
    for value in arrays_to_state(arrays).values():
        torch.testing.assert_close(value, torch.full_like(value, (1.0 + 12.0) / 4.0))


# ------------------------------------------------------------------ bad replies
# A bad reply is dropped and counted, never raised: tests/test_reply_faults.py.


# ------------------------------------------------------------------ end to end


STRATEGIES: dict[str, Callable[[], ProtocolStrategy]] = {
    "fedavg": lambda: FedAvg(local_steps=2),
    "fedprox": lambda: FedProx(proximal_mu=0.1, local_steps=2),
    "scaffold": lambda: Scaffold(local_steps=2),
    "decentnerf": lambda: DecentNeRF(alpha_lr=1e-3, local_steps=2),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_start_runs_three_rounds_through_real_client_apps(name: str) -> None:
    problems = heterogeneous_problems(count=3)
    app = least_squares_app(problems, lr=0.05, alphas=[1.0, 1.0, 1.0])
    grid = InProcessGrid([app] * 3, raise_errors=True)
    initial = state_to_arrays(initial_state())
    result = STRATEGIES[name]().start(
        grid, initial, num_rounds=3, train_config=ConfigRecord({"lr": 0.05})
    )
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2, 3]
    for metrics in result.train_metrics_clientapp.values():
        assert metrics[NUM_REPLIES] == 3 and metrics[BYTES_UP] > 0 and metrics[BYTES_DOWN] > 0
    losses = [result.evaluate_metrics_clientapp[r]["eval-loss"] for r in (1, 3)]
    assert losses[1] < losses[0]
    final = arrays_to_state(result.arrays)
    assert final.keys() == {"weight", "bias"} and all(v.dtype == F64 for v in final.values())
    train_configs = [m.content[CONFIG] for m in grid.sent if m.metadata.message_type == "train"]
    assert {c[STRATEGY] for c in train_configs} == {name}
    assert {c["lr"] for c in train_configs} == {0.05}


# ------------------------------------------------------------------ harness


def test_harness_persists_node_state_copies_content_and_reports_errors() -> None:
    def counter(message: Message, context: Context) -> Message:
        count = int(context.state["count"]["n"]) + 1 if "count" in context.state else 1
        context.state["count"] = ConfigRecord({"n": count})
        message.content[CONFIG]["touched"] = True  # must not reach the server's copy
        if context.node_config["partition-id"] == 1:
            raise RuntimeError("boom")
        return Message(RecordDict({METRICS: MetricRecord({"n": count})}), reply_to=message)

    grid = InProcessGrid([counter, counter])
    content = RecordDict({CONFIG: ConfigRecord({"a": 1})})
    for _ in range(2):
        replies = list(
            grid.send_and_receive([Message(content, 101, "train"), Message(content, 102, "train")])
        )
    assert "touched" not in content[CONFIG] and "touched" not in grid.sent[0].content[CONFIG]
    ok, failed = sorted(replies, key=lambda r: r.metadata.src_node_id)
    assert ok.content[METRICS]["n"] == 2 and "boom" in failed.error.reason
    assert len(grid.sent) == len(grid.received) == 4
    grid.offline.add(102)
    assert [
        r.metadata.src_node_id for r in grid.send_and_receive([Message(content, 102, "train")])
    ] == []


# ------------------------------------------------------------------ streaming aggregation


def streaming_nodes(count: int) -> list[Callable]:
    """Nodes replying distinct states (as local model, DecentNeRF payload and Scaffold pair)."""
    nodes = []
    for k in range(count):
        state = random_state(k)
        payload = {**state, ALPHA_KEY: torch.tensor([0.5 + k])}
        records = {ARRAYS: state, CONTROL_DELTA: random_state(100 + k)}
        metrics = {NUM_EXAMPLES: 2.0 + k, TRAIN_LOSS: float(k)}
        nodes.append((records, payload, metrics))
    return nodes


def reference_aggregate(name: str, specs: list, start: State) -> State:
    """What the pure maths gives with every state in hand (today's list-based rule)."""
    if name == "fedavg":
        states = [records[ARRAYS] for records, _, _ in specs]
        return weighted_mean(states, [metrics[NUM_EXAMPLES] for _, _, metrics in specs])
    if name == "decentnerf":
        return decentnerf_aggregate(state_sum([payload for _, payload, _ in specs]))
    zeros = {key: torch.zeros_like(value) for key, value in start.items()}
    new_global, _ = scaffold_server_update(
        start,
        [{k: r[ARRAYS][k].double() - v.double() for k, v in start.items()} for r, _, _ in specs],
        [records[CONTROL_DELTA] for records, _, _ in specs],
        zeros,
        num_clients_total=len(specs),
    )
    return new_global


def test_a_forwarding_grid_is_the_wrapped_grid_call_for_call() -> None:
    """Every Grid member reaches the wrapped grid: the same nodes, run and replies."""
    inner = InProcessGrid([fixed_reply_node({ARRAYS: random_state(k)}, {}) for k in range(3)])
    grid = ForwardingGrid(inner)
    assert list(grid.get_node_ids()) == list(inner.get_node_ids()) and grid.run is inner.run
    run = Run.create_empty(7)
    grid.set_run(run)
    assert inner.run is run
    node_ids = list(grid.get_node_ids())
    messages = [grid.create_message(RecordDict(), "train", node, "1") for node in node_ids]
    assert [m.metadata.dst_node_id for m in messages] == node_ids
    pushed = list(grid.push_messages(messages[:2]))
    assert len(inner.sent) == 2 and len(list(grid.pull_messages(pushed))) == 2
    (reply,) = grid.send_and_receive(messages[2:])
    assert reply.metadata.src_node_id == node_ids[2] and len(inner.received) == 3


@pytest.mark.parametrize("name", ["fedavg", "decentnerf", "scaffold"])
def test_aggregation_folds_each_reply_in_and_drops_it_before_the_next(name: str) -> None:
    count = 6
    specs = streaming_nodes(count)
    handlers = [
        fixed_reply_node({ARRAYS: payload} if name == "decentnerf" else records, metrics)
        for records, payload, metrics in specs
    ]
    kind = {"fedavg": FedAvg, "decentnerf": DecentNeRF, "scaffold": Scaffold}[name]
    strategy = kind(min_available_nodes=count)
    start = random_state(9)
    grid = InProcessGrid(handlers)
    pending = list(grid.send_and_receive(
        strategy.configure_train(1, state_to_arrays(start), ConfigRecord(), grid)
    ))  # fmt: skip
    handed: list[weakref.ref] = []
    most_alive = 0

    def stream() -> Iterable[Message]:
        """Replies one at a time; before each, count the earlier ones still referenced."""
        nonlocal most_alive
        while pending:
            gc.collect()
            most_alive = max(most_alive, sum(ref() is not None for ref in handed))
            reply = pending.pop(0)
            handed.append(weakref.ref(reply))
            yield reply
            del reply

    arrays, metrics = strategy.aggregate_train(1, stream())
    assert len(handed) == count
    assert most_alive <= 1  # only the reply just handed over (still in the loop variable)
    assert arrays is not None and metrics is not None
    expected = reference_aggregate(name, specs, start)
    assert list(arrays) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(torch.from_numpy(arrays[key].numpy()), value)
    losses = [metrics_[TRAIN_LOSS] for _, _, metrics_ in specs]
    assert metrics[NUM_REPLIES] == count and metrics[TRAIN_LOSS] >= min(losses)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        np.arange(5, dtype=">f4"),  # big-endian bytes
        np.array(7, dtype=np.int64),
    ],
)
def test_read_only_views_decode_as_numpy_does(array: np.ndarray) -> None:
    record = ArrayRecord({"x": Array(array)})
    view = arrays_to_state(record, copy=False)["x"]
    np.testing.assert_array_equal(view.numpy(), array)
    assert view.shape == array.shape


def test_a_truncated_array_is_refused_naming_the_key() -> None:
    good = Array(np.zeros(8, dtype=np.float32))
    cut = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-4])
    with pytest.raises(ValueError, match="key 'x': cannot decode"):
        arrays_to_state(ArrayRecord({"x": cut}), copy=False)


# ------------------------------------------------------------------ FedNova, FedExP, FedACG


def test_fednova_and_fedexp_aggregate_replies_as_their_maths() -> None:
    start = random_state(9)
    specs = [(random_state(k), 2.0 + k, 3 + 5 * k) for k in range(3)]
    handlers = [
        fixed_reply_node({ARRAYS: state}, {NUM_EXAMPLES: n, TRAIN_STEPS: tau, TRAIN_LOSS: 1.0})
        for state, n, tau in specs
    ]
    states, weights, steps = zip(*specs, strict=True)
    expected_nova = fednova_update(start, states, weights, steps)
    expected_exp, eta = fedexp_update(start, states, weights)
    for strategy, expected in ((FedNova(min_available_nodes=3, local_steps=13), expected_nova),
                               (FedExP(min_available_nodes=3), expected_exp)):  # fmt: skip
        arrays, metrics = one_round(strategy, InProcessGrid(handlers), state_to_arrays(start))
        assert arrays is not None and metrics is not None and metrics[NUM_REPLIES] == 3
        for key, value in expected.items():
            torch.testing.assert_close(torch.from_numpy(arrays[key].numpy()), value)
    assert metrics[SERVER_STEP] == pytest.approx(eta)


def test_fedacg_sends_the_lookahead_with_beta_and_keeps_momentum() -> None:
    start = {"w": torch.tensor([1.0, -1.0])}
    grid = InProcessGrid([fixed_reply_node({ARRAYS: {"w": torch.tensor([2.0, 0.0])}},
                                           {NUM_EXAMPLES: 1})] * 2)  # fmt: skip
    strategy = FedACG(momentum=0.5, beta=0.3, min_available_nodes=2)
    arrays, _ = one_round(strategy, grid, state_to_arrays(start))
    assert arrays is not None  # round 1: m = 0, x~ = x; the mean (2, 0) is the new x
    torch.testing.assert_close(arrays_to_state(arrays)["w"], torch.tensor([2.0, 0.0]))
    sent = grid.sent[-1].content
    assert sent[CONFIG][PROXIMAL_MU] == 0.3
    torch.testing.assert_close(arrays_to_state(sent[ARRAYS])["w"], start["w"])
    one_round(strategy, grid, arrays, server_round=2)
    # round 2 sends x + lambda m = (2, 0) + 0.5 (1, 1)
    torch.testing.assert_close(arrays_to_state(grid.sent[-1].content[ARRAYS])["w"],
                               torch.tensor([2.5, 0.5]))  # fmt: skip


@pytest.mark.parametrize("kind", [FedNova, FedExP])
def test_rules_that_need_each_update_refuse_secure_aggregation(kind: type) -> None:
    with pytest.raises(ValueError, match="secure aggregation hides"):
        kind(secure_aggregation=SecureAggregationConfig())


# ------------------------------------------------------------------ Flower's defaults


def _defaults(cls: type, package: str) -> dict[str, object]:
    """Constructor argument -> default, over the class and the bases of `package` it
    forwards to (fedfields' own signatures, not the Flower base they build on)."""
    found: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        init = vars(klass).get("__init__")
        if init is None or not klass.__module__.startswith(package):
            continue
        for name, parameter in inspect.signature(init).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                found[name] = parameter.default
    return found


@pytest.mark.parametrize(
    ("ours", "flowers", "renamed"),
    [
        (FedAvg, flower_strategy.FedAvg, {}),
        (FedProx, flower_strategy.FedProx, {}),
        (FedAvg, flower_strategy.FedMedian, {}),  # FedAvg(aggregation_rule="median")
        (FedAvg, flower_strategy.FedTrimmedAvg, {"beta": "trim_fraction"}),
        (FedAvg, flower_strategy.Krum, {"num_malicious_nodes": "num_malicious"}),
        (FedAvg, flower_strategy.Bulyan, {"num_malicious_nodes": "num_malicious"}),
    ],
    ids=["FedAvg", "FedProx", "FedMedian", "FedTrimmedAvg", "Krum", "Bulyan"],
)
def test_constructor_defaults_match_flowers_strategies(
    ours: type, flowers: type, renamed: dict[str, str]
) -> None:
    """Every argument fedfields shares with Flower's strategy of the same rule (Flower's
    name on the left of `renamed`) defaults as Flower's does, read from both signatures."""
    theirs, mine = _defaults(flowers, "flwr"), _defaults(ours, "fedfields")
    shared = {renamed.get(name, name): value for name, value in theirs.items()}
    shared = {name: value for name, value in shared.items() if name in mine}
    assert len(shared) >= 5  # sampling at least: the comparison is not vacuous
    assert {name: mine[name] for name in shared} == shared
    ours()  # constructible with no argument, as Flower's


def test_fedprox_without_mu_is_fedavg() -> None:
    assert FedProx().method.proximal_mu == 0.0 == flower_strategy.FedProx().proximal_mu


# ------------------------------------------------------------------ docs/LIBRARY.md's recipe


def test_a_toy_strategy_is_one_module_and_one_registry_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tests/toy_strategy.py plus one registry line: the App's schema parses its own key,
    refuses it misspelt or under another strategy, its reference row appears, the App builds
    it with the typed settings, and it trains three rounds in process."""
    from toy_strategy import FedToy, FedToySettings

    import strategies
    from fedfields.config.reference import reference
    from fedfields.flower import method_strategy

    monkeypatch.setitem(strategies.STRATEGIES, "fedtoy", strategies.entry(FedToy))  # the line
    config = parse_app_config({"strategy": "fedtoy", "toy-mu": 0.5, "max-empty-rounds": 4})
    assert config.settings == FedToySettings(mu=0.5)
    built = strategies.make_strategy(config, local_steps=2)
    assert isinstance(built.method, FedToy) and (built.method.mu, built.max_empty_rounds) == (
        0.5,
        4,
    )
    assert parse_app_config({"strategy": "fedtoy"}).settings == FedToySettings(mu=0.25)
    with pytest.raises(ValueError, match="unknown run-config key 'toy-mue'; did you mean 'toy-mu'"):
        parse_app_config({"strategy": "fedtoy", "toy-mue": 0.5})
    with pytest.raises(ValueError, match="'toy-mu' = 0.5 is read only with strategy='fedtoy'"):
        parse_app_config({"strategy": "fedavg", "toy-mu": 0.5})
    with pytest.raises(ValueError, match="run-config 'toy-mu' must be finite and >= 0"):
        parse_app_config({"strategy": "fedtoy", "toy-mu": -1.0})
    assert parse_app_config({"strategy": "fedtoy", "aggregation-rule": "median"}).settings
    assert "| `toy-mu` | float | 0.25 | FedToy's client weight mu (read by fedtoy) |" in reference(
        strategies.strategy_settings()
    )
    toy = method_strategy(FedToy)  # your own app: no schema
    assert toy.from_config({"toy-mu": 0.5}).method.mu == 0.5 and toy is method_strategy(FedToy)
    with pytest.raises(ValueError, match="unknown run-config key 'toy-mue'"):
        toy.from_config({"toy-mue": 0.5})
    problems = heterogeneous_problems(count=3)
    grid = InProcessGrid([least_squares_app(problems, 0.05, [1.0] * 3)] * 3, raise_errors=True)
    result = built.start(grid, state_to_arrays(initial_state()), num_rounds=3)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    sent = [m.content[CONFIG] for m in grid.sent if m.metadata.message_type == "train"]
    assert {c["toy-mu"] for c in sent} == {0.5} and {c[STRATEGY] for c in sent} == {"fedtoy"}
