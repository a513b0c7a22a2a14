"""SplitNeRF: the split computes what the unsplit field computes; S2NeRF and NoisyLabel noise."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedfields.data import load_scene
from fedfields.fields import HashGridConfig, HashGridField, HashGridFieldConfig
from fedfields.geometry import Rays
from fedfields.metrics.image import psnr
from fedfields.privacy.defences import NoisyLabel, S2NeRFNoise
from fedfields.privacy.split import (
    SplitTrainConfig,
    client_step,
    sample_rays,
    server_backward,
    server_forward,
    split_field,
    train_split,
)
from fedfields.render import RenderConfig, render_image, render_rays

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
RENDER = RenderConfig(num_samples=16)
TINY_GRID = HashGridConfig(
    num_levels=4, log2_hashmap_size=10, base_resolution=4, max_resolution=32, implementation="torch"
)


def _field(seed: int = 0) -> HashGridField:
    """A tiny hash-grid field with table entries large enough to give non-trivial gradients."""
    torch.manual_seed(seed)
    field = HashGridField(HashGridFieldConfig(encoding=TINY_GRID, density_hidden=16))
    with torch.no_grad():
        field.encoding.table.uniform_(-1.0, 1.0)
    return field


def _rays(count: int, seed: int = 0) -> Rays:
    """Rays from random points on a sphere of radius 4 towards jittered points near the origin."""
    generator = torch.Generator().manual_seed(seed)
    origins = F.normalize(torch.randn(count, 3, generator=generator), dim=-1) * 4.0
    targets = 0.5 * torch.randn(count, 3, generator=generator)
    return Rays(origins, F.normalize(targets - origins, dim=-1))


# ------------------------------------------------------------------ the split itself


def test_split_parts_partition_the_fields_parameters() -> None:
    field = _field()
    server, client = split_field(field)
    server_ids = {id(p) for p in server.parameters()}
    client_ids = {id(p) for p in client.parameters()}
    assert not server_ids & client_ids
    assert server_ids | client_ids == {id(p) for p in field.parameters()}
    assert id(field.encoding.table) in server_ids
    assert server.embedding_dim == 16  # the first density layer's width


@pytest.mark.parametrize("cut_layer", [1, 0])
def test_split_loss_and_gradients_equal_the_unsplit_fields(cut_layer: int) -> None:
    unsplit, joint = _field(), _field()
    joint.load_state_dict(unsplit.state_dict())
    rays = _rays(48)
    targets = torch.rand(48, 3, generator=torch.Generator().manual_seed(1))
    background = torch.rand(48, 3, generator=torch.Generator().manual_seed(2))

    torch.manual_seed(3)  # the same jittered bins in both runs
    rendered, _ = render_rays(unsplit, rays, RENDER, perturb=True, background=background)
    loss = F.mse_loss(rendered.rgb, targets)
    loss.backward()

    server, client = split_field(joint, cut_layer)
    torch.manual_seed(3)
    samples = sample_rays(rays, RENDER, perturb=True)
    points = samples.points()
    embeddings = server_forward(server, points)
    assert not embeddings.requires_grad
    reply = client_step(client, embeddings, samples, targets, background)
    server_backward(server, points, reply.embedding_gradient)

    assert reply.loss == pytest.approx(loss.item(), rel=1e-6)
    assert reply.psnr == pytest.approx(-10 * math.log10(loss.item()), rel=1e-6)
    assert reply.embedding_gradient.shape == (48 * RENDER.num_samples, server.embedding_dim)
    expected = dict(unsplit.named_parameters())
    for name, parameter in joint.named_parameters():
        assert expected[name].grad is not None and parameter.grad is not None, name
        assert expected[name].grad.abs().max() > 0, name
        torch.testing.assert_close(parameter.grad, expected[name].grad, rtol=1e-5, atol=1e-9)


def test_cut_layer_that_would_put_density_on_the_server_is_refused() -> None:
    with pytest.raises(ValueError, match="cut_layer"):
        split_field(_field(), cut_layer=2)


def test_importance_sampling_is_refused() -> None:
    config = RenderConfig(num_samples=8, num_importance=8)
    with pytest.raises(ValueError, match="num_importance"):
        sample_rays(_rays(4), config, perturb=False)


# ------------------------------------------------------------------ S2NeRF noise


def _gradient() -> torch.Tensor:
    """[8192, 16] rows of varied norms; the largest row norm is exactly 5."""
    generator = torch.Generator().manual_seed(7)
    gradient = torch.randn(8192, 16, generator=generator) * 0.01
    gradient[123] = 0.0
    gradient[123, :2] = torch.tensor([3.0, 4.0])
    return gradient


def _noise_stats(defence: S2NeRFNoise, gradient: torch.Tensor, step: int) -> tuple[float, float]:
    """Empirical (mean, std) of the noise added at `step`, over all 131072 entries."""
    noise = (defence.perturb_gradient(gradient, step) - gradient).double()
    return noise.mean().item(), noise.std().item()


def test_s2nerf_noise_has_the_configured_scale_at_steps_0_and_T() -> None:
    c, r, total = 1.2, 1e-2, 100
    defence = S2NeRFNoise(c=c, r=r, total_steps=total, seed=0)
    gradient = _gradient()
    # 131072 draws: the std's relative standard error is ~0.2%, the mean's ~0.3% of the std.
    for step, expected in [(0, c * 5.0), (total, c * 5.0 * r), (total // 2, c * 5.0 * r**0.5)]:
        mean, std = _noise_stats(defence, gradient, step)
        assert std == pytest.approx(expected, rel=0.02), step
        assert abs(mean) < 0.02 * expected, step
        assert defence.sigma(gradient, step).item() == pytest.approx(expected, rel=1e-6)


def test_s2nerf_without_decay_keeps_its_scale() -> None:
    defence = S2NeRFNoise(c=0.6, r=1.0, total_steps=10, seed=1)
    gradient = _gradient()
    for step in (0, 5, 10):
        _, std = _noise_stats(defence, gradient, step)
        assert std == pytest.approx(0.6 * 5.0, rel=0.02)


def test_s2nerf_noise_repeats_with_its_seed() -> None:
    gradient = _gradient()[:64]
    first = S2NeRFNoise(total_steps=10, seed=4).perturb_gradient(gradient, 3)
    again = S2NeRFNoise(total_steps=10, seed=4).perturb_gradient(gradient, 3)
    other = S2NeRFNoise(total_steps=10, seed=5).perturb_gradient(gradient, 3)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_s2nerf_noise_is_fresh_every_step_even_from_a_rebuilt_defence() -> None:
    """A Flower client builds its defence anew for every step: the noise must still differ
    from step to step, so averaging many steps' gradients cannot recover one fixed pattern."""
    gradient = _gradient()[:256]  # holds the row of norm 5: sigma = c * 5

    def noise(step: int) -> torch.Tensor:
        defence = S2NeRFNoise(c=1.0, r=1.0, total_steps=100, seed=3)
        return defence.perturb_gradient(gradient, step) - gradient

    assert not torch.allclose(noise(1), noise(2))
    assert torch.equal(noise(7), noise(7))  # (seed, step) reproduces
    steps = torch.stack([noise(step) for step in range(100)]).double()
    assert steps[0].std().item() == pytest.approx(5.0, rel=0.05)
    # the mean of 100 independent draws has std 5 / sqrt(100) = 0.5; one pattern would keep 5
    assert steps.mean(dim=0).std().item() < 0.2 * 5.0


