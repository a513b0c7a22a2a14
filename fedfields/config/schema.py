"""The run-config schema: one validated dataclass per section, read from Flower's dash-case keys.

Flower passes every key of pyproject's `[tool.flwr.app.config]` (defaults merged with
`--run-config` overrides) to both apps, so `FederatedConfig.from_run_config` sees all sections
at once. It refuses unknown keys (with the closest known one), values of the wrong type or
range (naming the key and value), a key of a section this run does not use changed from
its default (naming the task or mode that uses it), and values that contradict each other
(secure aggregation with fewer than 3 clients per round, more clients per round than nodes,
a robust aggregation rule the strategy or secure aggregation cannot take), all before
anything runs. Field names are the keys in snake_case;
each field's `metadata["doc"]` is its line in docs/RUN_CONFIG.md (`fedfields.config.reference`);
each strategy's own keys come from the App's registry (`from_run_config`'s `strategies`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, ClassVar

from fedfields.compression import SCHEMES, CompressionConfig
from fedfields.devices import DEVICE_CHOICES, is_device_text
from fedfields.methods.settings import StrategySettings, typed_value
from fedfields.privacy.adaptive_clipping import AdaptiveClipping
from fedfields.privacy.dp import DPConfig
from fedfields.privacy.secagg_plan import MAX_TIMEOUT_SECONDS, SecureAggregationConfig

TASKS = ("scene", "faces", "photos", "video", "objects")
META_TASKS = TASKS[1:]
MODES = ("federated", "split")
HASH_BACKENDS = ("auto", "torch", "triton", "tcnn")
SCENE_FIELDS = ("hashgrid", "mlp", "splats")
LEARNERS = ("maml", "fomaml", "reptile", "fedmenf")
OUTER_OPTIMIZERS = ("sgd", "adamw")
AGGREGATION_RULES = ("mean", "trimmed-mean", "median", "krum", "multi-krum", "bulyan")
KRUM_RULES = ("krum", "multi-krum", "bulyan")
"""The rules that read `num-malicious` (f)."""
SECURE_MIN_CLIENTS = 3
"""SecAgg+ among two clients shows each the other's values (the sum minus its own)."""
StrategyTable = Mapping[str, type[StrategySettings]]
"""The App's registry as the schema sees it: strategy name -> its settings class."""
FEDERATED_ONLY = (
    "strategy",
    "num-server-rounds",
    "eval-scene-dir",
    "local-steps",
    "fraction-train",
    "learning-rate",
    "personal-learning-rate",
    "target-samples",
    "cuda-graph",
    "personal-density-weight",
    "beta-min",
    "eval-views-per-round",
    "client-eval-views",
    "min-train-nodes",
    "scene-field",
    "personal-width",
)
"""Keys of the common, scene and deployment sections that split mode never reads (nor any
strategy's own key): its one client trains `split-steps` exchanges with settings of its own
(the secure and robust sections are unused there as a whole)."""
FEDMENF_KEYS = ("gamma", "privacy-budget", "memorising-bound")
"""Meta keys only FedMeNF's local loss reads (Eq. 10-14); MAML, FOMAML and Reptile have none."""
SECAGG_KEYS = (
    "secagg-num-shares",
    "secagg-reconstruction-threshold",
    "secagg-timeout",
    "secagg-clipping-range",
    "secagg-max-exponent",
)
COMPRESSION_STRENGTHS = {
    "compression-rank": "lowrank",
    "compression-bits": "quantise",
    "compression-fraction": "topk",
}
"""Each compression strength -> the scheme that reads it."""
ADAPTIVE_KEYS = ("dp-target-quantile", "dp-clip-norm-lr", "dp-clipped-count-stddev")
"""Keys only read beside dp-adaptive-clipping = true."""
DP_KEYS = (
    "dp-clip-norm",
    "dp-delta",
    "dp-target-epsilon",
    "dp-max-noise-ratio",
    "dp-adaptive-clipping",
    "dp-gradient-clip-norm",
    *ADAPTIVE_KEYS,
)
"""Keys only read beside dp-noise-multiplier > 0."""


MAX_SEED = (1 << 31) - 1
"""Largest run-config seed: every generator derived from it (torch's, numpy's, the client and
download seeds, which add rounds and users to multiples of it) stays in range."""
MAX_COUNT = 1_000_000
"""Largest round and local-step count: work grows with them, and a larger plan is a typo."""
MAX_VIEWS = 10_000
"""Largest count of views scored per round: more than any crowd holds."""
MAX_ORBIT_FRAMES = 360
"""Most frames in the final orbit: one a degree."""
MAX_LEARNING_RATE = 0.1
"""Largest Adam learning rate of the scene's fields: at 1.0 the personal field's loss is NaN
after one step (issue 57's extremes walk)."""
MAX_PHOTO_PIXELS = 1024
"""Largest photo-crop and photo-size: the largest bundled photo's side."""
MIN_PHOTO_PIXELS = 7
"""Least photo-size: SSIM's 7-pixel window must fit in a crop."""
MAX_META_LEARNING_RATE = 1.0
"""Largest inner, outer and test-time learning rate of the meta tasks: at 1e300 the first
step overflows float32 (issue 57's extremes walk; 1.0 runs)."""
MAX_MEMORISING_BOUND = 1e6
"""Largest memorising bound: an MSE of images in [0, 1] is at most 1, so any bound above it
is no bound; at 1e300 the clamp overflows float32."""
MAX_CLIENTS = 1_000_000
"""Largest num-clients and clients-per-round: a task's data refuses what it cannot split."""
HASH_KEYS = ("hash-log2-size", "hash-levels", "hash-max-resolution", "hash-backend")
MLP_KEYS = ("mlp-samples", "mlp-importance")
SPLATS_UNREAD = (
    "field-width",
    "personal-width",
    "learning-rate",
    "personal-learning-rate",
    "target-samples",
    "beta-min",
)
"""Scene keys a splat field does not read: its rates are 3DGS's, its batch one view."""
SPLAT_KEYS = (
    "splat-count",
    "splat-sh-degree",
    "personal-splat-count",
    "splat-relocate-every",
    "splat-min-opacity",
    "splat-opacity-weight",
    "splat-appearance",
)
MAX_SPLATS = 1 << 22
"""Most Gaussians in a federated splat set: 4M, about 1 GB of float32 per copy at SH degree 3."""
MAX_SPLIT_RAYS = 1 << 16
MAX_RAY_SAMPLES = 1024
MAX_SPLIT_NOISE = 100.0
"""Largest S2NeRF noise scale c (the paper's 1.2) and NoisyLabel std: at 1e300 the client's
gradient is not finite and the split run stops at its first exchange."""


def key(default: Any, doc: str) -> Any:
    """A section field: its default and its one-line documentation."""
    return field(default=default, metadata={"doc": doc})


