"""Centralised training of a splat field: 3DGS's optimisation with gsplat's densification.

Each step renders one random training view (`fedfields.render.splatting.render_splats`) and
takes an L1 photometric loss (3DGS eq. 7 without its D-SSIM term) with one Adam per tensor at
3DGS's learning rates (means scaled by the scene's extent). gsplat's `DefaultStrategy` (the
3DGS paper's adaptive density control: clone small and split large Gaussians whose mean
view-space gradient passes its threshold, prune faint and huge ones; its opacity reset never
fires in gsplat 1.5.3, whose test of the step is always false) grows and prunes the field in
place for the first `refine_fraction` of the run (of its steps, or of its seconds when a
wall-clock budget ends it first: 3DGS refines for 15,000 of 30,000 steps, and Gaussians
added at the end of a run would go out untrained); `max_gaussians` caps the count a node
holds. The SH degree in use rises by one every `sh_degree_every` steps, as in 3DGS.

A federated client trains the shared set without changing its structure
(`local_train_splats`: every node's tensors keep the server's shapes, so every strategy that
sums tensors sums them), with a method's client hooks and, for DecentNeRF, the user's
personal Gaussians rendered in the same image (`fedfields.fields.splats.Gaussians.joined`).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfields.data.scene import Scene
from fedfields.devices import resolve_device
from fedfields.fields.splats import Gaussians, SplatAppearance, SplatField, SplatFieldConfig
from fedfields.methods.base import ClientHook, to_wire
from fedfields.render import RenderConfig
from fedfields.render.splatting import render_splats
from fedfields.train.centralised import checked_losses
from fedfields.train.federated import LOSS_WINDOW, LocalTrainConfig, LocalTrainResult

LEARNING_RATES = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}
"""3DGS's Adam learning rates (means times the scene's extent; sh its degree-0 rate)."""
APPEARANCE_LEARNING_RATE = 1e-3
"""A user's per-view colour maps (`SplatAppearance`): gsplat's appearance-optimisation rate."""


@dataclass(frozen=True)
class SplatTrainConfig:
    """Steps, the initial Gaussians and gsplat's density-control schedule."""

    steps: int = 3000
    initial_count: int = 5000
    sh_degree: int = 3
    sh_degree_every: int = 1000
    max_gaussians: int = 200_000
    refine_start: int = 500
    refine_every: int = 100
    reset_every: int = 3000
    refine_fraction: float = 0.5  # density control for this part of the run, as 3DGS's 15k of 30k
    seed: int = 0
    seconds: float | None = None  # wall-clock budget: stop after the step that passes it

    def __post_init__(self) -> None:
        for name in ("steps", "initial_count", "max_gaussians", "refine_every", "reset_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"splat training's {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.refine_fraction <= 1.0:
            raise ValueError(f"refine_fraction must be in [0, 1], got {self.refine_fraction}")
        if self.initial_count > self.max_gaussians:
            raise ValueError(
                f"initial_count {self.initial_count} is above max_gaussians {self.max_gaussians}"
            )


def rate_groups(field: SplatField, extent: float) -> list[dict]:
    """One Adam parameter group per tensor at 3DGS's rate (means times `extent`)."""
    return [
        {
            "params": [parameter],
            "lr": LEARNING_RATES[name] * (extent if name == "means" else 1.0),
            "name": name,
        }
        for name, parameter in field.params.items()
    ]


def field_extent(field: SplatField) -> float:
    """Half the diagonal of the field's box: the scale 3DGS's mean learning rate is set by."""
    return float((field.aabb[1] - field.aabb[0]).norm()) / 2


def optimisers(field: SplatField, extent: float) -> dict[str, torch.optim.Optimizer]:
    """One Adam per tensor, as gsplat's strategies expect (each with one parameter group)."""
    groups = rate_groups(field, extent)
    return {group["name"]: torch.optim.Adam([group], eps=1e-15) for group in groups}


def train_splats(
    scene: Scene,
    config: SplatTrainConfig = SplatTrainConfig(),
    on_step: Callable[[int, float, int], None] | None = None,
    device: torch.device | str = "cpu",
) -> SplatField:
    """A splat field trained on `scene`'s views on `device`; `on_step(step, loss, count)`
    after each step."""
    try:
        from gsplat.strategy import DefaultStrategy
    except ImportError as error:
        raise RuntimeError(
            "training splats needs gsplat's density control: pip install -e '.[splats]'"
        ) from error
    torch.manual_seed(config.seed)  # gsplat's splits draw from the global generator
    draw = random.Random(config.seed)
    aabb = tuple(scene.aabb.flatten().tolist())
    field = SplatField(
        SplatFieldConfig(
            count=config.initial_count, sh_degree=config.sh_degree, aabb=aabb, seed=config.seed
        )
    ).to(device)
    scene = scene.to(device)
    extent = field_extent(field)
    optimisers_by_name = optimisers(field, extent)
    strategy = DefaultStrategy(
        refine_start_iter=config.refine_start,
        refine_every=config.refine_every,
        reset_every=config.reset_every,
        refine_stop_iter=int(config.refine_fraction * config.steps),
    )
    state = strategy.initialize_state(scene_scale=extent)
    background = torch.tensor(scene.background, device=field.means.device)
    start = time.perf_counter()
    for step in range(config.steps):
        elapsed = time.perf_counter() - start
        if config.seconds is not None and elapsed > config.seconds:
            break
        if config.seconds is not None and elapsed > config.refine_fraction * config.seconds:
            strategy.refine_stop_iter = min(strategy.refine_stop_iter, step)
        view = draw.randrange(len(scene))
        info: dict = {}
        degree = min(config.sh_degree, step // config.sh_degree_every)
        rendered, _ = render_splats(
            field, scene.cameras, view, background, info=info, sh_degree=degree
        )
        loss = (rendered - scene.images[view]).abs().mean()
        strategy.step_pre_backward(field.params, optimisers_by_name, state, step, info)
        loss.backward()
        for optimiser in optimisers_by_name.values():
            optimiser.step()
            optimiser.zero_grad(set_to_none=True)
        strategy.step_post_backward(field.params, optimisers_by_name, state, step, info)
        _cap(field, optimisers_by_name, state, config.max_gaussians)
        field.structure_changed()
        if on_step is not None:
            on_step(step, float(loss.detach()), int(field.means.shape[0]))
    return field


def _cap(
    field: SplatField,
    optimisers_by_name: dict[str, torch.optim.Optimizer],
    state: dict,
    limit: int,
) -> None:
    """Prune the faintest Gaussians above `limit` (gsplat's own remove keeps the optimisers'
    moments and its running statistics aligned)."""
    excess = field.means.shape[0] - limit
    if excess <= 0:
        return
    from gsplat.strategy.ops import remove

    faintest = torch.argsort(field.params["opacities"].detach())[:excess]
    mask = torch.zeros(field.means.shape[0], dtype=torch.bool)
    mask[faintest] = True
    remove(params=field.params, optimizers=optimisers_by_name, state=state, mask=mask)


def splat_render_config(scene: Scene) -> RenderConfig:
    """The render settings a splat field's evaluation and checkpoint carry: the scene's box,
    bounds and background (a rasterised field takes no ray samples)."""
    return RenderConfig(
        near=scene.near, far=scene.far, aabb=tuple(scene.aabb.flatten().tolist()),
        background=scene.background,
    )  # fmt: skip


def local_train_splats(
    global_field: SplatField,
    scene: Scene,
    config: LocalTrainConfig,
    personal_field: SplatField | None = None,
    hooks: Sequence[ClientHook] = (),
    opacity_weight: float = 0.0,
    appearance: SplatAppearance | None = None,
) -> LocalTrainResult:
    """One round of a federated client on a splat field: `config.steps` steps, each on one
    view drawn from `config.seed`, of 3DGS's L1 loss at 3DGS's rates (one Adam, a group per
    tensor), plus each hook's loss term; hooks correct the shared Gaussians' gradients after
    backward. The structure stays the server's (no densification). With `personal_field`
    the user's personal Gaussians render in the same image and train beside the shared ones,
    with `config.personal_density_weight` times their mean opacity added to the loss (NeRF-W's
    transient regulariser, read for splats): what is not the user's own stays cheaper shared.
    `opacity_weight` times the shared Gaussians' mean opacity joins the loss (3DGS-MCMC's
    opacity regulariser: Gaussians no view needs fade, and the server's relocation moves them).
    With `appearance` each rendered view passes through the user's colour map of that view,
    trained beside the rest at `APPEARANCE_LEARNING_RATE`.
    """
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    fields = [global_field] if personal_field is None else [global_field, personal_field]
    groups = []
    for part in fields:
        part.to(device).train()
        groups += rate_groups(part, field_extent(part))
    if appearance is not None:
        appearance.to(device).train()
        groups.append({"params": list(appearance.parameters()), "lr": APPEARANCE_LEARNING_RATE})
    optimiser = torch.optim.Adam(groups, eps=1e-15)
    parameters = dict(global_field.named_parameters())
    for hook in hooks:
        hook.bind(parameters)
    scene = scene.to(device)
    background = torch.tensor(scene.background, device=device)
    generator = torch.Generator().manual_seed(config.seed)
    views = torch.randint(len(scene), (config.steps,), generator=generator).tolist()
    recent: deque[Tensor] = deque(maxlen=LOSS_WINDOW)
    losses: list[Tensor] = []
    start = time.perf_counter()
    for view in views:
        rendered, _ = render_splats(_gaussians(fields), scene.cameras, view, background)
        if appearance is not None:
            rendered = appearance(rendered, view)
        error = rendered - scene.images[view]
        loss = error.abs().mean()
        if opacity_weight:
            loss = loss + opacity_weight * global_field.opacities.mean()
        if personal_field is not None:
            loss = loss + config.personal_density_weight * personal_field.opacities.mean()
        for hook in hooks:
            term = hook.loss()
            if term is not None:
                loss = loss + term
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        for hook in hooks:
            hook.after_backward()
        optimiser.step()
        recent.append(error.detach().pow(2).mean())
        losses.append(loss.detach())
    optimiser.zero_grad(set_to_none=True)
    checked_losses(losses, 0, "local splat training")
    mean_loss = float(torch.stack(list(recent)).mean())
    pixels = scene.images.shape[:3].numel()
    return LocalTrainResult(
        steps=len(views),
        rays=len(views) * scene.images.shape[1:3].numel(),
        samples=0,
        seconds=time.perf_counter() - start,
        loss=mean_loss,
        psnr=-10.0 * math.log10(max(mean_loss, 1e-10)),
        num_examples=pixels,
        hook_results=[hook.finish(len(views)) for hook in hooks],
    )


def splat_loss_gradient(
    global_field: SplatField,
    scene: Scene,
    personal_field: SplatField | None = None,
    personal_density_weight: float = 0.0,
    device: str | torch.device = "cpu",
    opacity_weight: float = 0.0,
    appearance: SplatAppearance | None = None,
) -> dict[str, Tensor]:
    """DecentNeRF's G_k = dL_k/dg for splats (Algorithm 1, l. 9): the gradient of the local
    loss (`local_train_splats`'s, its regularisers included), averaged over every view of
    `scene`, in the shared Gaussians at their current values, both sets frozen; keyed like
    `federated_state` (CPU float32). No parameter or `.grad` changes."""
    device = resolve_device(device)
    fields = [global_field] if personal_field is None else [global_field, personal_field]
    for part in fields:
        part.to(device)
    if appearance is not None:
        appearance.to(device)
    scene = scene.to(device)
    background = torch.tensor(scene.background, device=device)
    parameters = dict(global_field.named_parameters())
    total = [torch.zeros_like(p) for p in parameters.values()]
    for view in range(len(scene)):
        rendered, _ = render_splats(_gaussians(fields), scene.cameras, view, background)
        if appearance is not None:
            rendered = appearance(rendered, view)
        loss = (rendered - scene.images[view]).abs().mean() / len(scene)
        if opacity_weight:
            loss = loss + opacity_weight * global_field.opacities.mean() / len(scene)
        if personal_field is not None:
            loss = loss + personal_density_weight * personal_field.opacities.mean() / len(scene)
        gradients = torch.autograd.grad(loss, list(parameters.values()), allow_unused=True)
        for sum_, gradient in zip(total, gradients, strict=True):
            if gradient is not None:
                sum_ += gradient
    return {name: to_wire(g) for name, g in zip(parameters, total, strict=True)}


def _gaussians(fields: Sequence[SplatField]) -> Gaussians:
    """The Gaussians of `fields` rendered as one scene (the shared set, then a user's own)."""
    if len(fields) == 1:
        return fields[0].gaussians()
    return Gaussians.joined(*(part.gaussians() for part in fields))
