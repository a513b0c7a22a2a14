"""The splat field and its torch rasteriser (`fedfields.fields.splats`,
`fedfields.render.splatting`): projection against gsplat's own torch reference (when gsplat is
installed) and a closed form, compositing against a pixel-by-pixel loop written out here as
gsplat's CUDA kernel runs it, and a fit that learns."""

from __future__ import annotations

import math

import pytest
import torch

from fedfields.fields import SplatField, SplatFieldConfig, build_field
from fedfields.fields.splats import Gaussians, covariances, sh_basis, sh_colours
from fedfields.geometry.cameras import Cameras, look_at
from fedfields.render.splatting import (
    Projected,
    SplatSettings,
    project,
    rasterise,
    render_splats,
    view_matrix,
)


def camera(width: int = 24, height: int = 20, distance: float = 4.0) -> Cameras:
    """One camera `distance` from the origin on +x, +y, +z's diagonal, looking at it."""
    position = torch.tensor([1.0, 0.8, 0.6])
    position = distance * position / position.norm()
    pose = look_at(position, torch.zeros(3))[None]
    focal = torch.tensor([30.0])
    centre_x, centre_y = torch.tensor([width / 2]), torch.tensor([height / 2 + 1.5])
    return Cameras(pose, focal, focal * 1.1, centre_x, centre_y, width, height)


