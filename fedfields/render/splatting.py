"""Differentiable 3D Gaussian splatting in torch: the CPU path and the reference for a CUDA one.

Kerbl et al., "3D Gaussian Splatting for Real-Time Radiance Field Rendering" (SIGGRAPH 2023),
with gsplat's conventions so that its CUDA rasteriser can replace this one on a GPU node:

- a Gaussian's covariance is Sigma = R S S^T R^T (eq. 6) from a unit quaternion (w, x, y, z)
  and per-axis scales;
- it projects to the image by the EWA approximation Sigma' = J W Sigma W^T J^T (eq. 5), J the
  Jacobian of the perspective projection at the mean (its x/z and y/z clamped to 1.3 times
  the half field of view, as gsplat does), plus `eps2d` pixels^2 on the diagonal (a low-pass
  filter); its footprint is 3.33 standard deviations per axis;
- each pixel (centres at +0.5) composites the Gaussians whose footprint covers it front to
  back by camera depth (eq. 3): alpha = min(0.999, opacity exp(-d^T Sigma'^-1 d / 2)), skipped
  below 1/255, and a pixel stops before the Gaussian that would take its transmittance to
  1e-4 or below.

Cameras are this project's (OpenGL: the camera looks down -z, y up); the projection works in
OpenCV's frame (x right, y down, z forward) as gsplat's does. Autograd differentiates the
projection; the compositing (`_Rasterise`) works on the flat list of (pixel, Gaussian) pairs
inside each footprint, sorted by pixel and depth, with its backward written out as gsplat's
kernel has it: on a CPU a few times faster than autograd through dense tiles, whose pixels
mostly lie outside a given Gaussian's footprint.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from functools import cache

import torch
from torch import Tensor

from fedfields.fields.splats import Gaussians, SplatField, sh_colours
from fedfields.geometry.cameras import Cameras
from fedfields.render.volume import RenderOutputs

OPENGL_TO_OPENCV = torch.diag(torch.tensor([1.0, -1.0, -1.0, 1.0]))
"""Right-multiplied into an OpenGL camera-to-world: the same camera with y down, z forward."""


@dataclass(frozen=True)
class SplatSettings:
    """The rasteriser's constants (gsplat's defaults)."""

    tile: int = 16  # pixels per tile side (gsplat's CUDA kernels; the torch path has none)
    eps2d: float = 0.3  # pixels^2 added to each projected covariance's diagonal
    near: float = 0.01  # Gaussians nearer the camera than this are culled
    alpha_min: float = 1.0 / 255.0  # a Gaussian's alpha below this is skipped at that pixel
    alpha_max: float = 0.999  # alpha is clamped here so transmittance never reaches 0
    transmittance_min: float = 1e-4  # a pixel stops before its transmittance falls this low
    radius_sigmas: float = 3.33  # a projected Gaussian's footprint, in standard deviations

    def __post_init__(self) -> None:
        if self.tile < 1 or self.eps2d < 0 or self.near <= 0:
            raise ValueError(f"splat settings need tile >= 1, eps2d >= 0, near > 0: {self}")


GSPLAT_DEFAULTS = SplatSettings()


@dataclass(frozen=True)
class Projected:
    """Gaussians seen from one camera: pixel-space means and conics, depths, footprints."""

    means2d: Tensor  # [N, 2] pixels (x right, y down)
    conics: Tensor  # [N, 3] the inverse 2D covariance's (a, b, c): [[a, b], [b, c]]
    depths: Tensor  # [N] camera-space z
    radii: Tensor  # [N, 2] int64 footprint half-sizes in pixels; 0 where culled


def view_matrix(camera_to_world: Tensor) -> Tensor:
    """[4, 4] world-to-camera of an OpenGL camera-to-world, in OpenCV's frame (z forward)."""
    return torch.linalg.inv(camera_to_world @ OPENGL_TO_OPENCV.to(camera_to_world))


