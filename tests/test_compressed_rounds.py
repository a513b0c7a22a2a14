"""Compressed uploads in Flower rounds (issue 45, point 2): the client half compresses with
error feedback kept in the node's state, the gate decompresses before every check, a FedAvg
round equals the mean of the decompressed replies computed apart, malformed replies are
dropped with their reason, and the settings that cannot work are refused."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from test_federated_nerf import tiny
from torch import Tensor

from fedfields.compression import (
    CompressionConfig,
    compress,
    compress_with_feedback,
    decompress,
    full_bytes,
)
from fedfields.config import FederatedConfig
from fedfields.flower import (
    DecentNeRF,
    FedACG,
    FedAvg,
    FedExP,
    FedNova,
    FedProx,
    NodeState,
    Scaffold,
    answer_gradient_query,
    compressed_download_mod,
    keep_results,
    received_hooks,
)
from fedfields.flower.compressed_downloads import DOWNLOAD_REFERENCE
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import (
    ARRAYS,
    BYTES_DOWN,
    COMPRESSION,
    CONFIG,
    DOWNLOAD_BASE,
    GRADIENT,
    GRADIENT_QUERY,
    NUM_DROPPED,
    NUM_EXAMPLES,
    NUM_FAILURES,
    STRATEGY,
    TRAIN_STEPS,
    USER_KEY_MESSAGE_TYPE,
    ReplyParts,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.resume import RESUME_FILE, load_round_checkpoint
from fedfields.flower.upload_compression import (
    CONTROL_STREAM,
    RESIDUAL,
    compressed_parts,
    rebuilt_arrays,
)
from fedfields.methods import ALPHA_KEY
from fedfields.methods.base import HookResult
from fedfields.methods.scaffold import CLIENT_CONTROL, CONTROL_DELTA, SERVER_CONTROL, ScaffoldHook
from fedfields.privacy.dp import scaled_difference
from fedfields.privacy.secagg_plan import SecureAggregationConfig
from simulations.federated_nerf import make_strategy, run_federated_nerf
from simulations.in_process_grid import InProcessGrid
from simulations.run import client_app
from strategies import parse_app_config

State = dict[str, Tensor]
SCHEMES = [
    CompressionConfig("lowrank", rank=2),
    CompressionConfig("quantise", bits=4),
    CompressionConfig("topk", fraction=0.25),
]
EXAMPLES = (10.0, 30.0, 60.0)


def global_state() -> State:
    generator = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(8, 6, generator=generator), "bias": torch.zeros(8)}


def local_state(k: int) -> State:
    """Client k's trained state: the global plus an update of its own."""
    generator = torch.Generator().manual_seed(100 + k)
    return {
        key: value + 0.1 * torch.randn(value.shape, generator=generator)
        for key, value in global_state().items()
    }


def compressing_node(k: int, tamper: Callable[[ArrayRecord], None] | None = None) -> Callable:
    """A client that replies local_state(k) through `compressed_parts` (seed k); `tamper`
    changes the compressed record before it is sent (a hostile client)."""

    def handler(message: Message, context: Context) -> Message:
        if message.metadata.message_type == USER_KEY_MESSAGE_TYPE:
            return answer_user_key(message, context)
        parts = ReplyParts({ARRAYS: state_to_arrays(local_state(k))}, {NUM_EXAMPLES: EXAMPLES[k]})
        parts = compressed_parts(message, parts, NodeState(context), seed=k)
        if tamper is not None:
            tamper(parts.records[ARRAYS])
        return parts.message(message)

    return handler


def run_round(strategy: FedAvg, grid: InProcessGrid, server_round: int = 1):
    messages = strategy.configure_train(
        server_round, state_to_arrays(global_state()), ConfigRecord(), grid
    )
    arrays, metrics = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
    assert metrics is not None
    return arrays, metrics


