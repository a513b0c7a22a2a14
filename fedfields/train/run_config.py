"""The federated job's settings, read from Flower run-config (dash-case keys) and validated.

Both the ServerApp and the ClientApp build their model from the same `FederatedConfig` so the
federated tensors agree; unknown keys and bad values fail with one clear error. `task` picks
the job: "scene" is the federated NeRF of a crowd (DecentNeRF and baselines), "faces",
"video" and "objects" are FedMeNF's federated meta-learning, whose per-task presets
(`META_PRESETS`, FedMeNF Table 7 where a CPU affords it) fill every meta key left at 0 or "".
The meta tasks' model, client tasks and held-out tasks are built here for both apps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from torch import nn

from fedfields.data.scene import Scene
from fedfields.data.tasks import LFW_FACES, VideoTask, client_tasks, gif_video, lfw_faces
from fedfields.fields import (
    HashGridConfig,
    HashGridField,
    HashGridFieldConfig,
    NeRFField,
    NeRFFieldConfig,
    Siren,
    SirenConfig,
)
from fedfields.privacy.secure_sum import SecureAggregationConfig
from fedfields.render import RenderConfig
from fedfields.train.meta import LEARNERS, OUTER_OPTIMIZERS, MetaConfig
from fedfields.train.meta_tasks import CoordinateTask, MetaTask, RayTask, coordinate_tasks

TASKS = ("scene", "faces", "video", "objects")
MODES = ("federated", "split")
META_TASKS = TASKS[1:]
STRATEGY_NAMES = ("decentnerf", "fedavg", "fedprox", "scaffold", "fedmenf")
HASH_BACKENDS = ("torch", "tcnn")
SCENE_FIELD_WIDTH = 64  # hidden width of the scene field's heads when `field-width` is 0


@dataclass(frozen=True)
class FederatedConfig:
    """Settings of one federated run; field names are the run-config keys in snake_case.

    Meta-learning keys left at 0 or "" take the task's preset (`meta_settings`).
    """

    task: str = "scene"  # scene | faces | video | objects
    strategy: str = ""  # "" -> decentnerf for the scene, fedmenf for the meta tasks
    num_server_rounds: int = 8
    local_steps: int = 32
    fraction_train: float = 0.5
    min_train_nodes: int = 2
    data_dir: str = ""  # simulation only: root of the virtual nodes' data (crowd, objects)
    run_dir: str = ""  # "" -> runs/<time>-<strategy> under the working directory
    downscale: float = 1.0
    learning_rate: float = 1e-2
    personal_learning_rate: float = 1e-2
    target_samples: int = 1 << 14
    personal_density_weight: float = 0.01
    proximal_mu: float = 0.01
    alpha_lr: float = 0.1  # eta; alphas move ~0.01-0.1 per round on the default field
    scaffold_global_lr: float = 1.0
    hash_log2_size: int = 15
    hash_levels: int = 16  # hash-grid levels (model shape: from run-config, never from images)
    hash_max_resolution: int = 400  # finest hash-grid resolution
    hash_backend: str = "torch"  # torch (everywhere) | tcnn (CUDA nodes with tinycudann)
    scene_bound: float = 1.5  # the global field's box is [-bound, bound]^3
    eval_views_per_round: int = 4  # simulation observer: user views scored per round
    client_eval_views: int = 1  # each sampled client scores the global field on its views
    eval_scene_dir: str = ""  # a public clean scene the server scores its field on
    round_timeout: float = 600.0  # seconds a round waits for replies and for enough nodes
    min_available_nodes: int = 0  # the first round waits for this many nodes (0: min-train)
    state_dir: str = ""  # simulation only: root of the virtual nodes' state directories
    simulation_audit: bool = False  # simulation only: attach the observers that read data-dir
    seed: int = 0
    # FedMeNF meta-learning (tasks faces, video, objects)
    meta_learner: str = "fedmenf"  # maml | fomaml | reptile | fedmenf
    gamma: float = 0.75  # FedMeNF's fixed gamma (Eq. 10); other learners use 0
    privacy_budget: float = 0.0  # zeta > 0: adaptive gamma (Eq. 13-14) instead of `gamma`
    clients_per_round: int = 5  # M
    num_clients: int = 0  # N
    outer_steps: int = 0  # E
    inner_steps: int = 0  # K
    inner_lr: float = 0.0  # lambda_i
    outer_lr: float = 0.0  # lambda_o
    outer_optimizer: str = ""  # sgd | adamw
    tto_steps: int = 0  # test-time optimisation steps, scored at 0, 1, 2, 4, ... and this
    tto_lr: float = 0.0  # Adam learning rate of test-time optimisation
    field_width: int = 0  # SIREN (faces, video) or NeRF MLP (objects) width
    field_depth: int = 0  # and depth
    privacy_audit: bool = True  # simulation only: the server scores uploads against the data
    # Split learning (SplitNeRF / S2NeRF, task scene): one client, server holds the hash grid
    mode: str = "federated"  # federated | split
    split_steps: int = 600  # server-client round trips, one batch each
    split_batch_rays: int = 256
    split_samples: int = 48  # stratified samples per ray (the client cannot march density)
    split_noise_c: float = 0.0  # S2NeRF gradient noise scale c (0: no defence)
    split_noise_r: float = 1e-4  # its decay over the run (1: constant)
    split_label_noise: float = 0.0  # NoisyLabel std sigma_l on the pixel colours (0: none)
    split_record_every: int = 20  # the server keeps every k-th exchange for the attack audit
    split_attack: bool = True  # simulation only: Surrogate Model Attack on the server's record
    # Secure aggregation with Flower SecAgg+ (every strategy)
    secure_aggregation: bool = False
    secagg_num_shares: float = 1.0  # fraction of the sampled clients (<= 1) or a count (> 2)
    secagg_reconstruction_threshold: float = 0.67  # fraction of the shares, or a count
    secagg_timeout: float = 600.0  # seconds per SecAgg+ stage (0: wait forever)
    secagg_clipping_range: float = 0.0  # 0: per-tensor bounds summed securely; > 0: fixed

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("task", self.task, TASKS),
            ("strategy", self.strategy, ("", *STRATEGY_NAMES)),
            ("meta_learner", self.meta_learner, LEARNERS),
            ("outer_optimizer", self.outer_optimizer, ("", *OUTER_OPTIMIZERS)),
            ("hash_backend", self.hash_backend, HASH_BACKENDS),
        ):
            if value not in allowed:
                raise ValueError(
                    f"run-config '{_dash(name)}' must be one of {allowed}, got {value!r}"
                )
        if self.task != "scene" and self.strategy == "decentnerf":
            raise ValueError(
                f"run-config 'strategy' 'decentnerf' is for task 'scene' only; task "
                f"{self.task!r} takes fedmenf, fedavg, fedprox or scaffold"
            )
        if self.task == "scene" and self.strategy == "fedmenf":
            raise ValueError("run-config 'strategy' 'fedmenf' is for the meta tasks, not 'scene'")
        for name in (
            "num_server_rounds",
            "local_steps",
            "min_train_nodes",
            "target_samples",
            "clients_per_round",
            "hash_levels",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"run-config '{_dash(name)}' must be >= 1, got {getattr(self, name)}"
                )
        for name in (
            "num_clients",
            "outer_steps",
            "inner_steps",
            "tto_steps",
            "field_width",
            "field_depth",
            "client_eval_views",
            "min_available_nodes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"run-config '{_dash(name)}' must be >= 0 (0: the task's preset), "
                    f"got {getattr(self, name)}"
                )
        if not 0.0 < self.fraction_train <= 1.0:
            raise ValueError(
                f"run-config 'fraction-train' must be in (0, 1], got {self.fraction_train}"
            )
        if not 10 <= self.hash_log2_size <= 22:
            raise ValueError(
                f"run-config 'hash-log2-size' must be in [10, 22], got {self.hash_log2_size}"
            )
        if not 16 <= self.hash_max_resolution <= 1 << 15:
            raise ValueError(
                "run-config 'hash-max-resolution' must be in [16, 32768], "
                f"got {self.hash_max_resolution}"
            )
        for name in ("scene_bound", "round_timeout"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(
                    f"run-config '{_dash(name)}' must be a finite number > 0, "
                    f"got {getattr(self, name)}"
                )
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"run-config 'gamma' must be in [0, 1], got {self.gamma}")
        for name in (
            "downscale",
            "learning_rate",
            "personal_learning_rate",
            "personal_density_weight",
            "proximal_mu",
            "alpha_lr",
            "scaffold_global_lr",
            "privacy_budget",
            "inner_lr",
            "outer_lr",
            "tto_lr",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "downscale" and value == 0):
                raise ValueError(
                    f"run-config '{_dash(name)}' must be a finite number >= 0, got {value}"
                )

        if self.mode not in MODES:
            raise ValueError(f"run-config 'mode' must be one of {MODES}, got {self.mode!r}")
        if self.mode == "split" and self.task != "scene":
            raise ValueError("run-config 'mode' 'split' trains a scene: set task 'scene'")
        for name in ("split_steps", "split_batch_rays", "split_samples", "split_record_every"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"run-config '{_dash(name)}' must be >= 1, got {getattr(self, name)}"
                )
        if not 0 < self.split_noise_r <= 1:
            raise ValueError(
                f"run-config 'split-noise-r' must be in (0, 1], got {self.split_noise_r}"
            )
        for name in ("split_noise_c", "split_label_noise"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(
                    f"run-config '{_dash(name)}' must be a finite number >= 0, "
                    f"got {getattr(self, name)}"
                )
        self.secure_aggregation_config()  # validates the secagg-* keys

    def secure_aggregation_config(self) -> SecureAggregationConfig | None:
        """The SecAgg+ settings when `secure-aggregation` is on, else None."""
        try:
            config = SecureAggregationConfig(
                num_shares=self.secagg_num_shares,
                reconstruction_threshold=self.secagg_reconstruction_threshold,
                timeout=self.secagg_timeout,
                clipping_range=self.secagg_clipping_range,
            )
        except ValueError as error:
            raise ValueError(f"run-config: {error}") from None
        return config if self.secure_aggregation else None

    @property
    def strategy_name(self) -> str:
        """The strategy to run: `strategy`, or the task's default when it is empty."""
        if self.strategy:
            return self.strategy
        return "decentnerf" if self.task == "scene" else "fedmenf"

    def to_run_config(self) -> dict[str, Any]:
        """The dash-case run-config dict that `from_run_config` reads back."""
        return {_dash(key): value for key, value in asdict(self).items()}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Parse Flower's run-config; unknown keys and wrong types raise one ValueError."""
        known = {_dash(f.name): f for f in fields(cls)}
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            raise ValueError(f"unknown run-config keys {unknown}; known keys: {sorted(known)}")
        values = {}
        for key, value in run_config.items():
            expected = type(getattr(cls(), known[key].name))
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
                raise ValueError(f"run-config '{key}' must be {expected.__name__}, got {value!r}")
            values[known[key].name] = value
        return cls(**values)