def project(
    means: Tensor,
    covariance: Tensor,
    cameras: Cameras,
    view: int,
    settings: SplatSettings = GSPLAT_DEFAULTS,
) -> Projected:
    """Gaussians [N, 3] with covariances [N, 3, 3] seen by `cameras`' view `view` (EWA)."""
    world_to_camera = view_matrix(cameras.camera_to_world[view]).to(means)
    rotation, translation = world_to_camera[:3, :3], world_to_camera[:3, 3]
    points = means @ rotation.T + translation
    camera_covariance = rotation @ covariance @ rotation.T
    fx, fy = cameras.fx[view].to(means), cameras.fy[view].to(means)
    cx, cy = cameras.cx[view].to(means), cameras.cy[view].to(means)
    width, height = cameras.width, cameras.height
    x, y, z = points.unbind(-1)
    # gsplat's clamp of x/z and y/z to 1.3 half fields of view: far-off-screen Gaussians keep
    # a bounded Jacobian
    limit_x = (width - cx) / fx + 0.3 * (0.5 * width / fx), cx / fx + 0.3 * (0.5 * width / fx)
    limit_y = (height - cy) / fy + 0.3 * (0.5 * height / fy), cy / fy + 0.3 * (0.5 * height / fy)
    clamped_x = z * torch.clamp(x / z, min=-limit_x[1], max=limit_x[0])
    clamped_y = z * torch.clamp(y / z, min=-limit_y[1], max=limit_y[0])
    zero = torch.zeros_like(z)
    jacobian = torch.stack(
        [fx / z, zero, -fx * clamped_x / (z * z), zero, fy / z, -fy * clamped_y / (z * z)], dim=-1
    ).view(-1, 2, 3)
    image_covariance = jacobian @ camera_covariance @ jacobian.transpose(-1, -2)
    image_covariance = image_covariance + settings.eps2d * torch.eye(2).to(means)
    a, b = image_covariance[:, 0, 0], 0.5 * (image_covariance[:, 0, 1] + image_covariance[:, 1, 0])
    c = image_covariance[:, 1, 1]
    determinant = (a * c - b * b).clamp(min=1e-10)
    conics = torch.stack([c / determinant, -b / determinant, a / determinant], dim=-1)
    means2d = torch.stack([fx * x / z + cx, fy * y / z + cy], dim=-1)
    with torch.no_grad():
        radii = torch.ceil(settings.radius_sigmas * torch.stack([a, c], dim=-1).sqrt())
        visible = (a * c - b * b > 0) & (z > settings.near)
        visible &= (means2d[:, 0] + radii[:, 0] > 0) & (means2d[:, 0] - radii[:, 0] < width)
        visible &= (means2d[:, 1] + radii[:, 1] > 0) & (means2d[:, 1] - radii[:, 1] < height)
        radii = torch.where(visible[:, None], radii, torch.zeros_like(radii)).long()
    return Projected(means2d, conics, z, radii)


def rasterise(
    projected: Projected,
    colours: Tensor,
    opacities: Tensor,
    width: int,
    height: int,
    background: Tensor | None = None,
    settings: SplatSettings = GSPLAT_DEFAULTS,
) -> tuple[Tensor, Tensor]:
    """[H, W, C] colour and [H, W] accumulated alpha of the projected Gaussians' colours
    [N, C] and opacities [N] in (0, 1), composited front to back per pixel (module
    docstring); `background` [C] shows through what alpha leaves."""
    pairs = _pixel_pairs(projected, width, height)
    image, alpha_image = _Rasterise.apply(
        projected.means2d, projected.conics, colours, opacities, pairs, settings
    )
    image, alpha_image = image.view(height, width, -1), alpha_image.view(height, width)
    if background is not None:
        image = image + (1.0 - alpha_image)[..., None] * background.to(image)
    return image, alpha_image


@dataclass(frozen=True)
class _PixelPairs:
    """Every (pixel, Gaussian) pair within the Gaussian's footprint, sorted by pixel and, in
    each pixel, front to back: what one image composites."""

    gaussians: Tensor  # [M] index of each pair's Gaussian
    pixels: Tensor  # [M] row-major index of each pair's pixel
    centres: Tensor  # [M, 2] that pixel's centre (x, y)
    last: Tensor  # [H * W] index of each pixel's last pair (-1 before the first: none)
    num_pixels: int


