"""Centralised training of a splat field: 3DGS's optimisation with gsplat's densification.

Each step renders one random training view (`fedfields.render.splatting.render_splats`) and
takes an L1 photometric loss (3DGS eq. 7 without its D-SSIM term) with one Adam per tensor at
3DGS's learning rates (means scaled by the scene's extent). gsplat's `DefaultStrategy` (the
3DGS paper's adaptive density control: clone small and split large Gaussians whose mean
view-space gradient passes its threshold, prune faint and huge ones, reset opacities) grows
and prunes the field in place; `max_gaussians` caps the count a node holds. The SH degree
in use rises by one every `sh_degree_every` steps, as in 3DGS.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedfields.data.scene import Scene
from fedfields.fields.splats import SplatField, SplatFieldConfig
from fedfields.render import RenderConfig
from fedfields.render.splatting import render_splats

LEARNING_RATES = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}
"""3DGS's Adam learning rates (means times the scene's extent; sh its degree-0 rate)."""


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
    seed: int = 0
    seconds: float | None = None  # wall-clock budget: stop after the step that passes it

    def __post_init__(self) -> None:
        for name in ("steps", "initial_count", "max_gaussians", "refine_every", "reset_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"splat training's {name} must be >= 1, got {getattr(self, name)}")
        if self.initial_count > self.max_gaussians:
            raise ValueError(
                f"initial_count {self.initial_count} is above max_gaussians {self.max_gaussians}"
            )


def optimisers(field: SplatField, extent: float) -> dict[str, torch.optim.Optimizer]:
    """One Adam per tensor, as gsplat's strategies expect (each with one parameter group)."""
    return {
        name: torch.optim.Adam(
            [
                {
                    "params": [parameter],
                    "lr": LEARNING_RATES[name] * (extent if name == "means" else 1.0),
                    "name": name,
                }
            ],
            eps=1e-15,
        )
        for name, parameter in field.params.items()
    }


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
    extent = float((scene.aabb[1] - scene.aabb[0]).norm()) / 2
    optimisers_by_name = optimisers(field, extent)
    strategy = DefaultStrategy(
        refine_start_iter=config.refine_start,
        refine_every=config.refine_every,
        reset_every=config.reset_every,
        refine_stop_iter=config.steps,
    )
    state = strategy.initialize_state(scene_scale=extent)
    background = torch.tensor(scene.background, device=field.means.device)
    start = time.perf_counter()
    for step in range(config.steps):
        if config.seconds is not None and time.perf_counter() - start > config.seconds:
            break
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