def dash(name: str) -> str:
    """The run-config key of a field name."""
    return name.replace("_", "-")


def _check(section: Any, names: Iterable[str], ok: Callable[[Any], bool], rule: str) -> None:
    """Raise ValueError naming the first key among `names` whose value breaks `rule`."""
    for name in names:
        value = getattr(section, name)
        if not ok(value):
            raise ValueError(f"run-config '{dash(name)}' must be {rule}, got {value!r}")


def _choice(section: Any, name: str, allowed: tuple[str, ...]) -> None:
    """Raise ValueError unless the key `name` is one of `allowed`."""
    if getattr(section, name) not in allowed:
        raise ValueError(
            f"run-config '{dash(name)}' must be one of {allowed}, got {getattr(section, name)!r}"
        )


def _finite(least: float) -> Callable[[Any], bool]:
    return lambda value: math.isfinite(value) and value >= least


@dataclass(frozen=True)
class CommonSection:
    """Keys every task and mode reads; field-width and field-depth size the scene's heads and
    the meta tasks' MLPs alike. Each strategy's own keys are its own (section "strategies")."""

    title: ClassVar[str] = "common"
    used_by: ClassVar[str] = "every task and mode"

    task: str = key("scene", "scene (federated NeRF) | faces | photos | video | objects (FedMeNF)")
    mode: str = key("federated", "federated | split (SplitNeRF, task scene, one client)")
    strategy: str = key(
        "",
        '"" = decentnerf (scene) or fedmenf (meta tasks); else a name in the App\'s registry '
        "(docs/RUN_CONFIG.md, strategies)",
    )
    num_server_rounds: int = key(8, "federated rounds")
    seed: int = key(
        0,
        "0 to 2^31 - 1: seeds the initial model, the server's node sampling (over stable user "
        "keys, so one seed gives one run, through Ray too) and local randomness",
    )
    run_dir: str = key("", '"" -> runs/<UTC time>-<strategy> in the working directory')
    resume: bool = key(False, "continue run-dir's run from its last completed round")
    downscale: float = key(1.0, "image downscale factor the nodes apply to their views")
    field_width: int = key(0, "scene field heads (0: 64) or meta MLP width (0: the preset)")
    field_depth: int = key(0, "meta MLP depth (0: the task's preset)")
    eval_scene_dir: str = key(
        "", "a public clean scene (objects: held-out object folders) the server scores on"
    )
    server_device: str = key(
        "auto",
        "the ServerApp's device (its field's scores, eval-scene-dir, observers): auto (CUDA "
        "when the server sees one) | cpu | cuda | cuda:N; each node's is its node-config device",
    )

    def __post_init__(self) -> None:
        _choice(self, "task", TASKS)
        if not is_device_text(self.server_device):
            raise ValueError(
                f"run-config 'server-device' must be {DEVICE_CHOICES}, got {self.server_device!r}"
            )
        _choice(self, "mode", MODES)
        _check(self, ["num_server_rounds"], lambda v: 1 <= v <= MAX_COUNT, f"in [1, {MAX_COUNT}]")
        _check(self, ["seed"], lambda v: 0 <= v <= MAX_SEED, f"in [0, {MAX_SEED}]")
        if self.resume and not self.run_dir:
            raise ValueError("run-config 'resume' = true needs 'run-dir': the run to continue")
        if self.resume and self.mode == "split":
            raise ValueError("run-config 'resume' = true: split runs (mode 'split') do not resume")
        _check(self, ["field_width"], lambda v: 0 <= v <= 4096, "in [0, 4096]")
        _check(self, ["field_depth"], lambda v: 0 <= v <= 64, "in [0, 64]")
        _check(self, ["downscale"], lambda v: 0.5 <= v <= 16, "in [0.5, 16]")
        if self.mode == "split" and self.task != "scene":
            raise ValueError("run-config 'mode' 'split' trains a scene: set task 'scene'")