def _dash(name: str) -> str:
    return name.replace("_", "-")


def global_field(config: FederatedConfig) -> HashGridField:
    """The federated global field: an Instant-NGP hash grid over the run-config's box.

    Every tensor shape comes from run-config (levels, table size, finest resolution, widths),
    so the server and nodes with different cameras or hardware build identical tensors. A
    node that cannot run `hash-backend` raises one clear error (`resolve_implementation`).
    """
    encoding = HashGridConfig(
        num_levels=config.hash_levels,
        max_resolution=config.hash_max_resolution,
        log2_hashmap_size=config.hash_log2_size,
        implementation=config.hash_backend,  # type: ignore[arg-type]
    )
    width = config.field_width or SCENE_FIELD_WIDTH
    bound = config.scene_bound
    return HashGridField(
        HashGridFieldConfig(
            encoding=encoding,
            density_hidden=width,
            color_hidden=width,
            aabb=(-bound, -bound, -bound, bound, bound, bound),
        )
    )


def check_scene_fits(config: FederatedConfig, scene: Scene, where: str) -> None:
    """Raise ValueError when `scene`'s box leaves the field's run-config box (`scene-bound`)."""
    extent = float(scene.aabb.abs().max())
    if extent > config.scene_bound + 1e-6:
        raise ValueError(
            f"{where}: the scene's box reaches {extent:g}, outside run-config 'scene-bound' "
            f"{config.scene_bound:g}; raise 'scene-bound' for every node and the server"
        )