def oracle(config: CompressionConfig, clients: list[int]) -> State:
    """The mean the round must form, computed apart: each client's record from the library
    maths (no residual in round 1), decompressed, added to the global, weighted by examples."""
    sent = global_state()
    shapes = {key: tuple(value.shape) for key, value in sent.items()}
    total = {key: torch.zeros(value.shape, dtype=torch.float64) for key, value in sent.items()}
    for k in clients:
        update = {key: local_state(k)[key].double() - sent[key].double() for key in sent}
        record, _ = compress_with_feedback(update, None, config, torch.Generator().manual_seed(k))
        restored = decompress(record, shapes, config)
        for key in sent:
            state = (sent[key].double() + restored[key].double()).float()
            total[key] += EXAMPLES[k] * state.double()
    weight = sum(EXAMPLES[k] for k in clients)
    return {key: (value / weight).float() for key, value in total.items()}


@pytest.mark.parametrize("config", SCHEMES, ids=lambda c: c.scheme)
def test_a_compressed_fedavg_round_is_the_mean_of_the_decompressed_replies(
    config: CompressionConfig,
) -> None:
    grid = InProcessGrid([compressing_node(k) for k in range(3)])
    strategy = FedAvg(min_available_nodes=3, compression=config)
    arrays, metrics = run_round(strategy, grid)
    assert arrays is not None and metrics[NUM_DROPPED] == 0
    expected = oracle(config, [0, 1, 2])
    got = arrays_to_state(arrays)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-6)
    assert all(message.content[CONFIG][COMPRESSION] == config.scheme for message in grid.sent
               if CONFIG in message.content)  # fmt: skip
    full = sum(4 * value.numel() for value in global_state().values())
    if config.scheme != "lowrank":  # lowrank sends this small a model's bias whole
        assert all(
            sum(array.numpy().nbytes for array in reply.content[ARRAYS].values()) < full
            for reply in grid.received
            if ARRAYS in reply.content
        )


def test_the_residual_stays_in_the_nodes_state_and_feeds_the_next_round() -> None:
    """After round 1 each node keeps update - what it sent; round 2 compresses the new update
    plus that residual, which the round's mean shows."""
    config = CompressionConfig("topk", fraction=0.25)
    grid = InProcessGrid([compressing_node(k) for k in range(3)])
    strategy = FedAvg(min_available_nodes=3, compression=config)
    run_round(strategy, grid)
    sent = global_state()
    shapes = {key: tuple(value.shape) for key, value in sent.items()}
    for k, context in enumerate(grid.contexts.values()):
        residual = NodeState(context).tensors(RESIDUAL)
        assert residual is not None
        update = {key: local_state(k)[key] - sent[key] for key in sent}
        record, _ = compress_with_feedback(update, None, config, torch.Generator().manual_seed(k))
        restored = decompress(record, shapes, config)
        for key in sent:
            torch.testing.assert_close(residual[key], update[key] - restored[key])
    arrays, _ = run_round(strategy, grid, server_round=2)
    # round 2 sends update + residual = 2 updates - what round 1 sent: more entries than
    # top-k alone would, so the mean differs from the round-1 oracle
    assert arrays is not None
    second = arrays_to_state(arrays)
    first = oracle(config, [0, 1, 2])
    assert any(not torch.allclose(second[key], first[key]) for key in first)


def _put(name: str, value: np.ndarray) -> Callable[[ArrayRecord], None]:
    return lambda record: record.__setitem__(name, Array(value))


