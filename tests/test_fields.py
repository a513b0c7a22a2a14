"""Encodings and fields against naive references, formulas and the behaviour each is for."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from skimage import data
from torch import Tensor

from fedfields.fields import (
    FIELD_KINDS,
    Field,
    GlobalPersonalField,
    HashGridConfig,
    HashGridEncoding,
    HashGridField,
    HashGridFieldConfig,
    NeRFField,
    NeRFFieldConfig,
    PersonalField,
    PersonalFieldConfig,
    Siren,
    SirenConfig,
    SirenField,
    SplatField,
    SplatFieldConfig,
    build_field,
    encodings,
    tcnn_available,
)
from fedfields.fields.base import mlp
from fedfields.fields.encodings import (
    PositionalEncoding,
    SphericalHarmonicsEncoding,
    _EmbeddingBagSum,
    resolve_implementation,
)

# Levels of resolution 3, 5, 10, 20: (r+1)^3 = 64 and 216 fit a 2^9 table (dense), 1331 and
# 9261 do not (hashed); the per-level scale (20/3)^(1/3) is not an integer.
SMALL_GRID = HashGridConfig(
    num_levels=4,
    features_per_level=2,
    log2_hashmap_size=9,
    base_resolution=3,
    max_resolution=20,
    implementation="torch",
)
PRIMES = (1, 2654435761, 805459861)


def _naive_hash_grid(points: Tensor, table: Tensor, config: HashGridConfig) -> Tensor:
    """Instant-NGP encoding one point, level and corner at a time (Muller et al. 2022, Eq. 4).

    Mirrors the module's conventions: points clamped to [0, 1], scaled by the level resolution
    r, lower corner floor(x r) clamped to r - 1 (so x = 1 interpolates inside the last cell),
    levels stored one after another in the table.
    """
    table_size = 2**config.log2_hashmap_size
    rows = []
    for point in points.clamp(0.0, 1.0):
        features, offset = [], 0
        for r in config.resolutions():
            dense = (r + 1) ** 3 <= table_size
            scaled = (point * r).tolist()  # float32 product, as the module computes it
            lower = [min(math.floor(s), r - 1) for s in scaled]
            frac = [s - low for s, low in zip(scaled, lower, strict=True)]
            level = torch.zeros(config.features_per_level, dtype=table.dtype)
            for corner in itertools.product((0, 1), repeat=3):
                x, y, z = (low + c for low, c in zip(lower, corner, strict=True))
                if dense:
                    index = x + y * (r + 1) + z * (r + 1) ** 2
                else:
                    index = (x * PRIMES[0] ^ y * PRIMES[1] ^ z * PRIMES[2]) % table_size
                weight = math.prod(f if c else 1.0 - f for f, c in zip(frac, corner, strict=True))
                level = level + weight * table[offset + index]
            features.append(level)
            offset += (r + 1) ** 3 if dense else table_size
        rows.append(torch.cat(features))
    return torch.stack(rows)


def _grid_points() -> Tensor:
    """Random points (some outside the unit cube), the cube's corners and grid-aligned points."""
    generator = torch.Generator().manual_seed(0)
    random = torch.rand(24, 3, generator=generator) * 1.2 - 0.1
    special = torch.tensor(
        [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.5], [1.0, 0.0, 0.3], [0.2, 0.4, 0.6]]
    )
    return torch.cat([random, special])


def test_hash_grid_levels_are_dense_then_hashed() -> None:
    encoding = HashGridEncoding(SMALL_GRID)
    assert SMALL_GRID.resolutions() == [3, 5, 10, 20]
    assert encoding.num_dense_levels == 2
    assert encoding.table.shape == (4**3 + 6**3 + 2 * 2**9, 2)
    assert encoding.out_dim == 8


def test_hash_grid_matches_naive_loop_in_values_and_table_gradients() -> None:
    torch.manual_seed(0)
    encoding = HashGridEncoding(SMALL_GRID)
    with torch.no_grad():
        encoding.table.normal_()
    points = _grid_points()
    features = encoding(points)
    reference = _naive_hash_grid(points, encoding.table, SMALL_GRID)
    torch.testing.assert_close(features, reference, atol=1e-5, rtol=1e-5)

    cotangent = torch.randn_like(features)
    (grad,) = torch.autograd.grad((features * cotangent).sum(), encoding.table)
    (grad_reference,) = torch.autograd.grad((reference * cotangent).sum(), encoding.table)
    torch.testing.assert_close(grad, grad_reference, atol=1e-5, rtol=1e-5)
    # Every level's rows are touched (each level contributes to the output).
    assert grad.abs().sum() > 0