def render_config(config: FederatedConfig, scene: Scene | None) -> RenderConfig:
    """Occupancy-marching settings: the field's box, the scene's near/far and background
    (a server without a scene takes the NeRF-synthetic defaults)."""
    bound = config.scene_bound
    views = (
        {}
        if scene is None
        else {"near": scene.near, "far": scene.far, "background": scene.background}
    )
    return RenderConfig(
        aabb=(-bound, -bound, -bound, bound, bound, bound),
        step_size=2.0 * bound * math.sqrt(3) / 256,
        **views,
    )


# ------------------------------------------------------------------ FedMeNF meta-learning


@dataclass(frozen=True)
class MetaSettings:
    """A meta task's resolved settings: its preset with the run-config's non-zero keys."""

    num_clients: int  # N
    outer_steps: int  # E
    inner_steps: int  # K
    inner_lr: float  # lambda_i
    outer_lr: float  # lambda_o
    outer_optimizer: str
    tto_steps: int
    tto_lr: float
    field_width: int
    field_depth: int
    support_batch: int  # pixels or rays per inner batch B_k
    query_batch: int  # per outer batch B_K
    heldout_tasks: int  # tasks no client holds: the server's TTO evaluation


META_PRESETS = {
    # Table 7 PetFace: E=32, K=1, SGD, lambda_i=0.005, batch 1024; SIREN 6x128. lambda_o=0.001,
    # not 0.01: at 0.01 FedMeNF's theta drifts within 8 rounds until TTO from it is worse than
    # from a random SIREN. 25x25 grey LFW crops fit in 64 Adam steps, so TTO stops at 32.
    "faces": MetaSettings(
        num_clients=20,
        outer_steps=32,
        inner_steps=1,
        inner_lr=0.005,
        outer_lr=0.001,
        outer_optimizer="sgd",
        tto_steps=32,
        tto_lr=1e-4,
        field_width=128,
        field_depth=6,
        support_batch=1024,
        query_batch=1024,
        heldout_tasks=10,
    ),
    # Table 7 GolfDB: E=64, K=1, SGD, lambda_i=0.01, batch 2048; lambda_o=0.001 as for faces
    # (0.05 drifts the same way). One clip of the 24-frame 25x14 GIF per client
    # (`video_clips`), so N is small.
    "video": MetaSettings(
        num_clients=6,
        outer_steps=64,
        inner_steps=1,
        inner_lr=0.01,
        outer_lr=0.001,
        outer_optimizer="sgd",
        tto_steps=64,
        tto_lr=1e-4,
        field_width=128,
        field_depth=6,
        support_batch=2048,
        query_batch=2048,
        heldout_tasks=2,
    ),
    # Table 7 Cars: E=8, K=8, AdamW, lambda_i=0.001, 128 rays; a 4x128 NeRF with 32 samples
    # per ray instead of 6x256 x 128 points, and lambda_o=1e-3 (0.05 kills its density).
    "objects": MetaSettings(
        num_clients=20,
        outer_steps=8,
        inner_steps=8,
        inner_lr=0.001,
        outer_lr=1e-3,
        outer_optimizer="adamw",
        tto_steps=64,
        tto_lr=1e-3,
        field_width=128,
        field_depth=4,
        support_batch=128,
        query_batch=128,
        heldout_tasks=4,
    ),
}
"""Per-task defaults, used for every meta key the run-config leaves at 0 or ""."""