@dataclass(frozen=True)
class SceneSection:
    """The federated NeRF of a crowd (DecentNeRF and baselines); split mode builds its field
    from the hash-grid keys too. Every tensor shape comes from here, never from images."""

    title: ClassVar[str] = "scene"
    used_by: ClassVar[str] = "task='scene'"

    local_steps: int = key(32, "local optimiser steps per round")
    fraction_train: float = key(0.5, "share of the connected users sampled per round")
    learning_rate: float = key(0.01, "Adam learning rate of the global field")
    personal_learning_rate: float = key(0.01, "DecentNeRF personal field and embeddings")
    target_samples: int = key(16384, "field samples per local step (sets the ray batch)")
    personal_density_weight: float = key(0.01, "NeRF-W lambda_u on personal density")
    beta_min: float = key(
        0.3,
        "NeRF-W floor of the personal uncertainty beta (NeRF-W's 0.03 starves the global "
        "field at a CPU budget: docs/BENCHMARKS.md)",
    )
    scene_field: str = key(
        "hashgrid",
        "hashgrid (Instant-NGP grid, occupancy marching) | mlp (DecentNeRF's paper fields: a "
        "NeRF MLP of field-depth x field-width, 0: 8 x 256, with a 4 x 128 colour head; a "
        "personal 4-layer MLP of personal-width; mlp-samples stratified + mlp-importance "
        "resampled samples per ray, no occupancy grid; dynamic steps only) | splats (3D "
        "Gaussians of splat-count, rasterised; one view per local step at 3DGS's rates; "
        "docs/SPLATS.md)",
    )
    splat_count: int = key(
        4096,
        "scene-field splats: Gaussians in the shared set, their count fixed for the run (the "
        "run's seed places them uniformly in the scene-bound box)",
    )
    splat_relocate_every: int = key(
        0,
        "scene-field splats: every this many rounds the server moves the shared set's dead "
        "Gaussians (opacity at most splat-min-opacity) onto live ones drawn by opacity, "
        "3DGS-MCMC's relocation, from the aggregate alone; 0: never (docs/SPLATS.md)",
    )
    splat_min_opacity: float = key(
        0.005, "scene-field splats: the opacity at or below which a shared Gaussian is dead"
    )
    splat_opacity_weight: float = key(
        0.0,
        "scene-field splats: weight of the shared Gaussians' mean opacity in the local loss "
        "(3DGS-MCMC's opacity regulariser, 0.01 there), so Gaussians no view needs fade and "
        "relocate",
    )
    splat_sh_degree: int = key(1, "scene-field splats: spherical-harmonic degree of colour, 0-3")
    personal_splat_count: int = key(
        1024, "scene-field splats: a user's personal Gaussians (DecentNeRF), kept on its node"
    )
    splat_appearance: bool = key(
        False,
        "scene-field splats: DecentNeRF's users also keep a colour map per view (an affine "
        "appearance, SplatAppearance) on their node, so exposure stays out of the shared set",
    )
    mlp_samples: int = key(64, "scene-field mlp: stratified samples per ray (paper 64)")
    mlp_importance: int = key(64, "scene-field mlp: hierarchical resamples per ray (paper 64)")
    personal_width: int = key(
        0, "personal field hidden width (0: 32 for hashgrid, the paper's 128 for mlp)"
    )
    hash_log2_size: int = key(15, "global hash table size per level, log2")
    hash_levels: int = key(16, "hash-grid levels")
    hash_max_resolution: int = key(400, "finest hash-grid resolution")
    hash_backend: str = key(
        "auto",
        "auto (triton on a CUDA node, torch on CPU) | torch | triton (a node without CUDA "
        "refuses) | tcnn (needs tinycudann+CUDA; federates only with tcnn nodes)",
    )
    cuda_graph: bool = key(
        False,
        "static-shape local steps captured once per batch shape as CUDA graphs, kept for the "
        "node process's whole run (a Ray actor's users and rounds refill them in place; "
        "DecentNeRF's "
        "personal field and the method's client hooks inside the graph; a buffer of 4/3 "
        "target-samples, the batch sized at each occupancy refresh); a node without CUDA runs "
        "them uncaptured",
    )
    scene_bound: float = key(1.5, "the global field's box: [-bound, bound]^3")
    eval_views_per_round: int = key(4, "simulation observer: user views it scores per round")
    client_eval_views: int = key(1, "views each user holds out and scores the global field on")
    orbit_frames: int = key(
        16,
        "frames of the server's final orbit.gif (64x64 each, about 0.07 s a frame on one CPU "
        "thread for a small field); 0: no orbit, for sweeps of many runs",
    )

    def __post_init__(self) -> None:
        _choice(self, "hash_backend", HASH_BACKENDS)
        _choice(self, "scene_field", SCENE_FIELDS)
        _check(self, ["mlp_samples"], lambda v: 1 <= v <= MAX_RAY_SAMPLES,
               f"in [1, {MAX_RAY_SAMPLES}]")  # fmt: skip
        _check(self, ["mlp_importance"], lambda v: 0 <= v <= MAX_RAY_SAMPLES,
               f"in [0, {MAX_RAY_SAMPLES}]")  # fmt: skip
        _check(self, ["personal_width"], lambda v: 0 <= v <= 4096, "in [0, 4096]")
        if self.scene_field != "hashgrid" and self.cuda_graph:
            raise ValueError(
                f"run-config 'cuda-graph' = true needs 'scene-field' 'hashgrid': the "
                f"{self.scene_field} field trains without an occupancy grid, in dynamic steps"
            )
        _check(self, ["splat_count", "personal_splat_count"], lambda v: 1 <= v <= MAX_SPLATS,
               f"in [1, {MAX_SPLATS}]")  # fmt: skip
        _check(self, ["splat_sh_degree"], lambda v: 0 <= v <= 3, "in [0, 3]")
        _check(self, ["splat_relocate_every"], lambda v: 0 <= v <= MAX_COUNT,
               f"in [0, {MAX_COUNT}]")  # fmt: skip
        _check(self, ["splat_min_opacity"], lambda v: 0 < v < 1, "in (0, 1)")
        _check(self, ["splat_opacity_weight"], lambda v: 0 <= v <= 1e3, "in [0, 1000]")
        _check(self, ["local_steps"], lambda v: 1 <= v <= MAX_COUNT, f"in [1, {MAX_COUNT}]")
        _check(self, ["target_samples"], lambda v: 1 <= v <= 1 << 22, "in [1, 4194304]")
        _check(self, ["hash_levels"], lambda v: 1 <= v <= 32, "in [1, 32]")
        _check(
            self, ["eval_views_per_round"], lambda v: 1 <= v <= MAX_VIEWS, f"in [1, {MAX_VIEWS}]"
        )
        _check(self, ["client_eval_views"], lambda v: 0 <= v <= MAX_VIEWS, f"in [0, {MAX_VIEWS}]")
        _check(self, ["orbit_frames"], lambda v: 0 <= v <= MAX_ORBIT_FRAMES,
               f"in [0, {MAX_ORBIT_FRAMES}]")  # fmt: skip
        _check(self, ["fraction_train"], lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        _check(self, ["hash_log2_size"], lambda v: 10 <= v <= 22, "in [10, 22]")
        _check(self, ["hash_max_resolution"], lambda v: 16 <= v <= 1 << 15, "in [16, 32768]")
        _check(self, ["scene_bound"], lambda v: 0 < v <= 100, "in (0, 100]")
        _check(self, ["beta_min"], lambda v: 1e-3 <= v <= 10, "in [0.001, 10]")
        rates = ["learning_rate", "personal_learning_rate"]
        _check(self, rates, lambda v: 0 <= v <= MAX_LEARNING_RATE, f"in [0, {MAX_LEARNING_RATE}]")
        _check(self, ["personal_density_weight"], lambda v: 0 <= v <= 1000, "in [0, 1000]")


@dataclass(frozen=True)
class MetaSection:
    """FedMeNF's federated meta-learning; 0 or "" takes the task's preset
    (`fedfields.config.presets.META_PRESETS`, FedMeNF Table 7 where a CPU affords it)."""

    title: ClassVar[str] = "meta"
    used_by: ClassVar[str] = "task='faces' | 'photos' | 'video' | 'objects'"

    meta_learner: str = key("fedmenf", "maml | fomaml | reptile | fedmenf")
    gamma: float = key(0.75, "FedMeNF's fixed gamma (Eq. 10)")
    privacy_budget: float = key(0.0, "zeta > 0: adaptive gamma (Eq. 13-14) instead of gamma")
    memorising_bound: float = key(
        0.15,
        "FedMeNF's L(w) in Eq. 10 clamped at this MSE (0: unbounded, the paper's Eq. 10; why "
        "0.15: docs/BENCHMARKS.md, Defaults as measured)",
    )
    clients_per_round: int = key(5, "M, clients sampled per round")
    num_clients: int = key(0, "N (faces 20, photos 20, video 6, objects 20)")
    outer_steps: int = key(0, "E (faces 32, photos 32, video 64, objects 8)")
    inner_steps: int = key(0, "K (1, 1, 1, 8)")
    inner_lr: float = key(0.0, "lambda_i (0.005, 0.005, 0.01, 0.001)")
    outer_lr: float = key(0.0, "lambda_o (0.001, 0.01, 0.001, 0.001)")
    outer_optimizer: str = key("", "sgd | adamw (sgd, sgd, sgd, adamw)")
    tto_steps: int = key(
        0, "test-time optimisation steps, scored at 0, 1, 2, 4, ... (32, 64, 64, 64)"
    )
    tto_lr: float = key(0.0, "its Adam learning rate (0.0001, 0.0001, 0.0001, 0.001)")
    privacy_audit: bool = key(True, "simulation only: PSNR_p of each upload against its data")
    photo_crop: int = key(
        128,
        "task photos: side of each disjoint crop in photo pixels (the photos hold 91 crops of "
        "128, 401 of 64, 2975 of 24; two a client plus the held-out ones)",
    )
    photo_size: int = key(64, "task photos: the crops resized to this side (<= photo-crop)")

    def __post_init__(self) -> None:
        _choice(self, "meta_learner", LEARNERS)
        _choice(self, "outer_optimizer", ("", *OUTER_OPTIMIZERS))
        _check(
            self, ["clients_per_round"], lambda v: 1 <= v <= MAX_CLIENTS, f"in [1, {MAX_CLIENTS}]"
        )
        _check(self, ["num_clients"], lambda v: 0 <= v <= MAX_CLIENTS,
               f"in [0, {MAX_CLIENTS}] (0: the task's preset)")  # fmt: skip
        counts = ["outer_steps", "inner_steps", "tto_steps"]
        _check(
            self,
            counts,
            lambda v: 0 <= v <= MAX_COUNT,
            f"in [0, {MAX_COUNT}] (0: the task's preset)",
        )
        _check(self, ["gamma"], lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        pixels = f"in [{MIN_PHOTO_PIXELS}, {MAX_PHOTO_PIXELS}]"
        _check(self, ["photo_size"], lambda v: MIN_PHOTO_PIXELS <= v <= MAX_PHOTO_PIXELS, pixels)
        _check(self, ["photo_crop"], lambda v: self.photo_size <= v <= MAX_PHOTO_PIXELS,
               f"in [photo-size, {MAX_PHOTO_PIXELS}]")  # fmt: skip
        _check(self, ["privacy_budget"], _finite(0.0), "finite and >= 0")
        _check(self, ["memorising_bound"], lambda v: 0 <= v <= MAX_MEMORISING_BOUND,
               f"in [0, {MAX_MEMORISING_BOUND:g}]")  # fmt: skip
        rates = ["inner_lr", "outer_lr", "tto_lr"]
        _check(self, rates, lambda v: 0 <= v <= MAX_META_LEARNING_RATE,
               f"in [0, {MAX_META_LEARNING_RATE:g}] (0: the task's preset)")  # fmt: skip


@dataclass(frozen=True)
class SplitSection:
    """Split learning (SplitNeRF / S2NeRF): one client; the server holds the hash grid."""

    title: ClassVar[str] = "split"
    used_by: ClassVar[str] = "mode='split'"

    split_steps: int = key(600, "server-client round trips, one batch each")
    split_batch_rays: int = key(256, "rays per batch")
    split_samples: int = key(48, "stratified samples per ray")
    split_noise_c: float = key(0.0, "S2NeRF gradient noise scale c (0: no defence; paper 1.2)")
    split_noise_r: float = key(0.0001, "its decay r over the run (1: constant)")
    split_label_noise: float = key(0.0, "NoisyLabel std on pixel colours (0: none)")
    split_record_every: int = key(20, "the audit keeps every k-th exchange")
    split_attack: bool = key(True, "simulation only: Surrogate Model Attack on that record")

    def __post_init__(self) -> None:
        counts = ["split_steps", "split_record_every"]
        _check(self, counts, lambda v: 1 <= v <= MAX_COUNT, f"in [1, {MAX_COUNT}]")
        _check(self, ["split_batch_rays"], lambda v: 1 <= v <= MAX_SPLIT_RAYS,
               f"in [1, {MAX_SPLIT_RAYS}]")  # fmt: skip
        _check(self, ["split_samples"], lambda v: 1 <= v <= MAX_RAY_SAMPLES,
               f"in [1, {MAX_RAY_SAMPLES}]")  # fmt: skip
        _check(self, ["split_noise_r"], lambda v: 0 < v <= 1, "in (0, 1]")
        _check(self, ["split_noise_c", "split_label_noise"], lambda v: 0 <= v <= MAX_SPLIT_NOISE,
               f"in [0, {MAX_SPLIT_NOISE:g}]")  # fmt: skip
        if self.split_noise_c > 0 and self.split_label_noise > 0:
            raise ValueError(
                "run-config: set 'split-noise-c' or 'split-label-noise', not both (one defence)"
            )


@dataclass(frozen=True)
class SecureSection:
    """Secure aggregation with Flower SecAgg+ (every strategy): the server learns only sums."""

    title: ClassVar[str] = "secure aggregation"
    used_by: ClassVar[str] = "every task in mode='federated'"

    secure_aggregation: bool = key(False, "aggregate through Flower SecAgg+")
    secagg_num_shares: float = key(1.0, "fraction of the sampled clients (<= 1) or a count (> 2)")
    secagg_reconstruction_threshold: float = key(0.67, "fraction of the shares, or a count")
    secagg_timeout: float = key(600.0, "seconds per SecAgg+ stage (0: wait forever)")
    secagg_clipping_range: float = key(
        0.0, "0: per-tensor bounds summed securely; > 0: fixed bound"
    )
    secagg_max_exponent: int = key(
        32, "cap e of the automatic bounds 2^e; a client declaring more is overruled"
    )

    def __post_init__(self) -> None:
        self.secure_aggregation_config()  # validates the secagg-* keys

    def secure_aggregation_config(self) -> SecureAggregationConfig | None:
        """The SecAgg+ settings when `secure-aggregation` is on, else None."""
        try:
            config = SecureAggregationConfig(
                num_shares=self.secagg_num_shares,
                reconstruction_threshold=self.secagg_reconstruction_threshold,
                timeout=self.secagg_timeout,
                clipping_range=self.secagg_clipping_range,
                max_exponent=self.secagg_max_exponent,
            )
        except ValueError as error:
            raise ValueError(f"run-config: {error}") from None
        return config if self.secure_aggregation else None


@dataclass(frozen=True)
class DPSection:
    """Client-level differential privacy (DP-FedAvg, McMahan et al. 2018; docs/PRIVACY.md):
    each sampled client's update clipped to dp-clip-norm over all its tensors, Gaussian noise
    of std dp-noise-multiplier x dp-clip-norm on their sum, epsilon at dp-delta accounted per
    round. Central on plaintext sums (the server noises), distributed under secure aggregation
    (each client adds its share before masking); a method whose server step reads each client's
    own values refuses it."""

    title: ClassVar[str] = "differential privacy"
    used_by: ClassVar[str] = "every task in mode='federated'"

    dp_noise_multiplier: float = key(
        0.0, "z: noise std z x dp-clip-norm on the sum of clipped updates (0: no DP)"
    )
    dp_clip_norm: float = key(
        0.0, "C: L2 bound on each client's update, all tensors jointly (> 0 with noise)"
    )
    dp_delta: float = key(
        1e-5, "delta of the reported (epsilon, delta), in (0, 1): keep it << 1 / clients"
    )
    dp_target_epsilon: float = key(
        0.0, "stop before epsilon at dp-delta exceeds it; refuse plans that cannot (0: none)"
    )
    dp_max_noise_ratio: float = key(
        10.0,
        "refuse a run whose noise on the mean update, z sqrt(d) / n, is above this many times "
        "the clip norm (warned above 1; 0: no limit)",
    )
    dp_adaptive_clipping: bool = key(
        False,
        "adapt dp-clip-norm each round towards the dp-target-quantile of the update norms "
        "(Andrew et al. 2021), under the same epsilon; dp-clip-norm is then the first C",
    )
    dp_target_quantile: float = key(
        0.5, "adaptive clipping: the fraction of updates C should leave unclipped, in [0, 1]"
    )
    dp_clip_norm_lr: float = key(0.2, "adaptive clipping: eta of C <- C exp(-eta (b - gamma))")
    dp_clipped_count_stddev: float = key(
        0.0, "adaptive clipping: noise std on the unclipped count (0: sampled clients / 20)"
    )
    dp_gradient_clip_norm: float = key(
        0.0, "decentnerf: C of the gradient query's G_k, its own (0: dp-clip-norm)"
    )

    def __post_init__(self) -> None:
        self.dp_config()  # validates the dp-* keys

    def dp_config(self) -> DPConfig | None:
        """The DP settings when `dp-noise-multiplier` > 0, else None."""
        try:
            config = DPConfig(
                noise_multiplier=self.dp_noise_multiplier,
                clip_norm=self.dp_clip_norm,
                delta=self.dp_delta,
                target_epsilon=self.dp_target_epsilon,
                max_noise_ratio=self.dp_max_noise_ratio,
                adaptive=self.adaptive_clipping(),
                gradient_clip_norm=self.dp_gradient_clip_norm,
            )
        except ValueError as error:
            raise ValueError(f"run-config {error}") from None
        return config if config.enabled else None

    def adaptive_clipping(self) -> AdaptiveClipping | None:
        """The adaptive-clipping settings when `dp-adaptive-clipping` is on, else None."""
        if not self.dp_adaptive_clipping:
            return None
        return AdaptiveClipping(
            self.dp_target_quantile, self.dp_clip_norm_lr, self.dp_clipped_count_stddev
        )


@dataclass(frozen=True)
class RobustSection:
    """What a plaintext reply may carry before the server drops it (counted in the round's
    "num-dropped"), and the aggregation rule. "median" and "trimmed-mean" are coordinate-wise,
    ignore the clients' num-examples and hold all of a round's replies in memory (the mean
    folds them in one at a time); the methods whose step starts from the mean take them
    (docs/RUN_CONFIG.md's strategy list), and not with secure aggregation (the server sees
    only the sum). A run whose rounds keep forming no aggregate (every reply dropped) ends
    with an error naming the commonest drop reason; so does one that never formed any. Split
    mode stops at its first unusable sample reply."""

    title: ClassVar[str] = "bad replies and robust aggregation"
    used_by: ClassVar[str] = "every task in mode='federated'"

    max_update_norm: float = key(
        1000.0, "drop a reply with ||g_k - g|| > this x max(||g||, 1) (0: no bound)"
    )
    max_num_examples: float = key(1e9, "drop a reply whose num-examples exceeds this (0: no cap)")
    aggregation_rule: str = key(
        "mean",
        "mean (weighted) | trimmed-mean | median (unweighted) | krum | multi-krum | bulyan",
    )
    trim_fraction: float = key(0.2, "trimmed-mean: share of the replies cut at each end, [0, 0.5)")
    num_malicious: int = key(
        0, "krum, multi-krum, bulyan: f, the malicious clients assumed (bulyan: >= 4f+3 a round)"
    )
    krum_select: int = key(0, "multi-krum: m, the best-scored replies averaged (0: n - f)")
    max_empty_rounds: int = key(
        3,
        "this many rounds in a row without an aggregate end the run with an error (0: no "
        "limit); a run in which no round formed an aggregate always ends with one",
    )

    def __post_init__(self) -> None:
        _choice(self, "aggregation_rule", AGGREGATION_RULES)
        _check(self, ["max_empty_rounds"], lambda v: v >= 0, ">= 0 (0: no limit)")
        _check(self, ["max_update_norm", "max_num_examples"], _finite(0.0), "finite and >= 0")
        _check(self, ["trim_fraction"], lambda v: 0.0 <= v < 0.5, "in [0, 0.5)")
        _check(self, ["num_malicious", "krum_select"], lambda v: 0 <= v <= MAX_CLIENTS,
               f"in [0, {MAX_CLIENTS}]")  # fmt: skip


@dataclass(frozen=True)
class CompressionSection:
    """Compressed uploads: each sampled client sends its update (its state minus the global it
    received) as a low-rank, quantised or top-k record, keeps what compression lost in its
    private state and adds it to its next update (error feedback); the server decompresses
    each reply before every other check. With secure-aggregation only quantise, summed as
    SecAgg+'s integers (b-bit codes packed several to a masked entry), and not with DP.
    DecentNeRF's update is alpha_k g_k - alpha_k g, and its gradient G_k goes compressed too
    (once, no feedback). With compression-download the global goes
    down the same way: a node gets the change since the round whose global it last trained
    from (a chain of the server's compressed differences), or the global whole; DecentNeRF's
    summed gradient G goes down compressed too."""

    title: ClassVar[str] = "update compression"
    used_by: ClassVar[str] = "every task in mode='federated'"

    compression: str = key(
        "none",
        "none | lowrank (rank r per weight matrix, FedNeRF) | quantise (b-bit unbiased "
        "stochastic, per-tensor scale) | topk (largest fraction f of each tensor)",
    )
    compression_rank: int = key(4, "lowrank: r, the rank each weight matrix is sent at")
    compression_bits: int = key(8, "quantise: b, bits per entry: 8 | 4 | 2")
    compression_fraction: float = key(0.1, "topk: f, the share of each tensor's entries sent")
    compression_download: bool = key(
        False, "also compress the global sent to nodes (its change since a node's last round)"
    )
    compression_download_history: int = key(
        8, "rounds of compressed downloads the server keeps (older nodes get the global whole)"
    )

    def __post_init__(self) -> None:
        _choice(self, "compression", SCHEMES)
        self.compression_config()  # validates the strengths

    def compression_config(self) -> CompressionConfig | None:
        """The compression settings when `compression` is not "none", else None."""
        try:
            config = CompressionConfig(
                self.compression,
                self.compression_rank,
                self.compression_bits,
                self.compression_fraction,
                self.compression_download,
                self.compression_download_history,
            )
        except ValueError as error:
            raise ValueError(f"run-config {error}") from None
        return config if config.enabled else None


@dataclass(frozen=True)
class DeploymentSection:
    """Nodes coming and going, and what only a simulation launcher sets (data, state, audit)."""

    title: ClassVar[str] = "deployment"
    used_by: ClassVar[str] = "every task and mode"

    min_train_nodes: int = key(
        2, "a round samples at least this many nodes (meta tasks: max(it, clients-per-round))"
    )
    min_available_nodes: int = key(
        0,
        "the first round waits (round-timeout) for this many (0: min-train-nodes; meta tasks: "
        "num-clients; split: its one node)",
    )
    round_timeout: float = key(
        600.0, "seconds a round waits for replies and min-train-nodes (split: each exchange)"
    )
    data_dir: str = key(
        "", "simulation only: root of the nodes' data (user_NN, object_NN); deployed: node-config"
    )
    state_dir: str = key(
        "", "simulation only: root of the nodes' state (node_NN); \"\" = Flower's context"
    )
    simulation_audit: bool = key(
        False, "simulation only: observers read data-dir's ground truth (launchers set it)"
    )

    def __post_init__(self) -> None:
        _check(self, ["min_train_nodes"], lambda v: v >= 1, ">= 1")
        _check(self, ["min_available_nodes"], lambda v: v >= 0, ">= 0")
        _check(
            self, ["round_timeout"], lambda v: math.isfinite(v) and 0 < v <= MAX_TIMEOUT_SECONDS,
            f"in (0, {MAX_TIMEOUT_SECONDS:g}] seconds",
        )  # fmt: skip


SECTIONS: dict[str, type] = {
    "common": CommonSection,
    "scene": SceneSection,
    "meta": MetaSection,
    "split": SplitSection,
    "secure": SecureSection,
    "dp": DPSection,
    "robust": RobustSection,
    "compression": CompressionSection,
    "deployment": DeploymentSection,
}
"""FederatedConfig's attribute name -> its section's dataclass, in reference order."""


@dataclass(frozen=True)
class FederatedConfig:
    """Settings of one run, by section: `config.scene.local_steps`, `config.meta.gamma`, ..."""

    common: CommonSection = field(default_factory=CommonSection)
    scene: SceneSection = field(default_factory=SceneSection)
    meta: MetaSection = field(default_factory=MetaSection)
    split: SplitSection = field(default_factory=SplitSection)
    secure: SecureSection = field(default_factory=SecureSection)
    dp: DPSection = field(default_factory=DPSection)
    robust: RobustSection = field(default_factory=RobustSection)
    compression: CompressionSection = field(default_factory=CompressionSection)
    deployment: DeploymentSection = field(default_factory=DeploymentSection)
    strategy_settings: Mapping[str, StrategySettings] = field(default_factory=dict, hash=False)
    """Every registered strategy's own keys, typed (`from_run_config`'s `strategies`); empty
    for a config built without the App's registry."""

    def __post_init__(self) -> None:
        self._check_strategy_and_sections()
        self._check_aggregation_rule()
        self._check_compression()
        self._check_clients_per_round()
        if self.deployment.min_available_nodes > 0:
            self.check_node_count(
                self.deployment.min_available_nodes,
                f"'min-available-nodes' = {self.deployment.min_available_nodes}",
            )

    def _check_strategy_and_sections(self) -> None:
        """The strategy fits the task; no key this run does not read changed: neither one of
        an unused section nor one the task, mode, strategy or another key leaves unread."""
        task, strategy = self.common.task, self.common.strategy
        known = self.strategy_settings
        if known and self.common.mode == "federated" and self.strategy_name not in known:
            raise ValueError(
                f"run-config 'strategy' {self.strategy_name!r} is unknown; known: "
                f"{', '.join(known)}"
            )
        if task != "scene" and strategy == "decentnerf":
            raise ValueError(
                f"run-config 'strategy' 'decentnerf' is for task 'scene' only; task "
                f"{task!r} takes any other strategy"
            )
        if task == "scene" and strategy == "fedmenf":
            raise ValueError("run-config 'strategy' 'fedmenf' is for the meta tasks, not 'scene'")
        for name, used in self.unused_sections().items():
            section = getattr(self, name)
            for changed in _changed_keys(section):
                raise ValueError(
                    f"run-config '{changed}' belongs to the {section.title} section, used by "
                    f"{used}; this run is task={task!r} mode={self.common.mode!r}"
                )
        changed = {dash(name): value for name, value in self._changed_values()}
        for run_key, reader in self.unread_keys().items():
            if run_key in changed:
                raise ValueError(
                    f"run-config '{run_key}' = {changed[run_key]!r} is read only with "
                    f"{reader}; this run is {self.describe()}: leave it at its default"
                )
        if self.common.mode == "split" and self.deployment.min_available_nodes > 1:
            raise ValueError(
                f"run-config 'min-available-nodes' = {self.deployment.min_available_nodes}: "
                "mode='split' trains with one node (0 or 1)"
            )

    def _changed_values(self) -> list[tuple[str, Any]]:
        """(field name, value) of every key whose value differs from its default, a
        strategy's own keys included."""
        changed = [
            (spec.name, getattr(getattr(self, section), spec.name))
            for section, cls in SECTIONS.items()
            for spec in fields(cls)
            if getattr(getattr(self, section), spec.name) != spec.default
        ]
        for settings in self.strategy_settings.values():
            changed += [
                (spec.metadata["key"].replace("-", "_"), getattr(settings, spec.name))
                for spec in fields(settings)
                if getattr(settings, spec.name) != spec.default
            ]
        return changed

    @property
    def settings(self) -> StrategySettings | None:
        """The run's strategy's own settings; None without the registry's."""
        return self.strategy_settings.get(self.strategy_name)

    def _unread_field_keys(self, unread: Mapping[str, str]) -> dict[str, str]:
        """The scene's keys that its `scene-field` never reads -> the field that reads them."""
        kind = self.scene.scene_field
        readers = {k: "scene-field='hashgrid'" for k in HASH_KEYS}
        readers |= {k: "scene-field='mlp'" for k in MLP_KEYS}
        readers |= {k: "scene-field='splats'" for k in SPLAT_KEYS}
        if kind != "mlp":
            readers["field-depth"] = f"scene-field='mlp' or the meta tasks ({MetaSection.used_by})"
        if kind == "splats":
            readers |= {k: "scene-field='hashgrid' or 'mlp'" for k in SPLATS_UNREAD}
        read = {"hashgrid": HASH_KEYS, "mlp": MLP_KEYS, "splats": SPLAT_KEYS}[kind]
        return {k: v for k, v in readers.items() if k not in read and k not in unread}

    def unread_keys(self) -> dict[str, str]:
        """Keys of the used sections that this run never reads -> the setting that reads
        them: split mode's unread keys, a strategy's own settings under another strategy,
        FedMeNF's under another learner, gamma beside a privacy budget (Eq. 13-14 set it),
        SecAgg+ settings without secure aggregation, max-update-norm with it (the server
        sees only the sum), trim-fraction beside another rule, dp-* without DP noise."""
        unread: dict[str, str] = {}
        if self.common.mode == "split":
            unread |= dict.fromkeys(FEDERATED_ONLY, "mode='federated'")
        if self.common.task == "scene":
            unread |= self._unread_field_keys(unread)
        elif self.common.task != "objects":  # scikit-image's images, scored by the server
            for run_key in ("downscale", "eval-scene-dir"):
                unread.setdefault(run_key, "task='scene' | 'objects'")
        for run_key, readers in strategy_keys(self.strategy_settings).items():
            if self.strategy_name not in readers or self.common.mode == "split":
                unread.setdefault(run_key, " | ".join(f"strategy='{r}'" for r in readers))
        if self.meta.meta_learner != "fedmenf":
            unread |= {k: "meta-learner='fedmenf'" for k in FEDMENF_KEYS if k not in unread}
        if self.meta.privacy_budget > 0:
            unread.setdefault("gamma", "privacy-budget = 0 (a budget adapts gamma, Eq. 13-14)")
        if not self.secure.secure_aggregation:
            unread |= {k: "secure-aggregation=true" for k in SECAGG_KEYS if k not in unread}
        else:
            unread.setdefault("max-update-norm", "secure-aggregation=false (the server sees sums)")
        if self.robust.aggregation_rule != "trimmed-mean":
            unread.setdefault("trim-fraction", "aggregation-rule='trimmed-mean'")
        if self.robust.aggregation_rule not in KRUM_RULES:
            unread.setdefault("num-malicious", "aggregation-rule='krum', 'multi-krum' or 'bulyan'")
        if self.robust.aggregation_rule != "multi-krum":
            unread.setdefault("krum-select", "aggregation-rule='multi-krum'")
        if self.dp.dp_noise_multiplier == 0:
            unread |= {k: "dp-noise-multiplier > 0" for k in DP_KEYS if k not in unread}
        if not self.dp.dp_adaptive_clipping:
            unread |= {k: "dp-adaptive-clipping=true" for k in ADAPTIVE_KEYS if k not in unread}
        if self.strategy_name != "decentnerf":
            unread.setdefault("dp-gradient-clip-norm", "strategy='decentnerf'")
        for run_key, scheme in COMPRESSION_STRENGTHS.items():
            if self.compression.compression != scheme:
                unread.setdefault(run_key, f"compression='{scheme}'")
        if self.compression.compression == "none":
            unread.setdefault("compression-download", "compression other than 'none'")
        if not self.compression.compression_download:
            unread.setdefault("compression-download-history", "compression-download=true")
        return unread

    def ignored_keys(self) -> set[str]:
        """Every run-config key this run never reads: its unused sections' and `unread_keys`."""
        unused = self.unused_sections()
        return set(self.unread_keys()) | {
            dash(spec.name) for name in unused for spec in fields(SECTIONS[name])
        }

    def describe(self) -> str:
        """This run's task, mode, strategy and, for the meta tasks, learner, as run-config."""
        text = f"task={self.common.task!r} mode={self.common.mode!r}"
        if self.common.mode == "federated":
            text += f" strategy={self.strategy_name!r}"
        if self.common.task != "scene":
            text += f" meta-learner={self.meta.meta_learner!r}"
        return text

    def _check_aggregation_rule(self) -> None:
        """A robust rule needs a strategy built on the mean and each client's state."""
        rule = self.robust.aggregation_rule
        if rule == "mean" or self.common.mode != "federated":
            return
        robust = [name for name, s in self.strategy_settings.items() if s.robust_rules]
        if self.settings is not None and not self.settings.robust_rules:
            raise ValueError(
                f"run-config 'aggregation-rule' {rule!r} is for strategies "
                f"{', '.join(robust)}; strategy {self.strategy_name!r} has its own "
                "server step: use 'mean'"
            )
        if self.secure.secure_aggregation:
            raise ValueError(
                f"run-config 'aggregation-rule' {rule!r} needs each client's state, which "
                "'secure-aggregation' = true hides: use 'mean' with secure aggregation"
            )

    def _check_compression(self) -> None:
        """Compression needs each client's update: in plaintext any scheme; under SecAgg+ only
        'quantise', whose codes add up, and not with differential privacy."""
        scheme = self.compression.compression
        if scheme == "none" or self.common.mode != "federated":
            return
        secure = self.secure.secure_aggregation
        if secure and scheme in ("lowrank", "topk"):
            raise ValueError(
                f"run-config 'compression' {scheme!r} with 'secure-aggregation' = true is "
                "refused: SecAgg+ sums masked vectors entry by entry and clients' factors or "
                "indices do not add up; use 'quantise' or no compression"
            )
        if secure and self.dp.dp_noise_multiplier > 0:
            raise ValueError(
                "run-config 'compression' 'quantise' with 'secure-aggregation' = true and "
                "differential privacy (dp-noise-multiplier > 0) is refused: b-bit codes of each "
                "client's noise share are not the noised sum the accountant charges"
            )

    def _check_clients_per_round(self) -> None:
        """Secure aggregation needs 3 clients per round; M <= N for the meta tasks."""
        if self.common.mode != "federated":
            return
        key, least = self.clients_per_round_floor()
        if self.secure.secure_aggregation and least < SECURE_MIN_CLIENTS:
            raise ValueError(
                f"run-config 'secure-aggregation' = true needs at least {SECURE_MIN_CLIENTS} "
                f"clients per round (SecAgg+ among 2 shows each the other's values), but "
                f"{key!r} = {least} lets a round have {least}: set {key} >= {SECURE_MIN_CLIENTS}"
            )
        if self.common.task != "scene" and 0 < self.meta.num_clients < least:
            raise ValueError(
                f"run-config {key!r} = {least} is above 'num-clients' = {self.meta.num_clients}"
            )

    def clients_per_round_floor(self) -> tuple[str, int]:
        """The run-config key bounding a round's sampled clients from below, and its value:
        the meta tasks sample `meta_clients_per_round`; the scene samples
        max(int(nodes x fraction-train), min-train-nodes) of the connected nodes, and a round
        may go on with only min-train-nodes connected."""
        if self.common.task != "scene" and self.meta.clients_per_round >= (
            self.deployment.min_train_nodes
        ):
            return "clients-per-round", self.meta.clients_per_round
        return "min-train-nodes", self.deployment.min_train_nodes

    @property
    def meta_clients_per_round(self) -> int:
        """M, the clients a meta task samples each round: clients-per-round, raised to
        min-train-nodes as a floor (Flower's FedAvg sampling takes the larger as well)."""
        return max(self.meta.clients_per_round, self.deployment.min_train_nodes)

    def check_node_count(self, num_nodes: int, source: str = "") -> None:
        """ValueError if a round cannot sample its clients from `num_nodes` nodes (the
        launchers know the count: simulation num-supernodes, --clients, --users); `source`
        names where the count came from. Under secure aggregation the floor is already >= 3
        (`__post_init__`), so a count that passes leaves every round its 3 clients."""
        if self.common.mode != "federated":
            return
        key, least = self.clients_per_round_floor()
        where = f" ({source})" if source else ""
        if least > num_nodes:
            raise ValueError(
                f"run-config {key!r} = {least} is above the {num_nodes} nodes of this "
                f"federation{where}: no round could sample it"
            )
        needed = 4 * self.robust.num_malicious + 3
        if self.robust.aggregation_rule == "bulyan" and self.sampled_per_round(num_nodes) < needed:
            raise ValueError(
                f"run-config 'aggregation-rule' 'bulyan' with 'num-malicious' = "
                f"{self.robust.num_malicious} needs 4f + 3 = {needed} clients a round; "
                f"{num_nodes} nodes{where} give {self.sampled_per_round(num_nodes)}"
            )

    def sampled_per_round(self, num_nodes: int) -> int:
        """The clients a round samples from `num_nodes` connected nodes: the meta tasks'
        M, the scene's max(int(nodes x fraction-train), min-train-nodes), at most all."""
        if self.common.task != "scene":
            return min(self.meta_clients_per_round, num_nodes)
        sampled = int(num_nodes * self.scene.fraction_train)
        return min(max(sampled, self.deployment.min_train_nodes), num_nodes)

    def unused_sections(self) -> dict[str, str]:
        """Sections this run's task and mode do not read, with who reads them."""
        unused = {}
        if self.common.task != "scene":
            unused["scene"] = SceneSection.used_by
        if self.common.task == "scene":
            unused["meta"] = MetaSection.used_by
        if self.common.mode != "split":
            unused["split"] = SplitSection.used_by
        else:  # one client, no aggregation
            unused["secure"] = SecureSection.used_by
            unused["dp"] = DPSection.used_by
            unused["robust"] = RobustSection.used_by
            unused["compression"] = CompressionSection.used_by
        return unused

    @property
    def strategy_name(self) -> str:
        """The strategy to run: `strategy`, or the task's default when it is empty."""
        if self.common.strategy:
            return self.common.strategy
        return "decentnerf" if self.common.task == "scene" else "fedmenf"

    def to_run_config(self) -> dict[str, Any]:
        """The dash-case run-config dict that `from_run_config` reads back."""
        own = [settings.to_run_config() for settings in self.strategy_settings.values()]
        return {
            **{
                dash(name): value
                for section in SECTIONS
                for name, value in asdict(getattr(self, section)).items()
            },
            **{run_key: value for keys in own for run_key, value in keys.items()},
        }

    @classmethod
    def from_run_config(
        cls, run_config: Mapping[str, Any], strategies: StrategyTable | None = None
    ) -> FederatedConfig:
        """Parse Flower's run-config, with each strategy's own keys from `strategies` (the
        App's registry: name -> settings class; None: no strategy keys); one ValueError for an
        unknown key, a wrong type or value, or a changed key the run does not read."""
        strategies = strategies or {}
        owners = section_of_keys()
        known = [*owners, *strategy_keys(strategies)]
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown run-config key {unknown[0]!r}{hint} (docs/RUN_CONFIG.md)")
        values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for run_key, value in run_config.items():
            if run_key in owners:
                section, spec = owners[run_key]
                values[section][spec.name] = typed_value(run_key, value, spec)
        return cls(
            **{name: SECTIONS[name](**kwargs) for name, kwargs in values.items()},
            strategy_settings={
                name: settings.from_run_config(run_config) for name, settings in strategies.items()
            },
        )


DECIDING_KEYS = (
    "task",
    "mode",
    "strategy",
    "meta-learner",
    "privacy-budget",
    "secure-aggregation",
    "dp-noise-multiplier",
    "aggregation-rule",
    "min-train-nodes",
    "clients-per-round",
    "num-clients",
)
"""The keys that decide which other keys a run reads (with those that make them consistent)."""


def without_ignored_keys(
    saved: Mapping[str, Any], strategies: StrategyTable | None = None
) -> dict[str, Any]:
    """A saved run-config (a run's config.json: every key, at the defaults of the day it ran)
    without the keys that run never read, so a run saved before a default changed still
    parses; unchanged when its deciding keys do not parse (the full parse names the fault).
    Without `strategies` (the App's registry) the strategies' own keys go too: a parse
    without the registry cannot read them."""
    deciding = {k: saved[k] for k in DECIDING_KEYS if k in saved}
    try:
        probe = FederatedConfig.from_run_config(deciding, strategies)
    except ValueError:
        return dict(saved)
    ignored = probe.ignored_keys()
    if strategies is None:
        ignored |= set(saved) - set(section_of_keys())
    return {run_key: value for run_key, value in saved.items() if run_key not in ignored}


def section_of_keys() -> dict[str, tuple[str, Field[Any]]]:
    """Every run-config key -> (its section's attribute name, its dataclass field)."""
    return {dash(f.name): (name, f) for name, section in SECTIONS.items() for f in fields(section)}


def strategy_keys(strategies: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each strategy's own run-config key -> the strategies reading it (`strategies`: name ->
    settings class or instance); ValueError where two declare one key with another default
    or type (pyproject.toml holds one default per key)."""
    readers: dict[str, list[str]] = {}
    declared: dict[str, tuple[str, Any]] = {}
    for name, settings in strategies.items():
        settings_class = settings if isinstance(settings, type) else type(settings)
        for run_key, spec in settings_class.keys().items():
            first = declared.setdefault(run_key, (name, spec.default))
            if type(first[1]) is not type(spec.default) or first[1] != spec.default:
                raise ValueError(
                    f"strategies {first[0]!r} and {name!r} declare run-config {run_key!r} "
                    f"with defaults {first[1]!r} and {spec.default!r}: one key, one default"
                )
            readers.setdefault(run_key, []).append(name)
    return readers


def _changed_keys(section: Any) -> list[str]:
    """Run-config keys of `section` whose value differs from the default."""
    return [dash(f.name) for f in fields(section) if getattr(section, f.name) != f.default]