def test_noisy_label_noise_differs_across_steps_and_repeats_per_step() -> None:
    targets = torch.full((256, 3), 0.5)
    first, second = (NoisyLabel(0.1, seed=2).perturb_targets(targets, step) for step in (0, 1))
    assert not torch.allclose(first, second)
    assert torch.equal(first, NoisyLabel(0.1, seed=2).perturb_targets(targets, 0))


def test_client_step_returns_the_s2nerf_noised_gradient_of_the_clean_loss() -> None:
    server, client = split_field(_field())
    rays = _rays(16)
    samples = sample_rays(rays, RENDER, perturb=False)
    embeddings = server_forward(server, samples.points())
    targets, background = torch.full((16, 3), 0.3), torch.ones(3)
    clean = client_step(client, embeddings, samples, targets, background)
    noised = client_step(
        client, embeddings, samples, targets, background, S2NeRFNoise(total_steps=4), step=2
    )
    expected = S2NeRFNoise(total_steps=4).perturb_gradient(clean.embedding_gradient, 2)
    assert noised.loss == clean.loss
    torch.testing.assert_close(noised.embedding_gradient, expected)


# ------------------------------------------------------------------ NoisyLabel


def test_noisy_label_adds_the_configured_noise_to_targets_only() -> None:
    defence = NoisyLabel(2.0, seed=0)
    targets = torch.rand(40000, 3, generator=torch.Generator().manual_seed(0))
    noise = (defence.perturb_targets(targets, step=0) - targets).double()
    assert noise.std().item() == pytest.approx(2.0, rel=0.02)
    assert abs(noise.mean().item()) < 0.04
    gradient = torch.randn(10, 16)
    assert defence.perturb_gradient(gradient, step=0) is gradient


