"""Scene-aided Surrogate Model Attack (paper 000, Sec. 4.2): pose a leaked image, fine-tune.

The attacker holds one training image without its pose. It renders the scene (server part +
surrogate head) from a grid of candidate poses, keeps the pose whose grey render is most
similar to the grey leaked image (SSIM, a Sec. 5.1 fidelity metric; grey because the plain
attack's colours are its least reliable part), and fine-tunes the surrogate head on the
image at that pose with the client's loss (MSE through the frozen server part).

Deviation: the paper grids camera positions over [-1, 1]^3 and viewing directions over the
whole sphere in FOV-sized steps (about 4e5 poses at granularity 0.1). Here the candidates are
cameras on a sphere around the scene looking at its centre (`sphere_poses`: azimuth x
elevation, world up +z as in the Blender scenes), which is where object-centric captures put
them; the server can read the sphere's radius off the ray origins it is sent.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from fedfields.geometry.cameras import Cameras, look_at
from fedfields.geometry.rays import image_rays
from fedfields.metrics.image import ssim
from fedfields.privacy.attacks.surrogate import grey_view, render_split_view
from fedfields.privacy.split import (
    ClientPart,
    ServerPart,
    render_embeddings,
    sample_rays,
    server_forward,
)
from fedfields.render.renderer import RenderConfig


def sphere_poses(
    radius: float,
    azimuths: Sequence[float],
    elevations: Sequence[float],
    center: Sequence[float] = (0.0, 0.0, 0.0),
) -> Tensor:
    """Candidate poses [A*E, 4, 4] on a sphere facing its centre; angles in degrees, up +z."""
    centre = torch.tensor(center, dtype=torch.float32)
    poses = []
    for elevation in elevations:
        for azimuth in azimuths:
            a, e = math.radians(azimuth), math.radians(elevation)
            offset = torch.tensor(
                [math.cos(e) * math.cos(a), math.cos(e) * math.sin(a), math.sin(e)]
            )
            poses.append(look_at(centre + radius * offset, centre))
    return torch.stack(poses)


def pose_error(estimate: Tensor, truth: Tensor) -> tuple[float, float]:
    """(camera-centre distance, rotation angle in degrees) between two camera-to-world poses."""
    distance = torch.linalg.vector_norm(estimate[:3, 3] - truth[:3, 3]).item()
    relative = estimate[:3, :3].T @ truth[:3, :3]
    cosine = ((torch.trace(relative) - 1.0) / 2.0).clamp(-1.0, 1.0)
    return distance, math.degrees(math.acos(cosine.item()))


def posed_cameras(intrinsics: Cameras, poses: Tensor) -> Cameras:
    """Cameras with the first camera's intrinsics at each of `poses` [N, 4, 4]."""
    count = poses.shape[0]
    return Cameras(
        camera_to_world=poses.to(intrinsics.camera_to_world),
        fx=intrinsics.fx[:1].expand(count),
        fy=intrinsics.fy[:1].expand(count),
        cx=intrinsics.cx[:1].expand(count),
        cy=intrinsics.cy[:1].expand(count),
        width=intrinsics.width,
        height=intrinsics.height,
    )


@dataclass
class PoseSearch:
    """The grid search's pick: candidate index, its pose and every candidate's grey SSIM."""

    index: int
    pose: Tensor  # [4, 4] camera-to-world
    scores: Tensor  # [N] SSIM of each candidate's grey render against the grey leaked image


def search_pose(
    server: ServerPart,
    head: ClientPart,
    image: Tensor,
    intrinsics: Cameras,
    candidates: Tensor,
    render_config: RenderConfig,
) -> PoseSearch:
    """Grid search (Sec. 4.2.2): the candidate pose whose grey render best matches `image`.

    `image` [H, W, 3] in [0, 1]; `intrinsics` holds the leaked camera's intrinsics (its
    first camera; the pose there is ignored); `candidates` [N, 4, 4] camera-to-world.
    """
    count = candidates.shape[0]
    cameras = posed_cameras(intrinsics, candidates)
    leaked = grey_view(image.cpu())[..., None]
    renders = (render_split_view(server, head, cameras, i, render_config) for i in range(count))
    scores = torch.tensor([ssim(grey_view(r.rgb)[..., None], leaked) for r in renders])
    index = int(scores.argmax())
    return PoseSearch(index=index, pose=candidates[index].clone(), scores=scores)


@dataclass
class SceneAidedConfig:
    """Fine-tuning the surrogate head on the posed leaked image: Adam steps and rate."""

    steps: int = 100
    learning_rate: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


@dataclass
class SceneAidedResult:
    """The fine-tuned head, the pose search it used and the fine-tuning losses."""

    head: ClientPart
    search: PoseSearch
    losses: list[float] = field(default_factory=list)


def fine_tune(
    server: ServerPart,
    head: ClientPart,
    image: Tensor,
    camera: Cameras,
    render_config: RenderConfig,
    config: SceneAidedConfig,
) -> tuple[ClientPart, list[float]]:
    """A copy of `head` trained on all pixels of `image` seen from `camera` (its first view).

    The server part stays frozen; samples are jittered every step as in training.
    """
    torch.manual_seed(config.seed)
    device = next(server.parameters()).device
    tuned = copy.deepcopy(head).to(device)
    optimizer = torch.optim.Adam(tuned.parameters(), lr=config.learning_rate, eps=1e-15)
    rays = image_rays(camera.to(device), 0)
    targets = image.reshape(-1, 3).to(device)
    background = torch.tensor(render_config.background, device=device)
    losses = []
    for _ in range(config.steps):
        samples = sample_rays(rays, render_config, perturb=True)
        embeddings = server_forward(server, samples.points())
        rendered = render_embeddings(tuned, embeddings, samples, background)
        loss = F.mse_loss(rendered.rgb, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return tuned, losses


def scene_aided_attack(
    server: ServerPart,
    head: ClientPart,
    image: Tensor,
    intrinsics: Cameras,
    candidates: Tensor,
    render_config: RenderConfig,
    config: SceneAidedConfig,
) -> SceneAidedResult:
    """Pose the leaked `image` by grid search, then fine-tune a copy of `head` on it."""
    search = search_pose(server, head, image, intrinsics, candidates, render_config)
    camera = posed_cameras(intrinsics, search.pose[None])
    tuned, losses = fine_tune(server, head, image, camera, render_config, config)
    return SceneAidedResult(head=tuned, search=search, losses=losses)
