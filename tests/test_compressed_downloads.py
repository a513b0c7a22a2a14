"""Compressed downloads (issue 45, point 1's option): the server's reference chain, what each
node is sent, the node's mod that rebuilds the global, a round read against the exact global,
a node that lost its reference, and the chain across a resume. The App's secure DecentNeRF
with compressed downloads: tests/test_packed_secure_sum.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from torch import Tensor

from fedfields.compression import (
    CompressionConfig,
    compress,
    compress_with_feedback,
    decompress,
    full_bytes,
)
from fedfields.download_chain import ReferenceChain, rebuilt_chain
from fedfields.flower import FedAvg, NodeState, compressed_download_mod
from fedfields.flower.compressed_downloads import (
    DOWNLOAD_HELD,
    DOWNLOAD_REFERENCE,
    DownloadSender,
    followed,
)
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import (
    ARRAYS,
    BYTES_DOWN,
    CONFIG,
    DOWNLOAD_BASE,
    DOWNLOAD_VERSION,
    GRADIENT,
    GRADIENT_COMPRESSED,
    NUM_EXAMPLES,
    NUM_FAILURES,
    NUM_REPLIES,
    USER_KEY_MESSAGE_TYPE,
    ReplyParts,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.resume import RoundCheckpoint, load_round_checkpoint, save_round_checkpoint
from fedfields.flower.upload_compression import compressed_parts, compression_entries
from simulations.in_process_grid import InProcessGrid

State = dict[str, Tensor]
QUANTISE = CompressionConfig("quantise", bits=4, download=True)
NODES = 3


def target(version: int) -> State:
    """The server's global of round `version`: a random walk from a seeded start."""
    generator = torch.Generator().manual_seed(0)
    state = {"weight": torch.randn(64, 64, generator=generator), "bias": torch.zeros(64)}
    for step in range(1, version):
        walk = torch.Generator().manual_seed(step)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=walk) for k, v in state.items()}
    return state


def advanced(chain: ReferenceChain, versions: range) -> list[State]:
    """The chain's reference after each of `versions`."""
    return [dict(chain.advance(v, target(v), torch.Generator().manual_seed(v))) for v in versions]


def norm(state: State) -> float:
    return float(torch.sqrt(sum((value.double() ** 2).sum() for value in state.values())))


def gap(a: State, b: State) -> State:
    return {key: a[key] - b[key] for key in a}


# ------------------------------------------------------------------ the chain (no Flower)
def test_round_one_goes_whole_and_each_node_rebuilds_the_servers_reference_bit_for_bit() -> None:
    chain = ReferenceChain(QUANTISE)
    references = advanced(chain, range(1, 6))
    assert all(torch.equal(references[0][k], target(1)[k]) for k in references[0])
    assert chain.download(0).whole is not None  # a node holding nothing gets it whole
    for held in range(1, 5):
        download = chain.download(held)
        assert download.base == held and sorted(download.records) == list(range(held + 1, 6))
        rebuilt = rebuilt_chain(references[held - 1], held, download.records, 5, QUANTISE)
        for key in rebuilt:
            assert torch.equal(rebuilt[key], references[-1][key]), (held, key)


def test_what_a_difference_leaves_out_is_sent_in_the_next_one() -> None:
    """Top-k of a fixed target: each round sends the largest remaining gap, so the reference
    reaches the target exactly after 1/f rounds (the chain is its own error feedback)."""
    config = CompressionConfig("topk", fraction=0.25, download=True)
    chain = ReferenceChain(config)
    chain.advance(1, {key: torch.zeros_like(v) for key, v in target(1).items()}, None)
    gaps = []
    for version in range(2, 7):
        reference = chain.advance(version, target(1), torch.Generator())
        gaps.append(norm(gap(target(1), reference)))
    assert all(later < earlier for earlier, later in zip(gaps[:3], gaps[1:4], strict=True))
    assert gaps[3] < 1e-6 and gaps[4] < 1e-6


def test_the_gap_stays_one_compression_error_while_the_target_moves() -> None:
    """Unbiased 4-bit codes on a moving target: the gap ||T_t - R_t|| never grows past what
    one difference's rounding leaves (a bound from the scales), round after round."""
    chain = ReferenceChain(QUANTISE)
    for version, reference in zip(range(1, 12), advanced(chain, range(1, 12)), strict=True):
        if version == 1:
            continue
        # 4-bit codes round each entry by at most one level: 2 s / 15 per entry, s <= max |gap|
        bound = sum(value.numel() ** 0.5 * 2 * 0.2 / 15 for value in target(version).values())
        assert norm(gap(target(version), reference)) < bound, version


