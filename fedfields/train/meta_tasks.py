"""Meta-learning tasks for FedMeNF: a support set to adapt on and a query set to score on.

A task answers with stateless losses, `loss(model, params, batch)` through
`torch.func.functional_call`, so MAML and FedMeNF can differentiate through the inner loop
(FedMeNF Eq. 8-10). Two kinds:

- `CoordinateTask`: an image or video fitted by a SIREN. FedMeNF (Appendix E) defines a 2D
  task as *reconstructing* one image or video: support and query are the same full signal
  (as in Tancik et al.'s learned initialisations, its [58]); minibatches B_0..B_{K-1} and B_K
  are independent random pixel draws from it, and PSNR_p (Eq. 6) renders all its pixels.
- `RayTask`: one object's NeRF task: support views adapt the field, disjoint query views
  (new viewpoints) drive the outer loop and score novel-view synthesis (Appendix E.3-E.4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fedfields.data.scene import Scene, load_scene
from fedfields.data.tasks import ImageTask, VideoTask
from fedfields.fields.base import Field, FieldOutputs
from fedfields.geometry import Rays, pixel_rays
from fedfields.render import RenderConfig, render_image, render_rays

Parameters = Mapping[str, Tensor]


@runtime_checkable
class MetaTask(Protocol):
    """One task T = {S, Q} of a client (FedMeNF Sec. 3, Algorithm 1)."""

    @property
    def num_examples(self) -> int:
        """Supervised pixels of the task: its weight in the server's aggregate (Eq. 2)."""
        ...

    @property
    def query_targets(self) -> Tensor:
        """Every query target, shaped like `render_query`'s prediction."""
        ...

    def support_batch(self, size: int, generator: torch.Generator) -> Any:
        """A minibatch B_k of the support set S (all of it when `size` covers it)."""
        ...

    def query_batch(self, size: int, generator: torch.Generator) -> Any:
        """A minibatch B_K of the query set Q (all of it when `size` covers it)."""
        ...

    def loss(self, model: nn.Module, params: Parameters, batch: Any) -> Tensor:
        """MSE L(params, batch) of `model` run with `params`, differentiable in `params`."""
        ...

    def render_query(self, model: nn.Module, params: Parameters) -> Tensor:
        """The model's prediction of every query target, without gradients."""
        ...

    def query_images(self, values: Tensor) -> Tensor:
        """Query-shaped values as images [H, W, C] or [N, H, W, C] for SSIM and LPIPS."""
        ...


def sample_indices(count: int, size: int, generator: torch.Generator) -> Tensor:
    """`size` distinct indices below `count` drawn with `generator`; all of them in order when
    `size >= count` (a full batch is then deterministic)."""
    if size >= count:
        return torch.arange(count)
    return torch.randperm(count, generator=generator)[:size]


def _like(tensor: Tensor, params: Parameters) -> Tensor:
    """`tensor` on the device and in the floating dtype of the parameters."""
    reference = next(iter(params.values()))
    return tensor.to(device=reference.device, dtype=reference.dtype)


class CoordinateTask:
    """An image or video as a coordinate -> pixel task; support = query = the whole signal."""

    def __init__(self, task: ImageTask | VideoTask, chunk: int = 1 << 15) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.name = task.name
        self.coords = task.coords
        self.pixels = task.pixels
        self.shape = task.shape
        self.chunk = chunk

    @property
    def num_examples(self) -> int:
        return self.pixels.shape[0]

    @property
    def query_targets(self) -> Tensor:
        return self.pixels

    def support_batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        index = sample_indices(self.num_examples, size, generator)
        return self.coords[index], self.pixels[index]

    def query_batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return self.support_batch(size, generator)

    def loss(self, model: nn.Module, params: Parameters, batch: tuple[Tensor, Tensor]) -> Tensor:
        coords, pixels = batch
        prediction = functional_call(model, dict(params), (_like(coords, params),))
        return torch.nn.functional.mse_loss(prediction, _like(pixels, params))

    @torch.no_grad()
    def render_query(self, model: nn.Module, params: Parameters) -> Tensor:
        parts = [
            functional_call(model, dict(params), (_like(self.coords[start:end], params),))
            for start, end in _chunks(self.num_examples, self.chunk)
        ]
        return torch.cat(parts).cpu()

    def query_images(self, values: Tensor) -> Tensor:
        return values.reshape(self.shape)