MALFORMED = {
    "wrong rank": (SCHEMES[0], _put("weight:u", np.ones((8, 3), np.float32))),
    "scale not finite": (SCHEMES[1], _put("weight:scale", np.array([np.inf], np.float32))),
    "bit width not asked": (SCHEMES[1], _put("bias:bits", np.array([8], np.uint8))),
    "index out of range": (SCHEMES[2], _put("bias:indices", np.array([8, 1]))),
    "repeated index": (SCHEMES[2], _put("bias:indices", np.array([1, 1]))),
    "entry missing": (SCHEMES[2], lambda record: record.pop("weight:values")),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_compressed_reply_is_dropped_and_counted(kind: str) -> None:
    config, tamper = MALFORMED[kind]
    nodes = [compressing_node(0), compressing_node(1), compressing_node(2, tamper)]
    strategy = FedAvg(min_available_nodes=3, compression=config)
    arrays, metrics = run_round(strategy, InProcessGrid(nodes))
    assert metrics[NUM_DROPPED] == 1 and metrics["dropped-compression"] == 1
    assert arrays is not None
    got, expected = arrays_to_state(arrays), oracle(config, [0, 1])
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-6)
    assert "malformed" in strategy.drop_reason("compression")


def test_the_update_norm_cap_checks_the_decompressed_update() -> None:
    """A well-formed record whose scale moves the model a million-fold passes decompression
    and is dropped by the update-norm check, as an uncompressed reply would be."""
    huge = _put("weight:scale", np.array([1e6], np.float32))
    nodes = [compressing_node(0), compressing_node(1), compressing_node(2, huge)]
    strategy = FedAvg(min_available_nodes=3, compression=SCHEMES[1])
    _, metrics = run_round(strategy, InProcessGrid(nodes))
    assert metrics["dropped-update-norm"] == 1


def test_settings_that_cannot_work_are_refused_with_the_reason() -> None:
    secure = SecureAggregationConfig()
    with pytest.raises(ValueError, match="cannot compose with secure aggregation"):
        FedAvg(secure_aggregation=secure, compression=CompressionConfig("topk"))
    assert FedAvg(secure_aggregation=secure, compression=CompressionConfig("quantise"))
    assert DecentNeRF(compression=CompressionConfig("lowrank")).compression is not None
    assert FedAvg(compression=CompressionConfig("none")).compression is None


def test_without_compression_asked_the_reply_goes_whole() -> None:
    context = Context(1, 1, {}, RecordDict(), {})
    content = RecordDict({ARRAYS: state_to_arrays(global_state()), CONFIG: ConfigRecord({})})
    message = Message(content, dst_node_id=1, message_type="train")
    parts = ReplyParts({ARRAYS: state_to_arrays(local_state(0))}, {NUM_EXAMPLES: 1.0})
    assert compressed_parts(message, parts, NodeState(context), seed=0) is parts


# ------------------------------------------------------------------ the run-config