def _pixel_pairs(projected: Projected, width: int, height: int) -> _PixelPairs:
    """The pairs whose pixel centre lies in the Gaussian's footprint box: outside it alpha is
    below the 1/255 that compositing skips (the box spans `radius_sigmas` along each axis)."""
    radii = projected.radii
    visible = (radii > 0).all(dim=-1).nonzero().flatten()
    order = visible[torch.argsort(projected.depths[visible].detach(), stable=True)]
    means2d, radii = projected.means2d[order].detach(), radii[order].to(projected.means2d)
    low = torch.ceil(means2d - radii - 0.5).clamp(min=0)
    high = torch.floor(means2d + radii - 0.5)
    high = torch.minimum(high, torch.tensor([width - 1, height - 1]).to(high))
    spans = (high - low + 1).clamp(min=0).long()  # [V, 2] columns and rows each one covers
    counts = spans[:, 0] * spans[:, 1]
    device = counts.device
    owner = torch.repeat_interleave(torch.arange(len(order), device=device), counts)
    first = torch.cumsum(counts, 0) - counts
    # one gather per pair of its Gaussian's box: first pair, left, top, columns spanned
    box = torch.stack([first, low[:, 0].long(), low[:, 1].long(), spans[:, 0]], dim=-1)
    first, left, top, across = box.index_select(0, owner).unbind(-1)
    within = torch.arange(owner.shape[0], device=device) - first
    rows = top + torch.div(within, across, rounding_mode="floor")
    columns = left + within % across
    pixels, by_pixel = torch.sort(rows * width + columns, stable=True)  # keeps depth order
    gaussians = order.index_select(0, owner.index_select(0, by_pixel))
    per_pixel = torch.bincount(pixels, minlength=width * height)
    centres = torch.stack([pixels % width, torch.div(pixels, width, rounding_mode="floor")], -1)
    return _PixelPairs(
        gaussians=gaussians,
        pixels=pixels,
        centres=centres.to(projected.means2d) + 0.5,
        last=torch.cumsum(per_pixel, 0) - 1,
        num_pixels=width * height,
    )


def _segment_sums(values: Tensor, pairs: _PixelPairs) -> tuple[Tensor, Tensor]:
    """Float64 sums of per-pair `values` [M] within each pixel: [M] inclusive running sums
    and [H * W] pixel totals."""
    running = torch.cumsum(values.double(), 0)
    padded = torch.cat([running.new_zeros(1), running])
    ends = padded[pairs.last + 1]  # the running sum at each pixel's last pair
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])  # ... at the pixel before it
    return running - starts[pairs.pixels], ends - starts


def _sums(values: Tensor, index: Tensor, count: int) -> Tensor:
    """[count, K] sums of per-pair `values` [K, M] by `index` [M] (bincount: float64 sums,
    in a fixed order)."""
    columns = [torch.bincount(index, weights=row, minlength=count) for row in values]
    return torch.stack(columns, dim=-1).to(values)


