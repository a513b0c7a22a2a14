"""Update compression without Flower: round trips, unbiasedness, error feedback, refusals, bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from fedfields.compression import (
    CompressionConfig,
    compress,
    compress_with_feedback,
    decompress,
    full_bytes,
    pack_codes,
    part,
    record_bytes,
    unpack_codes,
)


def update(seed: int = 0) -> dict[str, Tensor]:
    """A small model's update: a matrix, a conv-shaped tensor, a vector and a scalar."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(12, 10, generator=generator),
        "conv.weight": torch.randn(6, 2, 3, 3, generator=generator),
        "layer.bias": torch.randn(12, generator=generator),
        "scale": torch.randn((), generator=generator),
    }


def shapes_of(state: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}


def round_trip(state: dict[str, Tensor], config: CompressionConfig, seed: int = 0):
    record = compress(state, config, torch.Generator().manual_seed(seed))
    return record, decompress(record, shapes_of(state), config)


def test_config_refuses_bad_settings() -> None:
    for bad in ({"scheme": "zip"}, {"rank": 0}, {"bits": 3}, {"fraction": 0.0}, {"fraction": 2}):
        with pytest.raises(ValueError, match="compression"):
            CompressionConfig(**bad)
    assert not CompressionConfig().enabled and CompressionConfig("topk").enabled


@pytest.mark.parametrize(
    "config",
    [CompressionConfig("none"), CompressionConfig("topk", fraction=1.0)],
)
def test_lossless_settings_round_trip_exactly(config: CompressionConfig) -> None:
    state = update()
    _, restored = round_trip(state, config)
    for key, tensor in state.items():
        assert torch.equal(restored[key], tensor), key


def test_full_rank_lowrank_is_the_matrix_sent_whole_or_exact() -> None:
    """At full rank the factors save nothing, so each matrix goes whole (exact); a rank that
    saves bytes reproduces a matrix of that rank to float32 precision."""
    state = update()
    record, restored = round_trip(state, CompressionConfig("lowrank", rank=10))
    assert part("layer.weight", "whole") in record
    assert all(torch.equal(restored[key], state[key]) for key in state)
    generator = torch.Generator().manual_seed(1)
    rank_two = torch.randn(40, 2, generator=generator) @ torch.randn(2, 30, generator=generator)
    record, restored = round_trip({"w": rank_two}, CompressionConfig("lowrank", rank=2))
    assert record["w:u"].shape == (40, 2) and record["w:v"].shape == (2, 30)
    torch.testing.assert_close(restored["w"], rank_two, atol=1e-5, rtol=1e-5)


def test_lowrank_is_the_best_rank_r_approximation() -> None:
    """The error of a rank-r record is the tail of the singular values (Eckart-Young),
    computed here with numpy's SVD."""
    matrix = update()["layer.weight"].repeat(4, 4)  # 48 x 40
    _, restored = round_trip({"w": matrix}, CompressionConfig("lowrank", rank=3))
    singular = np.linalg.svd(matrix.double().numpy(), compute_uv=False)
    error = float(torch.linalg.norm(restored["w"].double() - matrix.double()))
    assert error == pytest.approx(float(np.sqrt((singular[3:] ** 2).sum())), rel=1e-4)