def test_the_run_config_parses_compression_once_into_the_strategy() -> None:
    config = FederatedConfig.from_run_config(
        {"strategy": "fedavg", "compression": "quantise", "compression-bits": 2}
    )
    assert config.compression.compression_config() == CompressionConfig("quantise", bits=2)
    assert make_strategy(config).compression == CompressionConfig("quantise", bits=2)
    assert FederatedConfig().compression.compression_config() is None


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"compression": "zip"}, "'compression' must be one of"),
        ({"compression": "quantise", "compression-bits": 3}, "compression-bits must be one of"),
        ({"compression": "topk", "compression-rank": 2}, "read only with compression='lowrank'"),
        ({"strategy": "fedavg", "compression-fraction": 0.5}, "compression='topk'"),
        (
            {"strategy": "fedavg", "compression": "topk", "secure-aggregation": True},
            "clients' factors or indices do not add up",
        ),
        (
            {
                "strategy": "fedavg",
                "compression": "quantise",
                "secure-aggregation": True,
                "dp-noise-multiplier": 1.0,
                "dp-clip-norm": 1.0,
            },
            "differential privacy",
        ),
        ({"strategy": "decentnerf", "compression": "topk", "secure-aggregation": True}, "add up"),
    ],
)
def test_a_bad_compression_setting_is_one_error_naming_it(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FederatedConfig.from_run_config({"min-train-nodes": 3, **run_config})


# ------------------------------------------------------------------ every strategy

STRATEGIES = {
    "fedavg": FedAvg,
    "fedprox": lambda **o: FedProx(proximal_mu=0.1, **o),
    "fednova": lambda **o: FedNova(local_steps=8, **o),
    "fedexp": FedExP,
    "fedacg": FedACG,
    "scaffold": Scaffold,
    "decentnerf": DecentNeRF,
}


def strategy_node(k: int, compressed: bool) -> Callable:
    """Client k of any strategy: its state is what it received plus update k. Compressed, it
    replies through `compressed_parts`; otherwise it replies, whole, the state the server
    must rebuild from that record (received + decompressed update, computed apart), and
    Scaffold's control delta (0.01 x update k, through the client hooks) as decompressed."""

    def handler(message: Message, context: Context) -> Message:
        if message.metadata.message_type == USER_KEY_MESSAGE_TYPE:
            return answer_user_key(message, context)
        received = arrays_to_state(message.content[ARRAYS])
        update = {key: local_state(k)[key] - global_state()[key] for key in received}
        local = {key: received[key] + update[key] for key in received}
        metrics = {NUM_EXAMPLES: EXAMPLES[k], TRAIN_STEPS: 2.0 + k}
        scale_key = ""
        if message.content[CONFIG].get(STRATEGY) == "decentnerf":  # alpha_k g_k and alpha_k
            scale_key, alpha = ALPHA_KEY, 0.5 + 0.25 * k
            local = {key: alpha * v for key, v in local.items()}
            local[ALPHA_KEY] = torch.tensor([alpha])
        records = RecordDict({ARRAYS: state_to_arrays(local)})
        control_delta = {key: 0.01 * v for key, v in update.items()}
        if SERVER_CONTROL in message.content:  # Scaffold
            scaffold_reply(message, NodeState(context), records, control_delta)
        parts = ReplyParts(dict(records), metrics)
        if compressed:
            return compressed_parts(message, parts, NodeState(context), seed=k).message(message)
        config = SCHEMES[1]
        shapes = {key: tuple(value.shape) for key, value in local.items()}
        exact = scaled_difference(local, received, scale_key)
        record, _ = compress_with_feedback(exact, None, config, torch.Generator().manual_seed(k))
        rebuilt = rebuilt_arrays(received, decompress(record, shapes, config), scale_key)
        whole = {**parts.records, ARRAYS: rebuilt}
        if CONTROL_DELTA in whole:
            stream = torch.Generator().manual_seed(k + CONTROL_STREAM)
            sent = decompress(compress(control_delta, config, stream), shapes, config)
            whole[CONTROL_DELTA] = state_to_arrays(sent)
        return ReplyParts(whole, metrics).message(message)

    return handler


def gradient_k(k: int) -> State:
    """User k's loss gradient G_k at the global."""
    generator = torch.Generator().manual_seed(200 + k)
    return {key: torch.randn(v.shape, generator=generator) for key, v in global_state().items()}


def gradient_node(k: int, scale_lost: bool = False) -> Callable:
    """A DecentNeRF user answering the gradient query with G_k through the library's
    `answer_gradient_query` (seed k); `scale_lost` drops one tensor's scale from the record."""

    def handler(message: Message, context: Context) -> Message:
        if message.metadata.message_type == USER_KEY_MESSAGE_TYPE:
            return answer_user_key(message, context)
        assert message.metadata.message_type == GRADIENT_QUERY
        reply = answer_gradient_query(message, lambda _: gradient_k(k), seed=k)
        if scale_lost:
            del reply.content[GRADIENT]["weight:scale"]
        return reply

    return handler


def test_decentnerfs_gradient_query_sums_the_decompressed_gradients_and_drops_a_bad_one() -> None:
    """In plaintext each G_k goes up as 4-bit codes (once, no residual kept); the G the train
    messages carry is the sum of the decompressed records (oracle computed apart), and a record
    without a scale is dropped as "compression" and left out of the sum."""
    config = SCHEMES[1]
    shapes = {key: tuple(v.shape) for key, v in global_state().items()}
    for lost in (False, True):
        strategy = DecentNeRF(min_available_nodes=3, compression=config)
        grid = InProcessGrid([gradient_node(k, scale_lost=lost and k == 2) for k in range(3)])
        messages = list(strategy.configure_train(
            2, state_to_arrays(global_state()), ConfigRecord(), grid))  # fmt: skip
        sent = arrays_to_state(messages[0].content[GRADIENT])
        summed = range(2) if lost else range(3)
        for key, value in sent.items():
            expected = sum(
                decompress(compress(gradient_k(k), config, torch.Generator().manual_seed(k)),
                           shapes, config)[key].double()
                for k in summed
            )  # fmt: skip
            torch.testing.assert_close(value.double(), expected, atol=1e-6, rtol=1e-6)
        assert strategy.flower_round is not None
        assert strategy.flower_round.ledger.dropped == ({"compression": 1} if lost else {})
    replies = [reply for reply in grid.received if GRADIENT in reply.content]
    for reply in replies:
        wire = sum(array.numpy().nbytes for array in reply.content[GRADIENT].values())
        assert wire < full_bytes(global_state()) / 4
    assert all(RESIDUAL not in context.state for context in grid.contexts.values())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_sums_what_the_decompressed_replies_would_give(name: str) -> None:
    """Each strategy's round on quantised replies equals its round on the plaintext replies
    of the decompressed states: the gate hands the strategy exactly what it would sum."""
    results = []
    for compressed in (True, False):
        options = {"compression": SCHEMES[1]} if compressed else {}
        strategy = STRATEGIES[name](min_available_nodes=3, **options)
        grid = InProcessGrid([strategy_node(k, compressed) for k in range(3)])
        arrays, metrics = run_round(strategy, grid)
        assert arrays is not None and metrics[NUM_DROPPED] == 0
        state = arrays_to_state(arrays)
        if isinstance(strategy, Scaffold):  # c too: the sum of the decompressed deltas
            state |= {f"c.{key}": value for key, value in strategy.method.server_control.items()}
        results.append(state)
    for key in results[1]:
        torch.testing.assert_close(results[0][key], results[1][key], atol=1e-6, rtol=1e-6)


def test_a_restarted_node_resumes_its_residual_from_its_state_directory(tmp_path: Path) -> None:
    """Round 2 after the nodes restart on their state directories (fresh contexts) equals
    round 2 of nodes that kept their residual in memory all along."""
    config = CompressionConfig("topk", fraction=0.25)

    def round_two(first: InProcessGrid, second: InProcessGrid) -> State:
        strategy = FedAvg(min_available_nodes=3, compression=config)
        run_round(strategy, first)
        arrays, _ = run_round(strategy, second, server_round=2)
        assert arrays is not None
        return arrays_to_state(arrays)

    nodes = [compressing_node(k) for k in range(3)]
    in_memory = InProcessGrid(nodes)
    kept = round_two(in_memory, in_memory)
    on_disk = {"state-dir": str(tmp_path)}
    resumed = round_two(
        InProcessGrid(nodes, run_config=on_disk), InProcessGrid(nodes, run_config=on_disk)
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["node_00", "node_01", "node_02"]
    for key in kept:
        assert torch.equal(resumed[key], kept[key]), key
    first_only = oracle(config, [0, 1, 2])
    assert any(not torch.equal(kept[key], first_only[key]) for key in kept)


def larger_global_state() -> State:
    """A 64 x 64 weight: large enough that a 4-bit chain costs fewer bytes than the whole."""
    generator = torch.Generator().manual_seed(0)
    return {"weight": torch.randn(64, 64, generator=generator), "bias": torch.zeros(64)}


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"decentnerf"}))
def test_every_strategy_runs_with_compressed_downloads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rounds of each strategy with 4-bit uploads and downloads, the nodes behind
    `compressed_download_mod`: nothing dropped or failed, rounds 2 and 3 send every node the
    chain from the round before, every node holds the server's reference, and rounds 2 and 3
    send under a third of round 1's bytes (Scaffold: its server control c goes whole, so
    under 0.6). (DecentNeRF, whose gradient query carries the download too:
    tests/test_compressed_downloads.py's App test.)"""
    monkeypatch.setattr(sys.modules[__name__], "global_state", larger_global_state)
    config = CompressionConfig("quantise", bits=4, download=True)
    strategy = STRATEGIES[name](min_available_nodes=3, compression=config)
    nodes = [strategy_node(k, compressed=True) for k in range(3)]
    grid = InProcessGrid(
        [lambda m, c, node=node: compressed_download_mod(m, c, node) for node in nodes]
    )
    down = []
    for server_round in (1, 2, 3):
        arrays, metrics = run_round(strategy, grid, server_round)
        assert arrays is not None and metrics[NUM_DROPPED] == 0 and metrics[NUM_FAILURES] == 0
        sent = [m for m in grid.sent if m.metadata.group_id == str(server_round)
                and CONFIG in m.content and DOWNLOAD_BASE in m.content[CONFIG]]  # fmt: skip
        assert {int(m.content[CONFIG][DOWNLOAD_BASE]) for m in sent} == {server_round - 1}
        reference = strategy.downloads.chain.reference
        for context in grid.contexts.values():
            held = NodeState(context).tensors(DOWNLOAD_REFERENCE)
            assert all(torch.equal(held[key], reference[key]) for key in reference)
        down.append(metrics[BYTES_DOWN])
    share = 0.6 if name == "scaffold" else 1 / 3
    assert down[1] < share * down[0] and down[2] < share * down[0]


# ------------------------------------------------------------------ Scaffold's control delta


def scaffold_reply(message: Message, state: NodeState, records: RecordDict, step: State) -> None:
    """A Scaffold client's reply through the library's client hooks (`received_hooks`,
    `keep_results`): c_i+ = c_i + `step`, delta c_i into `records`, c_i+ kept."""
    (hook,) = received_hooks(message, state)
    assert isinstance(hook, ScaffoldHook)
    new = {key: c + step[key] for key, c in hook.client.items()}
    delta = {key: value - hook.client[key] for key, value in new.items()}
    keep_results([HookResult({CONTROL_DELTA: delta}, {CLIENT_CONTROL: new})], records, state)


def scaffold_node(k: int, hostile: bool = False) -> Callable:
    """A Scaffold client through the library's client hooks and `compressed_parts`: its
    new control c_i+ is c_i plus a step of its own each round; `hostile` drops one tensor's
    scale from its compressed control delta."""

    def handler(message: Message, context: Context) -> Message:
        if message.metadata.message_type == USER_KEY_MESSAGE_TYPE:
            return answer_user_key(message, context)
        state = NodeState(context)
        server_round = int(message.content[CONFIG]["server-round"])
        generator = torch.Generator().manual_seed(10 * k + server_round)
        step = {key: torch.randn(v.shape, generator=generator) for key, v in global_state().items()}
        records = RecordDict({ARRAYS: state_to_arrays(local_state(k))})
        scaffold_reply(message, state, records, step)
        parts = compressed_parts(message, ReplyParts(dict(records), {NUM_EXAMPLES: 1.0}), state, k)
        if hostile:
            del parts.records[CONTROL_DELTA]["weight:scale"]
        return parts.message(message)

    return handler


def test_scaffold_s_control_delta_goes_compressed_and_c_stays_the_clients_mean() -> None:
    """Every client in every round, 4-bit codes: each delta c_i travels at under a quarter of
    its bytes, and after each round the server's c is the mean of the controls the nodes
    keep (c_i + the decoded delta, not c_i+: else c drifts from them by the rounding)."""
    config = SCHEMES[1]
    strategy = Scaffold(min_available_nodes=3, compression=config)
    grid = InProcessGrid([scaffold_node(k) for k in range(3)])
    for server_round in (1, 2, 3):
        arrays, metrics = run_round(strategy, grid, server_round)
        assert arrays is not None and metrics[NUM_DROPPED] == 0
        kept = [NodeState(context).tensors(CLIENT_CONTROL) for context in grid.contexts.values()]
        for key, c in strategy.method.server_control.items():
            mean = sum(control[key].double() for control in kept) / 3
            torch.testing.assert_close(c.double(), mean, atol=1e-6, rtol=1e-6)
    for reply in grid.received:
        if CONTROL_DELTA in reply.content:
            wire = sum(array.numpy().nbytes for array in reply.content[CONTROL_DELTA].values())
            assert wire < full_bytes(global_state()) / 4
    # the server's c against the controls the nodes would have kept without the decoding
    exact = sum(
        torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * k + r))
        for k in range(3) for r in (1, 2, 3)
    ) / 3  # fmt: skip
    assert not torch.allclose(strategy.method.server_control["weight"], exact, atol=1e-3)