class _Rasterise(torch.autograd.Function):
    """Per-pixel front-to-back compositing over the footprint pairs, with the backward written
    out as gsplat's kernel has it: the transmittance terms of pair i are the pixel's weighted
    sum over the pairs behind it, one suffix sum per pixel. Running sums in float64 keep each
    pixel's transmittance and suffix exact to float32."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        means2d: Tensor,
        conics: Tensor,
        colours: Tensor,
        opacities: Tensor,
        pairs: _PixelPairs,
        settings: SplatSettings,
    ) -> tuple[Tensor, Tensor]:
        # one gather of every pair's Gaussian: mean (2), conic (3), opacity, colour (C)
        packed = torch.cat([means2d, conics, opacities[:, None], colours], dim=-1)
        gathered = packed.index_select(0, pairs.gaussians)
        dx = pairs.centres[:, 0] - gathered[:, 0]
        dy = pairs.centres[:, 1] - gathered[:, 1]
        a, b, c, opacity = gathered[:, 2:6].unbind(-1)
        sigma = 0.5 * (a * dx**2 + c * dy**2) + b * dx * dy
        kernel = torch.exp(-sigma)
        unclamped = opacity * kernel
        alpha = torch.clamp(unclamped, max=settings.alpha_max)
        live = (sigma >= 0) & (alpha >= settings.alpha_min)
        alpha = torch.where(live, alpha, 0.0)
        log_through, _ = _segment_sums(torch.log1p(-alpha.double()), pairs)
        through = torch.exp(log_through)  # the pixel's transmittance after each pair
        before = (through / (1.0 - alpha.double())).to(alpha)
        kept = through > settings.transmittance_min  # the stop rule
        weights = torch.where(kept, alpha * before, 0.0)
        moving = live & kept & (unclamped <= settings.alpha_max)  # alpha follows o and kernel
        out = torch.cat([weights * gathered[:, 6:].T, weights[None]])  # [C + 1, M]
        out = _sums(out, pairs.pixels, pairs.num_pixels)
        ctx.save_for_backward(dx, dy, gathered, kernel, alpha, before, weights, moving)
        ctx.pairs, ctx.count = pairs, means2d.shape[0]
        return out[:, :-1], out[:, -1]

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_image: Tensor, grad_alpha_image: Tensor
    ) -> tuple[Tensor | None, ...]:
        dx, dy, gathered, kernel, alpha, before, weights, moving = ctx.saved_tensors
        pairs = ctx.pairs
        pixel_grads = torch.cat([grad_image, grad_alpha_image[:, None]], dim=-1)
        pixel_grads = pixel_grads.index_select(0, pairs.pixels)  # [M, C + 1]
        colours = gathered[:, 6:]
        # d out / d weight_i; the weights j behind i in its pixel hold (1 - alpha_i)
        per_weight = (pixel_grads[:, :-1] * colours).sum(-1) + pixel_grads[:, -1]
        running, totals = _segment_sums(weights * per_weight, pairs)
        behind = (totals[pairs.pixels] - running).to(weights)
        grad_alpha = before * per_weight - behind / (1.0 - alpha)
        grad_unclamped = torch.where(moving, grad_alpha, 0.0) * kernel
        a, b, c, opacity = gathered[:, 2:6].unbind(-1)
        grad_sigma = -grad_unclamped * opacity
        per_pair = torch.stack(
            [
                -grad_sigma * (a * dx + b * dy),  # mean x
                -grad_sigma * (c * dy + b * dx),  # mean y
                0.5 * grad_sigma * dx**2,  # conic a
                grad_sigma * dx * dy,  # conic b
                0.5 * grad_sigma * dy**2,  # conic c
                grad_unclamped,  # opacity
                *(weights * pixel_grads[:, k] for k in range(colours.shape[1])),
            ],
        )
        grads = _sums(per_pair, pairs.gaussians, ctx.count)
        return grads[:, :2], grads[:, 2:5], grads[:, 6:], grads[:, 5], None, None


def render_splats(
    field: SplatField | Gaussians,
    cameras: Cameras,
    view: int,
    background: Tensor | None = None,
    settings: SplatSettings = GSPLAT_DEFAULTS,
    backend: str = "auto",
    info: dict | None = None,
    sh_degree: int | None = None,
) -> tuple[Tensor, Tensor]:
    """[H, W, 3] colour and [H, W] alpha of `field`'s Gaussians seen by `cameras`' view
    `view`, rasterised; colour from each Gaussian's spherical harmonics (up to `sh_degree`,
    default all) along the ray from the camera to its mean. `backend` "auto" takes gsplat's
    CUDA kernels for a field on a CUDA device when gsplat is installed (the `splats` extra),
    else this module's torch. `info` (a dict) receives what gsplat's densification
    strategies read: the [1, N, 2] pixel means whose gradient they accumulate, the radii and
    the image size. `field` may be a set of `Gaussians` (several fields joined)."""
    gaussians = field.gaussians() if isinstance(field, SplatField) else field
    degree = gaussians.sh_degree if sh_degree is None else sh_degree
    if backend not in SPLAT_BACKENDS:
        raise ValueError(f"splat backend {backend!r} is unknown; expected one of {SPLAT_BACKENDS}")
    on_cuda = gaussians.means.device.type == "cuda"
    if backend == "gsplat" and not (on_cuda and gsplat_available()):
        raise RuntimeError(
            f"splat backend 'gsplat' needs gsplat (the 'splats' extra, installed: "
            f"{gsplat_available()}) and the field on a CUDA device (it is on "
            f"{gaussians.means.device}); use backend 'auto' or 'torch'"
        )
    if backend == "gsplat" or (backend == "auto" and on_cuda and gsplat_available()):
        return _render_with_gsplat(gaussians, cameras, view, background, settings, info, degree)
    projected, colours = _projected_colours(gaussians, cameras, view, settings, degree)
    if info is not None:
        info |= {"means2d": projected.means2d[None], "radii": projected.radii[None],
                 "width": cameras.width, "height": cameras.height, "n_cameras": 1,
                 "gaussian_ids": None}  # fmt: skip
        projected = replace(projected, means2d=info["means2d"][0])
    return rasterise(
        projected, colours, gaussians.opacities, cameras.width, cameras.height, background,
        settings,
    )  # fmt: skip


def render_splat_outputs(
    field: SplatField, cameras: Cameras, view: int, background: Tensor
) -> RenderOutputs:
    """The volume renderer's outputs for a splat field (torch path): colour on `background`,
    depth as the weights' sum of camera depths (as the volume renderer sums theirs), opacity;
    [H, W, 3], [H, W], [H, W]. What evaluation, render files and orbits read."""
    settings, gaussians = GSPLAT_DEFAULTS, field.gaussians()
    projected, colours = _projected_colours(gaussians, cameras, view, settings, gaussians.sh_degree)
    channels = torch.cat([colours, projected.depths[:, None]], dim=-1)
    image, alpha = rasterise(
        projected, channels, gaussians.opacities, cameras.width, cameras.height, None, settings
    )
    rgb = image[..., :3] + (1.0 - alpha)[..., None] * background.to(image)
    return RenderOutputs(rgb=rgb, depth=image[..., 3], opacity=alpha)


def _projected_colours(
    gaussians: Gaussians, cameras: Cameras, view: int, settings: SplatSettings, degree: int
) -> tuple[Projected, Tensor]:
    """The Gaussians projected into the view, and their SH colours up to `degree` along the
    rays from the camera to their means."""
    means = gaussians.means
    projected = project(means, gaussians.covariances(), cameras, view, settings)
    centre = cameras.camera_to_world[view, :3, 3].to(means)
    directions = torch.nn.functional.normalize(means - centre, dim=-1)
    return projected, sh_colours(gaussians.sh[:, : (degree + 1) ** 2], directions)


SPLAT_BACKENDS = ("auto", "torch", "gsplat")


@cache
def gsplat_available() -> bool:
    """Whether gsplat can be imported (its CUDA kernels compile at their first call); asked
    once per process, not at every render."""
    return importlib.util.find_spec("gsplat") is not None


def _render_with_gsplat(
    gaussians: Gaussians,
    cameras: Cameras,
    view: int,
    background: Tensor | None,
    settings: SplatSettings,
    info: dict | None,
    degree: int,
) -> tuple[Tensor, Tensor]:
    """The same image through gsplat's `rasterization` (CUDA); its meta goes to `info`."""
    from gsplat import rasterization

    device = gaussians.means.device
    intrinsics = torch.zeros(1, 3, 3, device=device)
    intrinsics[0, 0, 0], intrinsics[0, 1, 1] = cameras.fx[view], cameras.fy[view]
    intrinsics[0, 0, 2], intrinsics[0, 1, 2] = cameras.cx[view], cameras.cy[view]
    intrinsics[0, 2, 2] = 1.0
    colours, alphas, meta = rasterization(
        gaussians.means, gaussians.quats, gaussians.scales, gaussians.opacities, gaussians.sh,
        view_matrix(cameras.camera_to_world[view].to(device))[None], intrinsics, cameras.width,
        cameras.height, near_plane=settings.near, eps2d=settings.eps2d,
        sh_degree=degree, tile_size=settings.tile, packed=False,
        backgrounds=None if background is None else background.to(device)[None],
    )  # fmt: skip
    if info is not None:
        info |= meta
    return colours[0], alphas[0, ..., 0]