def meta_settings(config: FederatedConfig) -> MetaSettings:
    """The task's preset overridden by the run-config's non-zero meta keys; checks M <= N."""
    if config.task not in META_PRESETS:
        raise ValueError(f"task {config.task!r} is not a meta-learning task {META_TASKS}")
    names = {f.name for f in fields(MetaSettings)} & {f.name for f in fields(FederatedConfig)}
    overrides = {name: getattr(config, name) for name in names if getattr(config, name)}
    settings = replace(META_PRESETS[config.task], **overrides)
    if config.clients_per_round > settings.num_clients:
        raise ValueError(
            f"run-config 'clients-per-round' ({config.clients_per_round}) exceeds the "
            f"{settings.num_clients} clients of task {config.task!r} ('num-clients')"
        )
    return settings


def meta_config(
    config: FederatedConfig,
    settings: MetaSettings,
    *,
    outer_steps: int,
    proximal_mu: float,
    seed: int,
) -> MetaConfig:
    """One client's `MetaConfig`; gamma and the privacy budget reach FedMeNF only."""
    fedmenf = config.meta_learner == "fedmenf"
    return MetaConfig(
        learner=config.meta_learner,
        outer_steps=outer_steps,
        inner_steps=settings.inner_steps,
        inner_lr=settings.inner_lr,
        outer_lr=settings.outer_lr,
        outer_optimizer=settings.outer_optimizer,
        gamma=config.gamma if fedmenf else 0.0,
        privacy_budget=config.privacy_budget if fedmenf and config.privacy_budget > 0 else None,
        num_clients=settings.num_clients,
        rounds=config.num_server_rounds,
        clients_per_round=config.clients_per_round,
        support_batch=settings.support_batch,
        query_batch=settings.query_batch,
        proximal_mu=proximal_mu,
        seed=seed,
    )