def test_a_malformed_control_delta_is_dropped_whole() -> None:
    """A control record without its scale: the reply is dropped as "compression", its y_i
    left out with it."""
    strategy = Scaffold(min_available_nodes=3, compression=SCHEMES[1])
    grid = InProcessGrid([scaffold_node(k, hostile=k == 2) for k in range(3)])
    arrays, metrics = run_round(strategy, grid)
    assert arrays is not None and metrics[NUM_DROPPED] == metrics["dropped-compression"] == 1
    honest = Scaffold(min_available_nodes=2, compression=SCHEMES[1])
    expected, _ = run_round(honest, InProcessGrid([scaffold_node(k) for k in range(2)]))
    assert expected is not None
    for key, value in arrays_to_state(expected).items():
        torch.testing.assert_close(arrays_to_state(arrays)[key], value, atol=1e-6, rtol=1e-6)


def test_the_apps_compressed_scaffold_run_keeps_c_the_mean_of_its_nodes_controls(
    crowd_dir: Path, tmp_path: Path
) -> None:
    """The App's Scaffold job (run-config compression='quantise', 4 bits), every user every
    round: the control deltas go up as codes, and the c the run checkpoints after round 2 is
    the mean of the controls the nodes keep in their state directories."""
    config = tiny(crowd_dir, tmp_path / "run", "scaffold", **{"compression": "quantise",
                                                             "compression-bits": 4})  # fmt: skip
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    run_dir = run_federated_nerf(grid, parse_app_config(config), observe=False)
    deltas = [reply.content[CONTROL_DELTA] for reply in grid.received
              if CONTROL_DELTA in reply.content]  # fmt: skip
    assert len(deltas) == 6 and all(any(key.endswith(":scale") for key in d) for d in deltas)
    server = load_round_checkpoint(run_dir / RESUME_FILE).strategy_state["server-control"]
    nodes = sorted(Path(config["state-dir"]).iterdir())
    kept = [torch.load(node / f"{CLIENT_CONTROL}.pt") for node in nodes]
    assert len(kept) == 3
    for key, c in server.items():
        mean = sum(control[key].double() for control in kept) / 3
        torch.testing.assert_close(c.double(), mean, atol=1e-6, rtol=1e-5)


def test_a_control_delta_without_the_nodes_control_is_refused_by_name() -> None:
    """`compressed_parts` must move the node's kept c_i by the decoded delta: a CONTROL_DELTA
    made without the hook's kept c_i+ (nothing kept) is one error naming both."""
    strategy = Scaffold(min_available_nodes=3, compression=SCHEMES[1])
    grid = InProcessGrid([scaffold_node(k) for k in range(3)])
    message, *_ = strategy.configure_train(1, state_to_arrays(global_state()), ConfigRecord(), grid)
    delta = {CONTROL_DELTA: state_to_arrays(global_state())}
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match=f"'{CONTROL_DELTA}' reply needs .*'{CLIENT_CONTROL}'"):
        compressed_parts(message, ReplyParts(delta, {}), NodeState(context), seed=0)