def coordinate_tasks(
    tasks: Sequence[ImageTask | VideoTask], chunk: int = 1 << 15
) -> list[CoordinateTask]:
    """One `CoordinateTask` per image or video task (a client's D_train)."""
    return [CoordinateTask(task, chunk) for task in tasks]


class FunctionalField(Field):
    """A field evaluated with the parameters `params` (`torch.func.functional_call`).

    Lets the renderer run an inner-loop NF phi_k, so gradients flow back to the meta-learner.
    """

    def __init__(self, field: nn.Module, params: Parameters) -> None:
        super().__init__()
        self.field = field
        self.params = dict(params)

    def forward(
        self, points: Tensor, directions: Tensor, image_index: Tensor | None = None
    ) -> FieldOutputs:
        return functional_call(self.field, self.params, (points, directions, image_index))

    def density(self, points: Tensor) -> Tensor:
        return self.forward(points, torch.zeros_like(points)).density


class RayTask:
    """A NeRF object: rays of the support views adapt, rays of the query views score.

    Rendering is dense stratified sampling with `num_samples` per ray (no occupancy grid: it
    is stateful and not differentiable), jittered in training when `perturb`.
    """

    def __init__(
        self,
        support: Scene,
        query: Scene,
        num_samples: int = 32,
        perturb: bool = True,
        chunk: int = 4096,
    ) -> None:
        if num_samples < 1 or chunk < 1:
            raise ValueError(f"num_samples and chunk must be >= 1, got {num_samples}, {chunk}")
        for name, scene in (("support", support), ("query", query)):
            if len(scene) == 0:
                raise ValueError(f"the {name} scene has no views")
        self.support = support
        self.query = query
        self.perturb = perturb
        self.render_config = RenderConfig(
            near=support.near,
            far=support.far,
            aabb=tuple(support.aabb.flatten().tolist()),
            background=support.background,
            num_samples=num_samples,
            chunk=chunk,
        )

    @classmethod
    def from_object(
        cls,
        object_dir: str | Path,
        num_samples: int = 32,
        perturb: bool = True,
        downscale: float = 1.0,
    ) -> RayTask:
        """The task of an object-collection folder from its "support" and "query" frames."""
        return cls(
            load_scene(object_dir, split="support", downscale=downscale),
            load_scene(object_dir, split="query", downscale=downscale),
            num_samples=num_samples,
            perturb=perturb,
        )

    @property
    def num_examples(self) -> int:
        return _pixels(self.support) + _pixels(self.query)

    @property
    def query_targets(self) -> Tensor:
        return self.query.images

    def support_batch(self, size: int, generator: torch.Generator) -> tuple[Rays, Tensor]:
        return _ray_batch(self.support, sample_indices(_pixels(self.support), size, generator))

    def query_batch(self, size: int, generator: torch.Generator) -> tuple[Rays, Tensor]:
        return _ray_batch(self.query, sample_indices(_pixels(self.query), size, generator))

    def loss(self, model: nn.Module, params: Parameters, batch: tuple[Rays, Tensor]) -> Tensor:
        rays, colors = batch
        rays = Rays(_like(rays.origins, params), _like(rays.directions, params))
        rendered, _ = render_rays(
            FunctionalField(model, params), rays, self.render_config, perturb=self.perturb
        )
        return torch.nn.functional.mse_loss(rendered.rgb, _like(colors, params))

    @torch.no_grad()
    def render_query(self, model: nn.Module, params: Parameters) -> Tensor:
        field = FunctionalField(model, params)
        device = next(iter(params.values())).device
        cameras = self.query.cameras.to(device)
        views = [
            render_image(field, cameras, view, self.render_config).rgb.cpu()
            for view in range(len(self.query))
        ]
        return torch.stack(views)

    def query_images(self, values: Tensor) -> Tensor:
        return values


def _pixels(scene: Scene) -> int:
    return len(scene) * scene.cameras.height * scene.cameras.width


def _ray_batch(scene: Scene, flat: Tensor) -> tuple[Rays, Tensor]:
    """Rays and colours of pixels at flat indices (view-major, then row, then column)."""
    width = scene.cameras.width
    per_view = scene.cameras.height * width
    view, within = flat // per_view, flat % per_view
    rays = pixel_rays(scene.cameras, view, within // width, within % width)
    return rays, scene.images.reshape(-1, 3)[flat]


def _chunks(count: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, count)) for start in range(0, count, chunk)]
