"""What both apps build from the run-config (`fedfields.config`): the scene's global field
and render settings, and the meta tasks' model, client tasks and held-out tasks.

The ServerApp and the ClientApp call the same builders, so the federated tensors agree
whatever a node's images or hardware.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from fedfields.config import FederatedConfig, MetaSettings
from fedfields.data.scene import Scene, holdout_indices, load_scene
from fedfields.data.tasks import (
    LFW_FACES,
    VideoTask,
    client_tasks,
    gif_video,
    lfw_faces,
    photo_crops,
)
from fedfields.devices import parse_device
from fedfields.fields import (
    Field,
    HashGridConfig,
    HashGridField,
    HashGridFieldConfig,
    NeRFField,
    NeRFFieldConfig,
    PersonalFieldConfig,
    Siren,
    SirenConfig,
    SplatField,
    SplatFieldConfig,
)
from fedfields.fields.splats import relocate_dead
from fedfields.render import RenderConfig
from fedfields.train.meta import MetaConfig, test_time_optimise
from fedfields.train.meta_tasks import CoordinateTask, MetaTask, RayTask, coordinate_tasks

SCENE_FIELD_WIDTH = 64  # hidden width of the scene field's heads when `field-width` is 0
PAPER_MLP = NeRFFieldConfig(depth=8, width=256, skips=(4,), color_width=128, color_layers=4)
"""DecentNeRF's global field (its appendix C): 8 x 256 with NeRF's skip, then a colour MLP of
4 x 128; `field-depth` and `field-width` override depth and width."""
PAPER_PERSONAL_WIDTH = 128  # DecentNeRF's personal MLP: 4 layers of 128
PAPER_PERSONAL_LAYERS = 4
PERSONAL_POSITION_FREQUENCIES = 10  # NeRF's encoding of points, as the global MLP's
DENSE_CHUNK_SAMPLES = 1 << 18  # samples per forward pass when an MLP field renders a view
GRADIENT_CHUNK_SAMPLES = 1 << 16  # samples per backward pass of an MLP field's G_k
Quality = dict[str, float | None]  # psnr, ssim, lpips (None where not computed)


def global_field(config: FederatedConfig) -> Field:
    """The federated global field of run-config `scene-field`: an Instant-NGP hash grid over
    the run-config's box, or DecentNeRF's NeRF MLP (`PAPER_MLP`, `field-depth` x `field-width`).

    Every tensor shape comes from run-config (levels, table size, finest resolution, widths),
    so the server and nodes with different cameras or hardware build identical tensors. A
    node that cannot run `hash-backend` raises one clear error (`resolve_implementation`).
    A splat field's `splat-count` Gaussians start where the run's seed places them.
    """
    if config.scene.scene_field == "splats":
        return splat_field(config, config.scene.splat_count, config.common.seed)
    if config.scene.scene_field == "mlp":
        depth = config.common.field_depth or PAPER_MLP.depth
        return NeRFField(
            replace(
                PAPER_MLP,
                depth=depth,
                width=config.common.field_width or PAPER_MLP.width,
                skips=tuple(skip for skip in PAPER_MLP.skips if skip < depth - 1),
            )
        )
    return hash_grid_field(config)


def hash_grid_field(config: FederatedConfig) -> HashGridField:
    """The hash-grid global field (scene-field 'hashgrid', and split mode's joint field)."""
    encoding = HashGridConfig(
        num_levels=config.scene.hash_levels,
        max_resolution=config.scene.hash_max_resolution,
        log2_hashmap_size=config.scene.hash_log2_size,
        implementation=config.scene.hash_backend,  # type: ignore[arg-type]
    )
    width = config.common.field_width or SCENE_FIELD_WIDTH
    bound = config.scene.scene_bound
    return HashGridField(
        HashGridFieldConfig(
            encoding=encoding,
            density_hidden=width,
            color_hidden=width,
            aabb=(-bound, -bound, -bound, bound, bound, bound),
        )
    )


def splat_field(config: FederatedConfig, count: int, seed: int) -> SplatField:
    """`count` Gaussians of SH degree `splat-sh-degree` drawn uniformly in the run-config box
    from `seed`: the shared set (the run's seed) or a user's personal splats (its own)."""
    bound = config.scene.scene_bound
    return SplatField(
        SplatFieldConfig(
            count=count,
            sh_degree=config.scene.splat_sh_degree,
            aabb=(-bound, -bound, -bound, bound, bound, bound),
            seed=seed,
        )
    )


RELOCATION_STREAM = 1008
"""The `client_seed` slot of the server's relocation draws: no client has it (clients < 1008)."""
RELOCATED = "splats-relocated"
"""Round metric: the shared Gaussians a round's relocation moved (0 on rounds it skips)."""


def splat_relocation(
    config: FederatedConfig,
) -> Callable[[Mapping[str, Tensor], int], tuple[dict[str, Tensor], dict[str, float]]] | None:
    """The server's structure step for a splat field (`relocate_dead` every
    `splat-relocate-every` rounds, its draws seeded by the run's seed and the round), or None
    when the run never relocates. It reads only the round's aggregate."""
    every = config.scene.splat_relocate_every
    if not splats(config) or every == 0:
        return None
    min_opacity = config.scene.splat_min_opacity

    def relocate(
        state: Mapping[str, Tensor], server_round: int
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        if server_round % every != 0:
            return dict(state), {RELOCATED: 0.0}
        seed = client_seed(config.common.seed, RELOCATION_STREAM, server_round)
        moved, relocation = relocate_dead(
            dict(state), min_opacity, torch.Generator().manual_seed(seed)
        )
        return moved, {RELOCATED: float(len(relocation.dead))}

    return relocate


def splats(config: FederatedConfig) -> bool:
    """Whether the scene field is a set of Gaussians, rasterised rather than ray-marched."""
    return config.scene.scene_field == "splats"


def server_device(config: FederatedConfig) -> torch.device:
    """The ServerApp's own device (run-config `server-device`), checked against this process's
    CUDA devices: what the server's field, scores and observers run on."""
    return parse_device(config.common.server_device, "run-config 'server-device'")


def check_scene_fits(config: FederatedConfig, scene: Scene, where: str) -> None:
    """Raise ValueError when `scene`'s box leaves the field's run-config box (`scene-bound`)."""
    extent = float(scene.aabb.abs().max())
    if extent > config.scene.scene_bound + 1e-6:
        raise ValueError(
            f"{where}: the scene's box reaches {extent:g}, outside run-config 'scene-bound' "
            f"{config.scene.scene_bound:g}; raise 'scene-bound' for every node and the server"
        )


def client_seed(seed: int, client: int, server_round: int = 0) -> int:
    """The seed of one client's work in one round of run `seed` (round 0: what the client
    builds once, its personal field): seed * 100_003 + round * 1009 + client, distinct for
    every run, round and client while clients < 1009 and rounds < 99."""
    return seed * 100_003 + server_round * 1009 + client


def marches(config: FederatedConfig) -> bool:
    """Whether the scene field is rendered by occupancy-grid marching (the hash grid) rather
    than with stratified and hierarchical samples (the MLP, without a grid)."""
    return config.scene.scene_field == "hashgrid"


def personal_field_config(
    config: FederatedConfig, settings: RenderConfig, num_images: int
) -> PersonalFieldConfig:
    """A user's personal field over `settings`' box for `num_images` views: the small hash
    grid beside the hash-grid field, DecentNeRF's 4-layer personal MLP beside the MLP."""
    if marches(config):
        width = config.scene.personal_width or PersonalFieldConfig.hidden
        return PersonalFieldConfig(num_images=num_images, hidden=width, aabb=settings.aabb)
    return PersonalFieldConfig(
        num_images=num_images,
        hidden=config.scene.personal_width or PAPER_PERSONAL_WIDTH,
        density_layers=PAPER_PERSONAL_LAYERS,
        position_frequencies=PERSONAL_POSITION_FREQUENCIES,
        aabb=settings.aabb,
    )


def gradient_chunk_rays(config: FederatedConfig) -> int | None:
    """Rays per backward pass of a gradient query's G_k: all at once through the hash grid's
    occupancy grid, `GRADIENT_CHUNK_SAMPLES` worth of dense samples for the MLP (whose
    activations at 2,048 rays x 128 samples of 8 x 256 would take gigabytes)."""
    if marches(config):
        return None
    return max(
        1, GRADIENT_CHUNK_SAMPLES // (config.scene.mlp_samples + config.scene.mlp_importance)
    )


def render_config(config: FederatedConfig, scene: Scene | None) -> RenderConfig:
    """Sampling settings: the field's box, the scene's near/far and background (a server
    without a scene takes the NeRF-synthetic defaults), and the marching step (hash grid) or
    the stratified and hierarchical sample counts (MLP, `mlp-samples` + `mlp-importance`);
    splats take the box, bounds and background alone."""
    bound = config.scene.scene_bound
    views = (
        {}
        if scene is None
        else {"near": scene.near, "far": scene.far, "background": scene.background}
    )
    settings = RenderConfig(
        aabb=(-bound, -bound, -bound, bound, bound, bound),
        step_size=2.0 * bound * math.sqrt(3) / 256,
        **views,
    )
    if marches(config) or splats(config):
        return settings
    per_ray = config.scene.mlp_samples + config.scene.mlp_importance
    return replace(
        settings,
        num_samples=config.scene.mlp_samples,
        num_importance=config.scene.mlp_importance,
        chunk=max(1, DENSE_CHUNK_SAMPLES // per_ray),
    )


# ------------------------------------------------------------------ SplitNeRF (mode "split")

HOLDOUT_EVERY = 8  # every 8th view of the split client's scene is held out for evaluation
SCENE_PREFIX = "scene"  # a simulation data root holds scene_NN, one per virtual node


def is_scene(folder: Path) -> bool:
    """Whether `folder` holds a scene (transforms.json or transforms_<split>.json)."""
    return any(folder.glob("transforms*.json"))


def split_scene_dir(data_dir: str | Path) -> Path:
    """The split client's scene under run-config `data-dir`: the scene itself (the launcher's
    one virtual node) or its scene_00 folder (a root of scene_NN folders)."""
    root = Path(data_dir)
    return root if is_scene(root) else root / f"{SCENE_PREFIX}_00"


@lru_cache(maxsize=2)
def client_views(data_dir: str, downscale: float) -> tuple[Scene, Scene]:
    """(training views, held-out views) of the scene in `data_dir`, read once per process."""
    scene = load_scene(data_dir, downscale=downscale)
    train, heldout = holdout_indices(len(scene), HOLDOUT_EVERY)
    return scene.subset(train), scene.subset(heldout)


def joint_field(config: FederatedConfig) -> HashGridField:
    """The joint field as both sides initialise it: run-config's shapes, seeded by `seed`."""
    torch.manual_seed(config.common.seed)
    return hash_grid_field(config)


# ------------------------------------------------------------------ FedMeNF meta-learning


def meta_config(
    config: FederatedConfig,
    settings: MetaSettings,
    *,
    outer_steps: int,
    seed: int,
) -> MetaConfig:
    """One client's `MetaConfig`; gamma and the privacy budget reach FedMeNF only."""
    fedmenf = config.meta.meta_learner == "fedmenf"
    return MetaConfig(
        learner=config.meta.meta_learner,
        outer_steps=outer_steps,
        inner_steps=settings.inner_steps,
        inner_lr=settings.inner_lr,
        outer_lr=settings.outer_lr,
        outer_optimizer=settings.outer_optimizer,
        gamma=config.meta.gamma if fedmenf else 0.0,
        privacy_budget=config.meta.privacy_budget
        if fedmenf and config.meta.privacy_budget > 0
        else None,
        memorising_bound=config.meta.memorising_bound
        if fedmenf and config.meta.memorising_bound > 0
        else None,
        num_clients=settings.num_clients,
        rounds=config.common.num_server_rounds,
        clients_per_round=config.meta_clients_per_round,  # what the server samples
        support_batch=settings.support_batch,
        query_batch=settings.query_batch,
        seed=seed,
    )


def meta_model(config: FederatedConfig, settings: MetaSettings) -> nn.Module:
    """The meta-learned field: SIREN (x, y) -> grey (faces) or RGB (photos), (t, x, y) -> RGB
    (video), or a NeRF MLP (objects)."""
    if config.common.task == "objects":
        nerf = NeRFFieldConfig(
            depth=settings.field_depth,
            width=settings.field_width,
            skips=(),
            position_frequencies=8,
            view_dependent=False,
        )
        return NeRFField(nerf)
    in_features, out_features = {"faces": (2, 1), "photos": (2, 3)}.get(config.common.task, (3, 3))
    return Siren(
        SirenConfig(
            in_features=in_features,
            out_features=out_features,
            width=settings.field_width,
            depth=settings.field_depth,
        )
    )


def client_meta_tasks(
    config: FederatedConfig, settings: MetaSettings, client: int, object_dir: Path | None = None
) -> list[MetaTask]:
    """Client `client`'s private tasks (its D_train): faces, photo crops, a clip, or an object.

    faces: the LFW faces outside the held-out ones, dealt IID to the N clients by `seed`;
    photos: `PHOTOS_PER_CLIENT` crops of `photo_crops` (run-config photo-crop, photo-size), dealt
    the same way;
    video: clip `client` of `video_clips` (both scikit-image's, picked by the client's index);
    objects: the object in `object_dir`, the client's own folder (its node's data-dir).
    """
    if not 0 <= client < settings.num_clients:
        raise ValueError(f"client {client} is outside the task's {settings.num_clients} clients")
    if config.common.task == "objects":
        if object_dir is None:
            raise ValueError(f"task 'objects': client {client} needs its own object folder")
        return [_object_task(Path(object_dir), config.common.downscale)]
    return list(
        _coordinate_tasks(
            config.common.task,
            settings.num_clients,
            settings.heldout_tasks,
            config.common.seed,
            (config.meta.photo_crop, config.meta.photo_size),
        )[client]
    )


def heldout_meta_tasks(config: FederatedConfig, settings: MetaSettings) -> list[MetaTask]:
    """The public tasks no client holds, for the server's test-time optimisation.

    faces, photos and video: the last faces, crops or clips (scikit-image's data); objects:
    the first `heldout_tasks` object_* folders of run-config `eval-scene-dir`, none when it
    is empty (never `data-dir`, the clients' root: the server holds no client's object).
    """
    if config.common.task == "objects":
        folders = _eval_objects(config, settings)
        return [_object_task(folder, config.common.downscale) for folder in folders]
    return list(
        _coordinate_tasks(
            config.common.task,
            settings.num_clients,
            settings.heldout_tasks,
            config.common.seed,
            (config.meta.photo_crop, config.meta.photo_size),
        )[-1]
    )


def video_clips(num_clips: int) -> list[VideoTask]:
    """scikit-image's 24-frame GIF cut into `num_clips` consecutive clips of equal length."""
    video = gif_video()
    length = video.shape[0] // num_clips
    if length < 1:
        raise ValueError(f"the {video.shape[0]}-frame GIF cannot give {num_clips} clips")
    frames = video.frames().numpy()
    return [
        VideoTask.from_frames(f"{video.name}_clip_{i:02d}", frames[i * length : (i + 1) * length])
        for i in range(num_clips)
    ]


PHOTOS_PER_CLIENT = 2
"""Task photos: crops each client holds (its D_train), as PetFace's few images per client."""


@lru_cache(maxsize=8)
def _coordinate_tasks(
    task: str, num_clients: int, heldout: int, seed: int, photo: tuple[int, int]
) -> tuple[tuple[CoordinateTask, ...], ...]:
    """Each client's faces, crops or clip, then the held-out ones last (built once per
    process); `photo` is the photos' (crop, size) in pixels."""
    if task == "video":
        clips = coordinate_tasks(video_clips(num_clients + heldout))
        return (*((clip,) for clip in clips[:num_clients]), tuple(clips[num_clients:]))
    if task == "photos":
        crop, size = photo
        count = PHOTOS_PER_CLIENT * num_clients + heldout
        crops = coordinate_tasks(photo_crops(count, size=size, crop=crop, seed=seed))
        groups = client_tasks(crops[: len(crops) - heldout], num_clients, seed)
        return (*(tuple(group) for group in groups), tuple(crops[len(crops) - heldout :]))
    if num_clients + heldout > LFW_FACES:
        raise ValueError(
            f"{num_clients} clients and {heldout} held-out faces exceed the {LFW_FACES} LFW faces"
        )
    faces = coordinate_tasks(lfw_faces())
    pool, kept = faces[: LFW_FACES - heldout], faces[LFW_FACES - heldout :]
    groups = client_tasks(pool, num_clients, seed)
    return (*(tuple(group) for group in groups), tuple(kept))


def _eval_objects(config: FederatedConfig, settings: MetaSettings) -> list[Path]:
    """The public held-out object folders in run-config `eval-scene-dir` ([] if it is empty)."""
    if not config.common.eval_scene_dir:
        return []
    root = Path(config.common.eval_scene_dir)
    folders = sorted(folder for folder in root.glob("object_*") if folder.is_dir())
    if not folders:
        raise ValueError(
            f"run-config 'eval-scene-dir' {root}: no object_* folders; give a folder of public "
            "held-out objects (`fedfields data objects`)"
        )
    return folders[: settings.heldout_tasks]


def client_object_folder(data_dir: str | Path, client: int) -> Path:
    """Client `client`'s object folder under a simulation's `data-dir`, as its virtual node
    finds it (object_NN, or object_NNN as `fedfields data objects` names them)."""
    root = Path(data_dir)
    names = (f"object_{client:02d}", f"object_{client:03d}")
    return next((root / n for n in names if (root / n).is_dir()), root / names[0])


@lru_cache(maxsize=64)
def _object_task(folder: Path, downscale: float) -> RayTask:
    """One object's support and query views, read once per process."""
    return RayTask.from_object(folder, downscale=downscale)


def tto_schedule(max_steps: int) -> tuple[int, ...]:
    """TTO step counts scored: 0, 1, 2, 4, ... below `max_steps`, then `max_steps`."""
    steps, power = [0], 1
    while power < max_steps:
        steps.append(power)
        power *= 2
    return (*steps, max_steps) if max_steps > 0 else (0,)


def tto_qualities(
    model: nn.Module,
    state: dict[str, Tensor],
    task: MetaTask,
    config: FederatedConfig,
    settings: MetaSettings,
) -> dict[int, Quality]:
    """`fedfields.train.meta.test_time_optimise` from `state` with the task's preset schedule."""
    return test_time_optimise(
        model,
        state,
        task,
        tto_schedule(settings.tto_steps),
        learning_rate=settings.tto_lr,
        batch_size=settings.support_batch,
        seed=config.common.seed,
    )


def mean_quality(qualities: Sequence[Quality]) -> Quality:
    """Key-wise mean; a key that some entry lacks a value for (None) stays None."""
    means: Quality = {}
    for key in qualities[0]:
        values = [quality[key] for quality in qualities]
        means[key] = None if any(v is None for v in values) else float(np.mean(values))
    return means


def as_image_batch(images: Tensor) -> Tensor:
    """[N, H, W, C] as it is, one [H, W, C] image as a batch of one."""
    return images if images.ndim == 4 else images[None]