def test_a_node_too_far_behind_or_a_chain_dearer_than_the_global_gets_it_whole() -> None:
    history = CompressionConfig("quantise", bits=4, download=True, download_history=2)
    chain = ReferenceChain(history)
    advanced(chain, range(1, 6))
    assert sorted(chain.download(3).records) == [4, 5]
    assert chain.download(2).whole is not None  # version 3's record is no longer kept
    eight_bit = ReferenceChain(CompressionConfig("quantise", bits=8, download=True))
    advanced(eight_bit, range(1, 7))
    assert eight_bit.download(5).records  # one 8-bit record: a quarter of the bytes
    assert eight_bit.download(1).whole is not None  # five records cost more than the whole


def test_the_chain_refuses_to_go_back_and_restarts_whole_for_another_model() -> None:
    chain = ReferenceChain(QUANTISE)
    advanced(chain, range(1, 3))
    with pytest.raises(ValueError, match="version 2 after version 2"):
        chain.advance(2, target(2), torch.Generator())
    wider = {"weight": torch.ones(64, 65), "bias": torch.zeros(64)}
    assert torch.equal(chain.advance(3, wider, torch.Generator())["weight"], wider["weight"])
    assert chain.download(2).whole is not None


# ------------------------------------------------------------------ through Flower
def local_state(received: State, k: int, server_round: int) -> State:
    """Node k's trained state: what it received plus an update of its own."""
    walk = torch.Generator().manual_seed(100 * server_round + k)
    return {key: v + 0.1 * torch.randn(v.shape, generator=walk) for key, v in received.items()}


def downloading_node(k: int) -> Callable:
    """A node behind `compressed_download_mod` that trains from what it received and replies
    through `compressed_parts` (seed k + round)."""

    def handler(message: Message, context: Context) -> Message:
        if message.metadata.message_type == USER_KEY_MESSAGE_TYPE:
            return answer_user_key(message, context)
        server_round = int(message.content[CONFIG]["server-round"])
        received = arrays_to_state(message.content[ARRAYS])
        local = state_to_arrays(local_state(received, k, server_round))
        parts = ReplyParts({ARRAYS: local}, {NUM_EXAMPLES: 10.0 * (k + 1)})
        parts = compressed_parts(message, parts, NodeState(context), seed=k + server_round)
        return parts.message(message)

    return lambda message, context: compressed_download_mod(message, context, handler)


def run_round(strategy: FedAvg, grid: InProcessGrid, server_round: int, arrays: State):
    messages = list(
        strategy.configure_train(server_round, state_to_arrays(arrays), ConfigRecord(), grid)
    )
    replies = grid.send_and_receive(messages)
    aggregate, metrics = strategy.aggregate_train(server_round, replies)
    assert aggregate is not None and metrics is not None
    return messages, arrays_to_state(aggregate), metrics