def test_hash_grid_finest_level_reaches_max_resolution() -> None:
    for base, finest, levels in [(16, 2048, 16), (16, 1024, 16), (16, 4096, 16), (16, 512, 8)]:
        config = HashGridConfig(num_levels=levels, base_resolution=base, max_resolution=finest)
        assert config.resolutions()[0] == base
        assert config.resolutions()[-1] == finest, config.resolutions()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_hash_grid_runs_on_cuda_like_on_cpu() -> None:
    torch.manual_seed(0)
    encoding = HashGridEncoding(SMALL_GRID)
    points = _grid_points()
    expected = encoding(points)
    torch.testing.assert_close(encoding.cuda()(points.cuda()).cpu(), expected)


# ------------------------------------------------------------------ tinycudann backend


@pytest.mark.skipif(not tcnn_available(), reason="tinycudann and a CUDA device are not available")
def test_tcnn_hash_grid_has_the_same_configuration() -> None:
    config = HashGridConfig(
        num_levels=8,
        features_per_level=2,
        log2_hashmap_size=15,
        base_resolution=16,
        max_resolution=512,
        implementation="tcnn",
    )
    encoding = HashGridEncoding(config)
    assert encoding.implementation == "tcnn"
    points = torch.rand(100, 3, device="cuda")
    features = encoding(points)
    assert features.shape == (100, 16) and features.dtype == torch.float32
    assert encoding.tcnn_encoding.n_output_dims == encoding.out_dim
    settings = encoding.tcnn_encoding.encoding_config
    assert settings["n_levels"] == 8 and settings["n_features_per_level"] == 2
    assert settings["log2_hashmap_size"] == 15 and settings["base_resolution"] == 16
    assert settings["per_level_scale"] == pytest.approx(32 ** (1 / 7))


def test_tcnn_without_tinycudann_raises_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encodings, "tcnn_available", lambda: False)
    with pytest.raises(RuntimeError, match="tinycudann.*CUDA.*implementation='torch'"):
        HashGridEncoding(HashGridConfig(implementation="tcnn"))


def test_auto_implementation_picks_triton_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encodings, "tcnn_available", lambda: True)
    monkeypatch.setattr(encodings, "triton_available", lambda: True)
    launch_checked = {torch.device("cuda", 0): True}  # as if the one-off launch had passed
    monkeypatch.setattr(encodings, "_TRITON_WORKS", launch_checked)
    auto = HashGridConfig(implementation="auto")
    assert resolve_implementation(auto, "cuda") == "triton"
    assert resolve_implementation(auto, "cpu") == "torch"  # never tcnn: other weights
    assert resolve_implementation(HashGridConfig(implementation="torch"), "cuda") == "torch"
    monkeypatch.setattr(encodings, "triton_available", lambda: False)
    assert resolve_implementation(auto, "cuda") == "torch"