def test_noisy_label_in_a_client_step_changes_only_the_targets() -> None:
    server, client = split_field(_field())
    samples = sample_rays(_rays(16), RENDER, perturb=False)
    points = samples.points()
    embeddings = server_forward(server, points)
    targets, background = torch.full((16, 3), 0.3), torch.ones(3)
    points_before, embeddings_before = points.clone(), embeddings.clone()

    defended = client_step(client, embeddings, samples, targets, background, NoisyLabel(0.5))
    noisy_targets = NoisyLabel(0.5).perturb_targets(targets, step=0)
    reference = client_step(client, embeddings, samples, noisy_targets, background)

    assert torch.equal(targets, torch.full((16, 3), 0.3))
    assert torch.equal(points, points_before) and torch.equal(embeddings, embeddings_before)
    assert torch.equal(defended.embedding_gradient, reference.embedding_gradient)
    assert defended.loss == reference.loss


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: S2NeRFNoise(c=-0.1, total_steps=10), "c"),
        (lambda: S2NeRFNoise(r=0.0, total_steps=10), "r"),
        (lambda: S2NeRFNoise(r=1.5, total_steps=10), "r"),
        (lambda: S2NeRFNoise(total_steps=0), "total_steps"),
        (lambda: NoisyLabel(-1.0), "sigma"),
        (lambda: SplitTrainConfig(steps=0), "steps"),
        (lambda: SplitTrainConfig(steps=5, record_every=-1), "record_every"),
    ],
)
def test_bad_values_raise_naming_the_parameter(make, name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name} must"):
        make()


def test_negative_step_or_seed_raises() -> None:
    with pytest.raises(ValueError, match="step"):
        S2NeRFNoise(total_steps=10).sigma(torch.ones(2, 3), -1)
    with pytest.raises(ValueError, match="seed -1"):
        NoisyLabel(0.1, seed=-1).perturb_targets(torch.ones(2, 3), 0)


# ------------------------------------------------------------------ in-process training


@pytest.mark.skipif(not LEGO.is_dir(), reason="bundled lego scene not present")
def test_train_split_learns_lego_and_records_the_servers_transcript() -> None:
    scene = load_scene(LEGO, downscale=8)  # 25x25 views
    aabb = tuple(scene.aabb.reshape(-1).tolist())
    render_config = RenderConfig(near=scene.near, far=scene.far, aabb=aabb, num_samples=16)
    torch.manual_seed(0)
    field = HashGridField(HashGridFieldConfig(encoding=TINY_GRID, aabb=aabb, density_hidden=16))
    before = psnr(render_image(field, scene.cameras, 0, render_config).rgb, scene.images[0])
    config = SplitTrainConfig(
        steps=30,
        batch_rays=256,
        random_background=False,
        record_every=20,
        log_every=10,
        device="cpu",
    )
    result = train_split(field, scene, config, render_config)
    after = psnr(render_image(field, scene.cameras, 0, render_config).rgb, scene.images[0])

    assert after > before + 0.5  # ~ +1 dB after 30 steps (seeds 0-2)
    assert result.steps == 30
    assert [record["step"] for record in result.history] == [10, 20, 30]
    assert [exchange.step for exchange in result.transcript] == [0, 20]
    for exchange in result.transcript:
        assert exchange.samples.points().shape == (256 * 16, 3)
        assert exchange.embeddings.shape == exchange.gradient.shape == (256 * 16, 16)