def random_gaussians(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means in a unit ball around the origin, random rotations and scales 0.02-0.3."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.rand(count, 3, generator=generator) * 2 - 1
    quaternions = torch.randn(count, 4, generator=generator)
    scales = 0.02 + 0.28 * torch.rand(count, 3, generator=generator)
    return means, quaternions, scales


def test_projection_equals_gsplat_s_torch_reference() -> None:
    """Means, conics, depths and footprints equal gsplat's `_fully_fused_projection` (its
    PyTorch reference of the CUDA kernel) for 200 Gaussians, some outside the image."""
    reference = pytest.importorskip("gsplat.cuda._torch_impl")
    cameras = camera()
    means, quaternions, scales = random_gaussians(200, seed=0)
    means = means * 3.0  # some behind the image's edges
    covariance = covariances(quaternions, scales)
    ours = project(means, covariance, cameras, 0)
    viewmat = view_matrix(cameras.camera_to_world[0])
    intrinsics = torch.tensor([[30.0, 0.0, 12.0], [0.0, 33.0, 11.5], [0.0, 0.0, 1.0]])
    radii, means2d, depths, conics, _ = reference._fully_fused_projection(
        means, covariance, viewmat[None], intrinsics[None], 24, 20, eps2d=0.3
    )
    torch.testing.assert_close(ours.means2d, means2d[0])
    torch.testing.assert_close(ours.depths, depths[0])
    torch.testing.assert_close(ours.conics, conics[0], rtol=1e-4, atol=1e-6)
    assert torch.equal(ours.radii, radii[0].long())
    assert 0 < int((ours.radii > 0).all(-1).sum()) < 200  # both kinds present


def test_an_isotropic_gaussian_on_the_axis_projects_to_the_closed_form() -> None:
    """A Gaussian of standard deviation s at distance d on the optical axis: its mean lands on
    the principal point, its image variance is (f s / d)^2 + eps2d per axis."""
    distance, sigma = 4.0, 0.1
    cameras = camera(distance=distance)
    covariance = (sigma**2 * torch.eye(3))[None]
    projected = project(torch.zeros(1, 3), covariance, cameras, 0)
    torch.testing.assert_close(projected.means2d[0], torch.tensor([12.0, 11.5]))
    variance = torch.tensor([(30.0 * sigma / distance) ** 2, (33.0 * sigma / distance) ** 2]) + 0.3
    conic = projected.conics[0]
    torch.testing.assert_close(
        conic, torch.stack([1 / variance[0], torch.tensor(0.0), 1 / variance[1]])
    )
    assert projected.depths.item() == pytest.approx(distance)
    assert projected.radii[0].tolist() == [math.ceil(3.33 * v**0.5) for v in variance.tolist()]


def composite_pixel_by_pixel(
    projected: Projected, colours: torch.Tensor, opacities: torch.Tensor, width: int, height: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """gsplat's CUDA rasteriser written as scalar loops: every pixel walks the Gaussians in
    depth order, skips alpha < 1/255 (and sigma < 0), stops before transmittance <= 1e-4."""
    order = sorted(range(len(opacities)), key=lambda i: float(projected.depths[i]))
    image, alphas = torch.zeros(height, width, colours.shape[1]), torch.zeros(height, width)
    for row in range(height):
        for column in range(width):
            transmittance, colour = 1.0, torch.zeros(colours.shape[1])
            for i in order:
                if not bool((projected.radii[i] > 0).all()):
                    continue
                dx = column + 0.5 - float(projected.means2d[i, 0])
                dy = row + 0.5 - float(projected.means2d[i, 1])
                a, b, c = (float(v) for v in projected.conics[i])
                sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy
                alpha = min(0.999, float(opacities[i]) * math.exp(-sigma))
                if sigma < 0 or alpha < 1 / 255:
                    continue
                after = transmittance * (1 - alpha)
                if after <= 1e-4:
                    break
                colour += colours[i] * alpha * transmittance
                transmittance = after
            image[row, column], alphas[row, column] = colour, 1 - transmittance
    return image, alphas


def random_projected(
    count: int, width: int, height: int, seed: int
) -> tuple[Projected, torch.Tensor, torch.Tensor]:
    """Screen-space Gaussians with full footprints and opacities up to 1 (some saturate)."""
    generator = torch.Generator().manual_seed(seed)
    means2d = torch.rand(count, 2, generator=generator) * torch.tensor([width, height])
    variance = 0.5 + 8 * torch.rand(count, 2, generator=generator)
    covariance = torch.rand(count, generator=generator) * 0.8 - 0.4
    b = covariance * (variance[:, 0] * variance[:, 1]).sqrt()
    det = variance[:, 0] * variance[:, 1] - b * b
    conics = torch.stack([variance[:, 1] / det, -b / det, variance[:, 0] / det], dim=-1)
    radii = torch.ceil(3.33 * variance.sqrt()).long()
    depths = torch.rand(count, generator=generator) * 5 + 1
    colours = torch.rand(count, 3, generator=generator)
    opacities = torch.rand(count, generator=generator) ** 0.3
    return Projected(means2d, conics, depths, radii), colours, opacities


def test_compositing_equals_the_kernel_s_pixel_loop() -> None:
    """Colour and alpha of 40 overlapping Gaussians over 13 x 11 pixels."""
    projected, colours, opacities = random_projected(40, 13, 11, seed=1)
    image, alpha = rasterise(projected, colours, opacities, 13, 11, settings=SplatSettings(tile=4))
    expected_image, expected_alpha = composite_pixel_by_pixel(projected, colours, opacities, 13, 11)
    torch.testing.assert_close(image, expected_image, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alpha, expected_alpha, rtol=1e-5, atol=1e-6)
    assert float(alpha.max()) > 0.99  # the stop rule was reached somewhere


def test_the_background_fills_what_alpha_leaves() -> None:
    projected, colours, opacities = random_projected(30, 20, 17, seed=2)
    whole, alpha = rasterise(projected, colours, opacities, 20, 17)
    background = torch.tensor([0.2, 0.4, 0.6])
    on_background, _ = rasterise(projected, colours, opacities, 20, 17, background)
    torch.testing.assert_close(on_background, whole + (1 - alpha)[..., None] * background)


def composite_with_autograd(
    projected: Projected,
    colours: torch.Tensor,
    opacities: torch.Tensor,
    width: int,
    height: int,
    stop: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pixel against every Gaussian in depth order as one dense autograd graph (no
    footprints, no pairs): the same rules as the pixel loop (`stop` its transmittance floor),
    differentiated by torch."""
    order = torch.argsort(projected.depths.detach(), stable=True)
    order = order[(projected.radii[order] > 0).all(-1)]
    rows, columns = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    pixels = torch.stack([columns, rows], -1).reshape(-1, 1, 2).to(colours) + 0.5
    delta = pixels - projected.means2d[order]
    a, b, c = projected.conics[order].unbind(-1)
    sigma = 0.5 * (a * delta[..., 0] ** 2 + c * delta[..., 1] ** 2) + b * delta.prod(-1)
    alpha = torch.clamp(opacities[order] * torch.exp(-sigma), max=0.999)
    alpha = torch.where((sigma >= 0) & (alpha >= 1 / 255), alpha, 0.0)
    through = torch.cumprod(1 - alpha, dim=1)
    before = torch.cat([torch.ones_like(through[:, :1]), through[:, :-1]], dim=1)
    weights = torch.where(through.detach() > stop, alpha * before, 0.0)
    image = (weights @ colours[order]).view(height, width, -1)
    return image, weights.sum(1).view(height, width)


def test_the_rasteriser_s_own_backward_equals_autograd_through_every_pixel() -> None:
    """700 Gaussians over 20 x 18 pixels, most of them opaque (every pixel stops), every tenth
    centred on a pixel at opacity 1 (the 0.999 clamp holds there). Image, alpha and the
    gradients in pixel means, conics, colours and opacities (float64) equal a dense autograd
    graph of the same rules."""
    projected, colours, opacities = random_projected(700, 20, 18, seed=4)
    means2d, opacities = projected.means2d.double(), opacities.double()
    means2d[::10], opacities[::10] = means2d[::10].floor() + 0.5, 1.0
    inputs = [means2d, projected.conics.double(), colours.double(), opacities]
    outputs = {}
    for name in ("ours", "autograd"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        screen = Projected(leaves[0], leaves[1], projected.depths.double(), projected.radii)
        if name == "ours":
            image, alpha = rasterise(screen, leaves[2], leaves[3], 20, 18)
        else:
            image, alpha = composite_with_autograd(screen, leaves[2], leaves[3], 20, 18)
        outputs[name] = (image, alpha)
        weights = torch.Generator().manual_seed(5)
        loss = (image * torch.randn(image.shape, generator=weights, dtype=image.dtype)).sum()
        loss = loss + (alpha * torch.randn(alpha.shape, generator=weights, dtype=alpha.dtype)).sum()
        outputs[name] += torch.autograd.grad(loss, leaves)
    _, unstopped = composite_with_autograd(screen, leaves[2], leaves[3], 20, 18, stop=0.0)
    stopped = unstopped.detach() - outputs["ours"][1].detach()
    assert float(stopped.min()) > 0  # every pixel met the stop rule
    for ours, reference in zip(outputs["ours"], outputs["autograd"], strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-11)


def test_with_no_gaussian_in_view_the_image_is_the_background_and_gradients_are_zero() -> None:
    projected, colours, opacities = random_projected(5, 10, 8, seed=0)
    means2d = projected.means2d.clone().requires_grad_()
    culled = Projected(means2d, projected.conics, projected.depths, projected.radii * 0)
    image, alpha = rasterise(culled, colours, opacities, 10, 8, torch.tensor([0.2, 0.4, 0.6]))
    (image.sum() + alpha.sum()).backward()
    assert torch.equal(image, torch.tensor([0.2, 0.4, 0.6]).expand(8, 10, 3))
    assert not alpha.any() and not means2d.grad.any()


def test_the_rendered_image_s_gradients_equal_finite_differences() -> None:
    """Three Gaussians over 16 x 12 pixels in float64: autograd's gradients of colour and alpha
    in every mean, quaternion, log-scale, opacity logit and SH coefficient equal central
    differences (torch.autograd.gradcheck). Opacities below 0.6 keep every pixel away from
    the stop rule, and the skip rule's 1/255 cuts alpha where it is already below it."""
    generator = torch.Generator().manual_seed(7)
    cameras = camera(16, 12)
    inputs = (
        torch.rand(3, 3, generator=generator) * 0.6 - 0.3,
        torch.randn(3, 4, generator=generator),
        torch.log(0.1 + 0.1 * torch.rand(3, 3, generator=generator)),
        torch.logit(0.3 + 0.3 * torch.rand(3, generator=generator)),
        0.3 * torch.randn(3, 4, 3, generator=generator),
    )

    def rendered(means, quats, log_scales, logits, sh):
        gaussians = Gaussians(means, quats, log_scales.exp(), torch.sigmoid(logits), sh)
        return render_splats(gaussians, cameras, 0, settings=SplatSettings(tile=4))

    image, alpha = rendered(*inputs)
    assert float(alpha.max()) > 0.3 and float(alpha.min()) < 0.01  # covered, and edges
    leaves = tuple(t.double().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(rendered, leaves, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_spherical_harmonics_equal_gsplat_s_and_degree_zero_is_the_constant() -> None:
    reference = pytest.importorskip("gsplat.cuda._torch_impl")
    generator = torch.Generator().manual_seed(3)
    coefficients = torch.randn(50, 16, 3, generator=generator) * 0.3
    directions = torch.nn.functional.normalize(torch.randn(50, 3, generator=generator), dim=-1)
    for degree in range(4):
        used = coefficients[:, : (degree + 1) ** 2]
        expected = (reference._spherical_harmonics(degree, directions, used) + 0.5).clamp(min=0)
        torch.testing.assert_close(sh_colours(used, directions), expected)
    constant = sh_colours(coefficients[:, :1], directions)
    torch.testing.assert_close(
        constant, (0.28209479177387814 * coefficients[:, 0] + 0.5).clamp(min=0)
    )
    with pytest.raises(ValueError, match="1, 4, 9 or 16 coefficients, got 5"):
        sh_basis(directions, 5)


def test_fitting_a_splat_field_to_another_s_renders_lowers_the_loss() -> None:
    """Seeded: 64 Gaussians fitted for 40 Adam steps to 3 views of another field's Gaussians."""
    positions = torch.tensor([[3.0, 1, 1], [1, 3, 1], [1, 1, 3]])
    poses = torch.stack([look_at(position, torch.zeros(3)) for position in positions])
    focal, centre = torch.full((3,), 20.0), torch.full((3,), 8.0)
    views = Cameras(poses, focal, focal.clone(), centre, centre.clone(), 16, 16)
    box = (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0)
    config = SplatFieldConfig(
        count=64, sh_degree=0, aabb=box, initial_scale=0.1, initial_opacity=0.5
    )
    target = SplatField(config)
    with torch.no_grad():
        target.params["sh"][:, 0] = (
            torch.rand(64, 3, generator=torch.Generator().manual_seed(4)) * 2 - 1
        )
    targets = [render_splats(target, views, v)[0].detach() for v in range(3)]
    field = SplatField(SplatFieldConfig(**{**config.__dict__, "seed": 1}))
    optimiser = torch.optim.Adam(field.parameters(), lr=0.02)
    losses = []
    for step in range(40):
        view = step % 3
        loss = ((render_splats(field, views, view)[0] - targets[view]) ** 2).mean()
        optimiser.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in field.parameters() if p.grad is not None)
        optimiser.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses


def test_the_volume_reading_of_one_gaussian_is_its_kernel_and_the_field_rebuilds() -> None:
    config = SplatFieldConfig(count=1, sh_degree=1, initial_scale=0.1, initial_opacity=0.5)
    field = SplatField(config)
    mean, sigma = field.means.detach()[0], 0.1 * 3.0  # initial_scale of the 3-wide box
    points = mean + torch.tensor([[0.0, 0.0, 0.0], [sigma, 0.0, 0.0], [0.0, 2 * sigma, 0.0]])
    expected = 50.0 * 0.5 * torch.exp(-0.5 * torch.tensor([0.0, 1.0, 4.0]))
    torch.testing.assert_close(field.density(points), expected)
    outputs = field(points, torch.tensor([[0.0, 0.0, 1.0]]).expand(3, 3))
    torch.testing.assert_close(outputs.rgb, torch.full((3, 3), 0.5))  # grey at start
    rebuilt = build_field(field.config_dict())
    assert isinstance(rebuilt, SplatField) and rebuilt.config == config
    torch.testing.assert_close(rebuilt.means, field.means)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"count": 0}, "count >= 1"), ({"sh_degree": 4}, r"sh_degree in \[0, 3\]"),
     ({"initial_opacity": 1.0}, "initial_opacity must lie in")],
)  # fmt: skip
def test_a_bad_splat_config_is_refused_naming_the_value(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SplatFieldConfig(**options)


def test_gsplat_s_cuda_rasteriser_equals_the_torch_path() -> None:
    """On a CUDA device with gsplat: the two backends' images agree within 1e-4 (float32
    sums in another order)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("gsplat")
    field = SplatField(SplatFieldConfig(count=300, sh_degree=2, initial_scale=0.05)).cuda()
    with torch.no_grad():
        field.params["sh"].normal_(0, 0.3, generator=torch.Generator("cuda").manual_seed(5))
        field.params["opacities"].fill_(0.5)
    cameras = camera(48, 40).to("cuda")
    background = torch.tensor([0.1, 0.2, 0.3], device="cuda")
    ours = render_splats(field, cameras, 0, background, backend="torch")
    theirs = render_splats(field, cameras, 0, background, backend="gsplat")
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-4, atol=1e-4)


def test_an_unknown_splat_backend_is_refused_by_name() -> None:
    field = SplatField(SplatFieldConfig(count=2))
    with pytest.raises(ValueError, match="splat backend 'cuda' is unknown"):
        render_splats(field, camera(), 0, backend="cuda")
    with pytest.raises(RuntimeError, match="'gsplat' needs gsplat .* on a CUDA device"):
        render_splats(field, camera(), 0, backend="gsplat")