def test_a_fedavg_round_reads_each_reply_as_the_exact_global_plus_the_nodes_update() -> None:
    """Three rounds: round 1 whole, then chains; every node's reference is the server's; the
    aggregate is T_t + the weighted mean of the updates the nodes computed from R_t (oracle
    computed apart); bytes down shrink over 4x for 4-bit codes (keys and scales aside, 8x)."""
    grid = InProcessGrid([downloading_node(k) for k in range(NODES)])
    strategy = FedAvg(min_available_nodes=NODES, compression=QUANTISE, sampling_seed=0)
    global_state, down, tapped = target(1), [], None
    residuals: list[State | None] = [None] * NODES  # what each node kept from its last upload
    for server_round in (1, 2, 3):
        messages, aggregate, metrics = run_round(strategy, grid, server_round, global_state)
        bases = {int(m.content[CONFIG][DOWNLOAD_BASE]) for m in messages}
        assert bases == ({0} if server_round == 1 else {server_round - 1})
        reference = strategy.downloads.chain.reference
        tapped = followed(tapped, messages)  # a simulation's audit follows the chain too
        assert tapped[0] == server_round
        assert all(torch.equal(tapped[1][key], reference[key]) for key in reference)
        oracle = {key: torch.zeros(v.shape, dtype=torch.float64) for key, v in global_state.items()}
        for k, context in enumerate(grid.contexts.values()):
            held = NodeState(context).tensors(DOWNLOAD_REFERENCE)
            assert NodeState(context).values(DOWNLOAD_HELD) == {"version": server_round}
            assert all(torch.equal(held[key], reference[key]) for key in reference)
            update = gap(local_state(reference, k, server_round), reference)
            generator = torch.Generator().manual_seed(k + server_round)
            record, _ = compress_with_feedback(update, residuals[k], QUANTISE, generator)
            shapes = {key: tuple(v.shape) for key, v in update.items()}
            restored = decompress(record, shapes, QUANTISE)
            for key in oracle:
                oracle[key] += 10.0 * (k + 1) * (global_state[key].double() + restored[key])
        residuals = [
            NodeState(context).tensors("compression-residual") for context in grid.contexts.values()
        ]
        for key in oracle:
            expected = (oracle[key] / 60.0).float()
            torch.testing.assert_close(aggregate[key], expected, atol=1e-6, rtol=1e-6)
        down.append(metrics[BYTES_DOWN])
        global_state = aggregate
    assert down[1] < down[0] / 4 and down[2] < down[0] / 4


def test_a_node_that_lost_its_reference_fails_once_then_gets_the_global_whole() -> None:
    grid = InProcessGrid([downloading_node(k) for k in range(NODES)])
    strategy = FedAvg(min_available_nodes=NODES, compression=QUANTISE, sampling_seed=0)
    _, global_state, _ = run_round(strategy, grid, 1, target(1))
    wiped = list(grid.contexts.values())[1]
    del wiped.state[DOWNLOAD_REFERENCE], wiped.state[DOWNLOAD_HELD]
    _, global_state, metrics = run_round(strategy, grid, 2, global_state)
    assert metrics[NUM_REPLIES] == 2 and metrics[NUM_FAILURES] == 1
    assert any(
        reply.has_error() and "cannot rebuild the global" in reply.error.reason
        for reply in grid.received
    )
    messages, _, metrics = run_round(strategy, grid, 3, global_state)
    bases = [int(m.content[CONFIG][DOWNLOAD_BASE]) for m in messages]
    assert sorted(bases) == [0, 2, 2] and metrics[NUM_REPLIES] == 3


def test_the_chain_and_the_held_versions_survive_a_resume(tmp_path: Path) -> None:
    """A strategy restored from round 2's checkpoint file (torch's weights-only load) sends
    round 3 exactly what the one that went on sends."""
    grid = InProcessGrid([downloading_node(k) for k in range(NODES)])
    strategy = FedAvg(min_available_nodes=NODES, compression=QUANTISE, sampling_seed=0)
    _, global_state, _ = run_round(strategy, grid, 1, target(1))
    _, global_state, _ = run_round(strategy, grid, 2, global_state)
    checkpoint = RoundCheckpoint.capture(2, state_to_arrays(global_state), strategy)
    save_round_checkpoint(tmp_path / "resume.pt", checkpoint)
    resumed = FedAvg(min_available_nodes=NODES, compression=QUANTISE, sampling_seed=0)
    load_round_checkpoint(tmp_path / "resume.pt").check(global_state, resumed)
    resumed.rounds_started = 0
    sent = []
    for each in (strategy, resumed):
        each.sampling_rng.seed(3)
        messages = list(
            each.configure_train(3, state_to_arrays(global_state), ConfigRecord(), grid)
        )
        sent.append({m.metadata.dst_node_id: m.content for m in messages})
    assert sent[0].keys() == sent[1].keys()
    for node, content in sent[0].items():
        other = sent[1][node]
        assert content[CONFIG][DOWNLOAD_VERSION] == other[CONFIG][DOWNLOAD_VERSION] == 3
        assert content[CONFIG][DOWNLOAD_BASE] == other[CONFIG][DOWNLOAD_BASE] == 2
        for name, array in content[ARRAYS].items():
            assert (array.numpy() == other[ARRAYS][name].numpy()).all(), name


def gradient_message(sender: DownloadSender, gradient: State) -> Message:
    """A DecentNeRF round-2 train message to a node that holds version 1: the chain and G
    compressed."""
    config = ConfigRecord({**compression_entries(QUANTISE), GRADIENT_COMPRESSED: True})
    content = RecordDict({CONFIG: config, GRADIENT: sender.gradient(2, gradient)})
    sent = sender.content(content, "user-0", state_to_arrays(sender.chain.reference))
    return Message(sent, dst_node_id=1, message_type="train")