def meta_model(config: FederatedConfig, settings: MetaSettings) -> nn.Module:
    """The meta-learned field: SIREN (x, y) -> grey or (t, x, y) -> RGB, or a NeRF MLP."""
    if config.task == "objects":
        nerf = NeRFFieldConfig(
            depth=settings.field_depth,
            width=settings.field_width,
            skips=(),
            position_frequencies=8,
            view_dependent=False,
        )
        return NeRFField(nerf)
    in_features, out_features = (2, 1) if config.task == "faces" else (3, 3)
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
    """Client `client`'s private tasks (its D_train): faces, one video clip, or one object.

    faces: the LFW faces outside the held-out ones, dealt IID to the N clients by `seed`;
    video: clip `client` of `video_clips` (both scikit-image's, picked by the client's index);
    objects: the object in `object_dir`, the client's own folder (its node's data-dir).
    """
    if not 0 <= client < settings.num_clients:
        raise ValueError(f"client {client} is outside the task's {settings.num_clients} clients")
    if config.task == "objects":
        if object_dir is None:
            raise ValueError(f"task 'objects': client {client} needs its own object folder")
        return [_object_task(Path(object_dir), config.downscale)]
    return list(
        _coordinate_tasks(config.task, settings.num_clients, settings.heldout_tasks, config.seed)[
            client
        ]
    )


def heldout_meta_tasks(config: FederatedConfig, settings: MetaSettings) -> list[MetaTask]:
    """The public tasks no client holds, for the server's test-time optimisation.

    faces and video: the last LFW faces or clips (scikit-image's data); objects: the first
    `heldout_tasks` object_* folders of run-config `eval-scene-dir`, none when it is empty
    (never `data-dir`, the clients' root: the server holds no client's object).
    """
    if config.task == "objects":
        folders = _eval_objects(config, settings)
        return [_object_task(folder, config.downscale) for folder in folders]
    return list(
        _coordinate_tasks(config.task, settings.num_clients, settings.heldout_tasks, config.seed)[
            -1
        ]
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


@lru_cache(maxsize=8)
def _coordinate_tasks(
    task: str, num_clients: int, heldout: int, seed: int
) -> tuple[tuple[CoordinateTask, ...], ...]:
    """Each client's faces or clip, then the held-out ones last (built once per process)."""
    if task == "video":
        clips = coordinate_tasks(video_clips(num_clients + heldout))
        return (*((clip,) for clip in clips[:num_clients]), tuple(clips[num_clients:]))
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
    if not config.eval_scene_dir:
        return []
    root = Path(config.eval_scene_dir)
    folders = sorted(folder for folder in root.glob("object_*") if folder.is_dir())
    if not folders:
        raise ValueError(
            f"run-config 'eval-scene-dir' {root}: no object_* folders; give a folder of public "
            "held-out objects (`fedfields data objects`)"
        )
    return folders[: settings.heldout_tasks]


@lru_cache(maxsize=64)
def _object_task(folder: Path, downscale: float) -> RayTask:
    """One object's support and query views, read once per process."""
    return RayTask.from_object(folder, downscale=downscale)