def test_triton_where_it_cannot_run_raises_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="'triton' cannot run on cpu.*CUDA tensors"):
        resolve_implementation(HashGridConfig(implementation="triton"), "cpu")
    if not torch.cuda.is_available():  # a CPU machine refuses when the grid is built
        with pytest.raises(RuntimeError, match="'triton' cannot run on cpu"):
            HashGridEncoding(HashGridConfig(implementation="triton"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present here")
def test_auto_builds_the_torch_grid_here() -> None:
    config = HashGridConfig(num_levels=2, log2_hashmap_size=8, base_resolution=2, max_resolution=4)
    assert config.implementation == "auto"
    assert resolve_implementation(config, HashGridEncoding(config).table.device) == "torch"


# ------------------------------------------------------------------ positional / SH encodings


@pytest.mark.parametrize("include_input", [True, False])
def test_positional_encoding_formula(include_input: bool) -> None:
    encoding = PositionalEncoding(3, 4, include_input=include_input)
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    parts = [x] if include_input else []
    parts += [torch.sin(2.0**k * x) for k in range(4)]
    parts += [torch.cos(2.0**k * x) for k in range(4)]
    expected = torch.cat(parts, dim=-1)
    assert encoding.out_dim == 3 * (8 + int(include_input)) == expected.shape[-1]
    torch.testing.assert_close(encoding(x), expected)


def _unit_directions(num: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(
        torch.randn(num, 3, generator=generator, dtype=torch.float64), dim=-1
    )


def test_spherical_harmonics_are_orthonormal() -> None:
    """4 pi E[Y_i Y_j] over uniform directions is the identity. With 200k samples the Monte
    Carlo standard error of every entry, std(4 pi Y_i Y_j) / sqrt(n), is at most 0.0031
    (measured over these 16 terms), so 0.02 is over 6 standard errors."""
    directions = _unit_directions(200_000, seed=0)
    values = SphericalHarmonicsEncoding()(directions)
    gram = 4 * math.pi * values.T @ values / len(directions)
    torch.testing.assert_close(gram, torch.eye(16, dtype=torch.float64), atol=0.02, rtol=0)


def test_spherical_harmonics_addition_theorem() -> None:
    """Each band l (terms l^2 .. (l+1)^2 - 1) satisfies sum_m Y_lm(d)^2 = (2l + 1) / (4 pi) at
    every direction, which pins the band structure that orthonormality alone does not."""
    values = SphericalHarmonicsEncoding()(_unit_directions(1000, seed=1))
    for degree in range(4):
        band = values[:, degree**2 : (degree + 1) ** 2]
        expected = torch.full((1000,), (2 * degree + 1) / (4 * math.pi), dtype=torch.float64)
        torch.testing.assert_close((band**2).sum(-1), expected)


# ------------------------------------------------------------------ fields

SMALL_FIELD_GRID = HashGridConfig(
    num_levels=4, log2_hashmap_size=10, base_resolution=4, max_resolution=32, implementation="torch"
)


def _small_fields() -> dict[str, Field]:
    torch.manual_seed(0)
    return {
        "hashgrid": HashGridField(
            HashGridFieldConfig(
                encoding=SMALL_FIELD_GRID,
                geometry_features=7,
                density_hidden=16,
                color_hidden=16,
                color_layers=1,
                aabb=(-2.0, -1.5, -1.5, 2.0, 1.5, 1.5),
            )
        ),
        "nerf": NeRFField(
            NeRFFieldConfig(
                depth=3,
                width=32,
                skips=(1,),
                position_frequencies=4,
                direction_frequencies=2,
                color_width=16,
            )
        ),
        "nerf-view-independent": NeRFField(
            NeRFFieldConfig(
                depth=2, width=16, skips=(), position_frequencies=3, view_dependent=False
            )
        ),
        "siren": SirenField(SirenConfig(in_features=3, out_features=4, width=32, depth=2)),
        "splats": SplatField(SplatFieldConfig(count=32, sh_degree=1, initial_scale=0.2)),
    }


def _field_inputs(num: int = 64) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    points = torch.rand(num, 3, generator=generator) * 3 - 1.5
    directions = torch.nn.functional.normalize(torch.randn(num, 3, generator=generator), dim=-1)
    return points, directions


@pytest.mark.parametrize("name", list(_small_fields()))
@pytest.mark.parametrize("through_json", [False, True])
def test_build_field_round_trips(name: str, through_json: bool) -> None:
    field = _small_fields()[name]
    config = field.config_dict()
    if through_json:  # lists instead of tuples, as any JSON-stored config comes back
        config = json.loads(json.dumps(config))
    torch.manual_seed(123)  # the rebuilt field starts from different weights
    rebuilt = build_field(config)
    assert type(rebuilt) is type(field) and rebuilt.config == field.config
    rebuilt.load_state_dict(field.state_dict())
    points, directions = _field_inputs()
    expected, got = field(points, directions), rebuilt(points, directions)
    torch.testing.assert_close(got.density, expected.density, rtol=0, atol=0)
    torch.testing.assert_close(got.rgb, expected.rgb, rtol=0, atol=0)


def test_every_field_kind_is_registered_and_takes_image_indices() -> None:
    """The registry rebuilds every field the library has; every field takes the images'
    indices through the declared `forward` (ignored without per-image appearance)."""
    personal = PersonalField(PersonalFieldConfig(num_images=3, hidden=8))
    composite = GlobalPersonalField(_small_fields()["siren"], personal)
    fields = [*_small_fields().values(), personal, composite]
    assert {type(field).kind for field in fields} == set(FIELD_KINDS)
    points, directions = _field_inputs(16)
    images = torch.arange(16) % 3
    for field in fields:
        assert type(build_field(field.config_dict())) is type(field)
        seen = field(points, directions, images)
        if type(field) in (PersonalField, GlobalPersonalField):  # per-image appearance
            assert not torch.equal(seen.rgb, field(points, directions).rgb)
        else:
            torch.testing.assert_close(seen.rgb, field(points, directions).rgb, rtol=0, atol=0)


@pytest.mark.parametrize("config", [{"kind": "voxels"}, {"width": 3}])
def test_build_field_rejects_unknown_kinds(config: dict) -> None:
    with pytest.raises(ValueError, match="unknown field kind"):
        build_field(config)


def test_siren_field_rejects_wrong_shapes() -> None:
    with pytest.raises(ValueError, match="in_features=3 and out_features=4"):
        SirenField(SirenConfig(in_features=2, out_features=3))


@pytest.mark.parametrize("name", list(_small_fields()))
def test_field_interface_and_gradients(name: str) -> None:
    field = _small_fields()[name]
    points, directions = _field_inputs()
    density = field.density(points)
    assert density.shape == (64,) and (density >= 0).all()
    outputs = field(points, directions)
    assert outputs.density.shape == (64,) and outputs.rgb.shape == (64, 3)
    assert (outputs.rgb >= 0).all() and (outputs.rgb <= 1).all()
    torch.testing.assert_close(outputs.density, density)
    # A loss of the outputs reaches every parameter.
    loss = (outputs.density * torch.linspace(0.5, 1.5, 64)).sum() + outputs.rgb.square().sum()
    parameters = dict(field.named_parameters())
    grads = torch.autograd.grad(loss, list(parameters.values()), allow_unused=True)
    for (parameter_name, parameter), grad in zip(parameters.items(), grads, strict=True):
        assert grad is not None, f"no gradient reaches {parameter_name}"
        assert grad.shape == parameter.shape and torch.isfinite(grad).all()
    assert sum(float(grad.abs().sum()) for grad in grads) > 0


def test_hash_grid_field_density_uses_the_scene_box() -> None:
    """Points are normalised by the field's aabb: moving points and box together changes nothing."""
    field = _small_fields()["hashgrid"]
    config = field.config
    shifted = HashGridField(
        HashGridFieldConfig(
            encoding=config.encoding,
            geometry_features=7,
            density_hidden=16,
            color_hidden=16,
            color_layers=1,
            aabb=tuple(v + 0.75 for v in config.aabb),
        )
    )
    shifted.load_state_dict(
        {k: v for k, v in field.state_dict().items() if k != "aabb"}, strict=False
    )
    points, _ = _field_inputs()
    torch.testing.assert_close(shifted.density(points + 0.75), field.density(points))


# ------------------------------------------------------------------ SIREN


def _camera_image(size: int = 32) -> Tensor:
    """skimage's 512 x 512 'camera' box-averaged to size x size, in [0, 1]."""
    image = data.camera().astype(np.float64) / 255.0
    block = image.shape[0] // size
    return torch.tensor(image.reshape(size, block, size, block).mean((1, 3)), dtype=torch.float32)


def _fit_psnr(network: torch.nn.Module, steps: int) -> float:
    image = _camera_image()
    axis = torch.linspace(-1.0, 1.0, image.shape[0])
    coords = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), dim=-1).reshape(-1, 2)
    target = image.reshape(-1, 1)
    optimiser = torch.optim.Adam(network.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = (network(coords) - target).square().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        mse = (network(coords) - target).square().mean().item()
    return 10.0 * math.log10(1.0 / mse)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train on one intra-op thread: fastest for 1024 x 64 matrices, and a busy CPU's thread
    contention otherwise slows this test from about 1 s to a minute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_siren_fits_an_image_where_a_relu_mlp_of_the_same_size_cannot(one_thread: None) -> None:
    torch.manual_seed(0)
    siren = Siren(SirenConfig(in_features=2, out_features=1, width=64, depth=3))
    assert _fit_psnr(siren, steps=150) > 30.0
    torch.manual_seed(0)
    relu = mlp(2, 64, 3, 1)
    assert _fit_psnr(relu, steps=150) < 25.0  # spectral bias: the reason SIREN exists


def test_siren_initialisation_bounds() -> None:
    torch.manual_seed(0)
    siren = Siren(SirenConfig(in_features=3, out_features=2, width=256, depth=3, w0=30.0))
    first = siren.hidden[0].linear.weight
    bound = 1.0 / 3
    assert first.abs().max() <= bound and first.abs().max() > 0.95 * bound
    for layer in [*siren.hidden[1:], siren]:
        weight = layer.output.weight if layer is siren else layer.linear.weight
        bound = math.sqrt(6.0 / 256) / 30.0
        assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
        # Uniform on [-b, b] has standard deviation b / sqrt(3).
        assert weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)


def test_the_torch_grids_backward_is_cuda_s_index_add_bit_for_bit() -> None:
    """The CPU backward (a weighted bincount per feature, the fast one there) gives exactly
    what the CUDA path's index_add_ (no host read, capturable) gives on the same tensors, so
    seeded CPU runs keep their figures whichever op adds; computed here with index_add_."""
    generator = torch.Generator().manual_seed(5)
    rows, width = 3000, 2
    indices = torch.randint(0, rows, (20_000, 8), generator=generator)
    weights = torch.rand(20_000, 8, generator=generator)
    table = torch.randn(rows, width, generator=generator, requires_grad=True)
    grad_output = torch.randn(20_000, width, generator=generator)
    _EmbeddingBagSum.apply(table, indices, weights).backward(grad_output)
    contributions = (weights[:, :, None] * grad_output[:, None, :]).reshape(-1, width)
    expected = torch.zeros(rows, width).index_add_(0, indices.reshape(-1), contributions)
    assert torch.equal(table.grad, expected)