def test_decentnerfs_summed_gradient_goes_down_compressed_and_the_node_reads_it_back() -> None:
    """G of a round goes down as 4-bit codes (under 1/7 of its float32 bytes), drawn from a
    stream of the server's seed apart from the chain's; the node's mod hands the handler
    exactly D(C(G)) beside the rebuilt global; a record the scheme could not have sent fails
    naming GRADIENT, and the node keeps the version it held."""
    sender = DownloadSender(QUANTISE, seed=5)
    sender.advance(1, state_to_arrays(target(1)))
    sender.hold(["user-0"])
    sender.advance(2, state_to_arrays(target(2)))
    generator = torch.Generator().manual_seed(9)
    gradient = {key: torch.randn(v.shape, generator=generator) for key, v in target(1).items()}
    record = sender.gradient(2, gradient)
    assert sum(array.numpy().nbytes for array in record.values()) < full_bytes(gradient) / 7
    shapes = {key: tuple(value.shape) for key, value in gradient.items()}
    expected = decompress(compress(gradient, QUANTISE, sender.generator(2, 1)), shapes, QUANTISE)
    chain_rounding = decompress(compress(gradient, QUANTISE, sender.generator(2)), shapes, QUANTISE)
    assert not torch.equal(expected["weight"], chain_rounding["weight"])
    round_one = ReferenceChain(QUANTISE)  # what the node rebuilt in round 1
    round_one.advance(1, target(1), sender.generator(1))
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    NodeState(context).put_tensors(DOWNLOAD_REFERENCE, dict(round_one.reference))
    NodeState(context).put_values(DOWNLOAD_HELD, {"version": 1})
    seen: dict[str, State] = {}

    def handler(message: Message, _: Context) -> Message:
        seen["global"] = arrays_to_state(message.content[ARRAYS])
        seen["gradient"] = arrays_to_state(message.content[GRADIENT])
        return Message(RecordDict(), reply_to=message)

    broken = gradient_message(sender, gradient)
    del broken.content[GRADIENT]["weight:scale"]
    with pytest.raises(ValueError, match="record 'gradient'.*lacks the entries"):
        compressed_download_mod(broken, context, handler)
    assert NodeState(context).values(DOWNLOAD_HELD) == {"version": 1}  # nothing half-written
    compressed_download_mod(gradient_message(sender, gradient), context, handler)
    for key in gradient:
        assert torch.equal(seen["gradient"][key], expected[key])
        assert torch.equal(seen["global"][key], sender.chain.reference[key])


def test_downloads_need_a_scheme_and_a_positive_history() -> None:
    with pytest.raises(ValueError, match="compression-download-history"):
        CompressionConfig("quantise", download=True, download_history=0)
    with pytest.raises(ValueError, match="compression-download must be true or false"):
        CompressionConfig("quantise", download="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("version", "base", "poison", "message"),
    [
        (3, 0, math.nan, "the rebuilt global of version 3 is not finite at 'w'"),
        (3, 0, math.inf, "the rebuilt global of version 3 is not finite at 'w'"),
        (2, 3, 0.0, "the download's version 2 is below its base 3"),
        (-1, 0, 0.0, "the download's version -1 is below its base 0"),
    ],
)
def test_a_node_refuses_a_download_it_must_not_train_from(
    version: int, base: int, poison: float, message: str
) -> None:
    """The node's download mod refuses, before its handler runs, a global that is not finite
    and a version below its base (a server sending either is broken or hostile)."""
    state = {"w": torch.ones(4)}
    state["w"][1] = poison
    config = ConfigRecord(
        {**compression_entries(QUANTISE), DOWNLOAD_VERSION: version, DOWNLOAD_BASE: base}
    )
    msg = Message(
        RecordDict({ARRAYS: state_to_arrays(state), CONFIG: config}), dst_node_id=1,
        message_type="train",
    )  # fmt: skip
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    ran: list[Message] = []
    with pytest.raises(ValueError, match=message):
        compressed_download_mod(msg, context, lambda m, c: ran.append(m) or m)
    assert ran == [] and DOWNLOAD_REFERENCE not in context.state