def test_conv_tensor_is_factored_as_rows_by_the_rest() -> None:
    state = {"conv": update()["conv.weight"]}  # 6 x 18, rank 1 saves bytes
    record, restored = round_trip(state, CompressionConfig("lowrank", rank=1))
    assert record["conv:u"].shape == (6, 1) and record["conv:v"].shape == (1, 18)
    assert restored["conv"].shape == (6, 2, 3, 3)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_pack_and_unpack(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=37).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.size == int(np.ceil(37 * bits / 8))
    assert np.array_equal(unpack_codes(packed, bits, 37), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantise_decodes_onto_the_grid_within_one_step(bits: int) -> None:
    state = update()
    _, restored = round_trip(state, CompressionConfig("quantise", bits=bits))
    for key, tensor in state.items():
        scale = float(tensor.abs().max())
        step = 2 * scale / (2**bits - 1)
        assert float((restored[key] - tensor).abs().max()) <= step * (1 + 1e-5), key
        grid = (restored[key].double() + scale) / step
        assert torch.allclose(grid, grid.round(), atol=1e-3), key


@pytest.mark.parametrize("bits", [4, 2])
def test_quantise_is_unbiased_in_expectation(bits: int) -> None:
    """The mean of many seeded draws approaches x: each decoded entry is x plus a zero-mean
    error bounded by one step, so over N draws its mean error has std <= step / (2 sqrt N);
    six such stds bound every entry."""
    tensor = update()["layer.weight"]
    config = CompressionConfig("quantise", bits=bits)
    draws = 2000
    generator = torch.Generator().manual_seed(7)
    total = torch.zeros_like(tensor, dtype=torch.float64)
    for _ in range(draws):
        record = compress({"w": tensor}, config, generator)
        total += decompress(record, {"w": tuple(tensor.shape)}, config)["w"].double()
    step = 2 * float(tensor.abs().max()) / (2**bits - 1)
    bound = 6 * step / (2 * np.sqrt(draws))
    assert float((total / draws - tensor.double()).abs().max()) < bound
    # a deterministic rounding would be biased: its mean error stays near step / 4 on average
    assert float((total / draws - tensor.double()).abs().mean()) < step / 20


def test_topk_keeps_the_largest_entries() -> None:
    tensor = torch.tensor([[0.1, -5.0, 0.3], [2.0, -0.2, 0.0]])
    record, restored = round_trip({"w": tensor}, CompressionConfig("topk", fraction=0.3))
    assert record["w:indices"].tolist() == [1, 3]
    assert torch.equal(restored["w"], torch.tensor([[0.0, -5.0, 0.0], [2.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "config",
    [
        CompressionConfig("lowrank", rank=2),
        CompressionConfig("quantise", bits=2),
        CompressionConfig("topk", fraction=0.1),
    ],
)
def test_error_feedback_carries_the_residual_across_rounds(config: CompressionConfig) -> None:
    """Each round sends update + residual and keeps what was lost, so after R rounds the sum
    of what was sent plus the last residual is exactly the sum of the updates; and the
    residual saved as tensors and read back (a resume) continues the same sequence."""
    generator = torch.Generator().manual_seed(3)
    updates = [update(seed) for seed in range(4)]
    residual: dict[str, Tensor] | None = None
    sent_total = {key: torch.zeros_like(value) for key, value in updates[0].items()}
    residuals = []
    for step in updates:
        record, residual = compress_with_feedback(step, residual, config, generator)
        sent = decompress(record, shapes_of(step), config)
        sent_total = {key: sent_total[key] + sent[key] for key in sent_total}
        residuals.append(residual)
    assert any(float(value.abs().max()) > 0 for value in residuals[0].values())
    for key in sent_total:
        expected = sum(step[key] for step in updates)
        torch.testing.assert_close(sent_total[key] + residual[key], expected, atol=1e-4, rtol=0)
    # a resume: the residual after round 2, saved and loaded, gives round 3's record again
    saved = {key: value.clone().numpy() for key, value in residuals[1].items()}
    restored = {key: torch.from_numpy(value) for key, value in saved.items()}
    again, _ = compress_with_feedback(
        updates[2], restored, config, torch.Generator().manual_seed(11)
    )
    first, _ = compress_with_feedback(
        updates[2], residuals[1], config, torch.Generator().manual_seed(11)
    )
    assert all(np.array_equal(again[name], first[name]) for name in first)


def test_feedback_refuses_a_residual_of_another_shape() -> None:
    with pytest.raises(ValueError, match="another model"):
        compress_with_feedback(
            {"w": torch.ones(3)},
            {"w": torch.ones(4)},
            CompressionConfig("topk"),
            torch.Generator(),
        )


def malformed(config: CompressionConfig, change) -> tuple[dict, dict, CompressionConfig]:
    state = {"w": torch.randn(16, 12, generator=torch.Generator().manual_seed(5))}
    record = compress(state, config, torch.Generator().manual_seed(0))
    change(record)
    return record, shapes_of(state), config


def _set(name: str, value: np.ndarray):
    return lambda record: record.__setitem__(name, value)


MALFORMED = {
    "wrong rank": (
        CompressionConfig("lowrank", rank=2),
        _set("w:u", np.ones((16, 3), np.float32)),
        "rank 3, expected rank 2",
    ),
    "wrong factor shape": (
        CompressionConfig("lowrank", rank=2),
        _set("w:v", np.ones((2, 11), np.float32)),
        "expected \\(2, 12\\)",
    ),
    "missing factor": (CompressionConfig("lowrank", rank=2), lambda r: r.pop("w:v"), "lacks"),
    "extra entry": (
        CompressionConfig("topk"),
        _set("x:values", np.ones(1, np.float32)),
        "unexpected entries",
    ),
    "scale not finite": (
        CompressionConfig("quantise", bits=4),
        _set("w:scale", np.array([np.inf], np.float32)),
        "scale is not a finite",
    ),
    "negative scale": (
        CompressionConfig("quantise", bits=4),
        _set("w:scale", np.array([-1.0], np.float32)),
        "scale is not a finite",
    ),
    "bit width not asked": (
        CompressionConfig("quantise", bits=4),
        _set("w:bits", np.array([8], np.uint8)),
        "bit width \\[8\\], expected 4",
    ),
    "codes cut short": (
        CompressionConfig("quantise", bits=4),
        _set("w:codes", np.zeros(10, np.uint8)),
        "take 96 uint8 bytes",
    ),
    "index out of range": (
        CompressionConfig("topk", fraction=0.1),
        lambda r: r["w:indices"].__setitem__(0, 192),
        "out of range",
    ),
    "negative index": (
        CompressionConfig("topk", fraction=0.1),
        lambda r: r["w:indices"].__setitem__(0, -1),
        "out of range",
    ),
    "repeated index": (
        CompressionConfig("topk", fraction=0.1),
        lambda r: r["w:indices"].__setitem__(1, r["w:indices"][0]),
        "repeated",
    ),
    "too many indices": (
        CompressionConfig("topk", fraction=0.1),
        _set("w:indices", np.arange(30)),
        "sends 20 integer indices",
    ),
    "float indices": (
        CompressionConfig("topk", fraction=0.1),
        _set("w:indices", np.arange(20, dtype=np.float32)),
        "integer indices",
    ),
    "non-finite values": (
        CompressionConfig("topk", fraction=0.1),
        lambda r: r["w:values"].__setitem__(0, np.nan),
        "NaN or infinite",
    ),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_every_malformed_kind_is_refused_with_its_reason(kind: str) -> None:
    config, change, reason = MALFORMED[kind]
    record, shapes, config = malformed(config, change)
    with pytest.raises(ValueError, match=reason):
        decompress(record, shapes, config)


def test_bytes_accounting() -> None:
    """Each scheme's record against the float32 state, counted from the shapes by hand."""
    state = {"w": torch.randn(64, 48), "b": torch.randn(64)}
    full = full_bytes(state)
    assert full == 4 * (64 * 48 + 64)
    lowrank, _ = round_trip(state, CompressionConfig("lowrank", rank=4))
    assert record_bytes(lowrank) == 4 * (64 * 4 + 4 * 48 + 64)
    quantised, _ = round_trip(state, CompressionConfig("quantise", bits=2))
    assert record_bytes(quantised) == (64 * 48 + 64) // 4 + 2 * (4 + 1)
    sparse, _ = round_trip(state, CompressionConfig("topk", fraction=0.05))
    kept = int(np.ceil(0.05 * 64 * 48)) + int(np.ceil(0.05 * 64))
    assert record_bytes(sparse) == kept * (8 + 4)
    assert full / record_bytes(quantised) > 15
