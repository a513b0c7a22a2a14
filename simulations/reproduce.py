"""`python -m simulations.reproduce TABLE`: one paper table or figure, over seeds, beside the
paper's values.

A scene table's seed s builds its own crowd (`fedfields data crowd` with seed s, held-out poses
set aside) and runs every setting of the table with run-config seed s through the App's scene
job in process (`simulations.federated_nerf` over `simulations.in_process_grid`: the App's
strategies, round, ClientApp and observer, without Ray); a meta table (FedMeNF) runs the App's
meta job the same way, its simulation audit on (PSNR_p, membership inference). A run whose
summary.json is complete is skipped and one with a round checkpoint resumes, so rerunning the
command continues it. The table gives per setting and metric mean ± std over seeds next to the
paper's value, and for each difference the paper claims the per-seed difference's mean with its
paired 95% Student-t interval: met when the interval lies on the paper's side of 0 (and above
the paper's margin where one is named; below its bound for a claim of closeness). It writes
`<out>/table.md` (docs/BENCHMARKS.md's format), `<out>/table.json` and `<out>/figure.png`.

`--scale` picks the setting: `paper` (the paper's fields, samples and beta_min at the largest
resolution the bundled lego has: for a GPU), `cpu` (what fits this project's 2-core CPU), `toy`
(seconds: the tests); the output names the scale and what differs from the paper.
`--run-config "KEY=VALUE ..."` (Flower's syntax) changes the scale's shared run-config for
every setting, e.g. fewer rounds of the paper's fields on a borrowed GPU; the output names the
change, a key a setting itself sets is refused, and finished runs in `--out` made with other
values stop the command rather than enter the table.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flwr.common.config import parse_config_args
from matplotlib.figure import Figure
from tqdm import tqdm

from fedfields import atomic
from fedfields.data.crowd import PRESETS, CrowdConfig, crowd_from_scene_dir, write_crowd
from fedfields.flower.resume import RESUME_FILE
from simulations import APP_DIR
from simulations.sweep_statistics import (
    Paired,
    describe,
    final_metrics,
    flatten_numbers,
    is_complete,
    markdown_table,
    paired_difference,
)

LEGO = APP_DIR / "data" / "lego"


@dataclass(frozen=True)
class Scale:
    """One size of a table's runs: its crowd, its shared run-config, what differs from the paper."""

    name: str
    crowd: dict[str, Any]
    run_config: dict[str, Any]
    downscale: float
    differs: str


@dataclass(frozen=True)
class Value:
    """A paper's figure for one setting's metric."""

    setting: str
    metric: str
    paper: float
    source: str


@dataclass(frozen=True)
class Difference:
    """A difference the paper claims: `a`'s `metric` − `b`'s (`metric_b` when set), positive,
    by `paper` (its own tables' figure) and, when `margin` is set, by at least that much to
    count as met."""

    a: str
    b: str
    metric: str
    paper: float | None
    claim: str
    margin: float = 0.0
    metric_b: str = ""  # `b`'s metric when it is not `metric` (what the server reads of each)
    within: float | None = None  # a claim of closeness: met when the interval lies below it


@dataclass(frozen=True)
class Table:
    """A paper table or figure: the settings it compares, its scales, values and claims."""

    name: str
    title: str
    settings: dict[str, dict[str, Any]]
    scales: dict[str, Scale]
    metrics: tuple[str, ...]
    values: tuple[Value, ...] = ()
    differences: tuple[Difference, ...] = ()
    preset: str = "novel-blender"
    job: str = "scene"  # scene (a crowd per seed, the scene job) | meta | split | sdar


NERF_LEARNING_RATE = 5e-4
"""Adam's rate for the MLP fields (NeRF's and NeRF-W's 5e-4): the hash grid's 1e-2 drives
an MLP DecentNeRF client's loss to NaN within its first round (measured at the cpu scale)."""

PAPER_TRAINING = {
    "scene-field": "mlp",
    "learning-rate": NERF_LEARNING_RATE,
    "personal-learning-rate": NERF_LEARNING_RATE,
    "beta-min": 0.03,
    "fraction-train": 1.0,
}
"""What the paper's scale and the cpu scale share: DecentNeRF's MLP fields trained as NeRF-W
trains them, every user every round (Algorithm 1)."""

DECENTNERF_PAPER = Scale(
    "paper",
    crowd={"users": 16, "views_per_user": 4, "heldout_views": 16},
    run_config={
        **PAPER_TRAINING,
        "num-server-rounds": 30,
        "local-steps": 512,
        "target-samples": 1 << 17,
    },
    downscale=1.0,
    differs="200x200 lego, 80 views (16 users x 4, 16 held out), not 800x800 and 100 views",
)
DECENTNERF_CPU = Scale(
    "cpu",
    crowd={"users": 16, "views_per_user": 4, "heldout_views": 16},
    run_config={
        **PAPER_TRAINING,
        "field-width": 64,
        "field-depth": 4,
        "personal-width": 32,
        "mlp-samples": 32,
        "mlp-importance": 32,
        "num-server-rounds": 8,
        "local-steps": 32,
        "target-samples": 4096,
    },
    downscale=4.0,
    differs="50x50; global 4 x 64, personal 4 x 32, 32 + 32 samples; 8 rounds of 32 steps",
)
TOY = Scale(
    "toy",
    crowd={"users": 3, "views_per_user": 2, "heldout_views": 4, "hull_resolution": 48},
    run_config={
        "scene-field": "mlp",
        "field-width": 8,
        "field-depth": 2,
        "personal-width": 8,
        "mlp-samples": 8,
        "mlp-importance": 8,
        "fraction-train": 1.0,
        "num-server-rounds": 2,
        "local-steps": 2,
        "target-samples": 1024,
        "eval-views-per-round": 1,
        "client-eval-views": 0,
    },
    downscale=8.0,
    differs="seconds, for the tests: 25x25, 3 users, 2 rounds of 2 steps",
)
SCALES = {scale.name: scale for scale in (DECENTNERF_PAPER, DECENTNERF_CPU, TOY)}

FEDMENF_PAPER = Scale(
    "paper",
    crowd={},
    run_config={"task": "photos", "num-server-rounds": 1000},
    downscale=1.0,
    differs="64x64 crops of scikit-image's photos for PetFace's 224x224 cats, 20 clients of two "
    "crops for 50 cat owners; 1000 rounds of 5 clients, Table 7's PetFace column otherwise",
)
FEDMENF_CPU = Scale(
    "cpu",
    crowd={},
    run_config={"task": "photos", "num-server-rounds": 8},
    downscale=1.0,
    differs="the paper scale's data and settings for 8 rounds, not 1000",
)
FEDMENF_TOY = Scale(
    "toy",
    crowd={},
    run_config={
        "task": "faces",
        "num-server-rounds": 2,
        "num-clients": 6,
        "clients-per-round": 3,
        "outer-steps": 2,
        "inner-steps": 1,
        "field-width": 16,
        "field-depth": 2,
        "tto-steps": 4,
    },
    downscale=1.0,
    differs="seconds, for the tests: 25x25 faces, 6 clients, a 2 x 16 SIREN, 2 rounds",
)

SPLIT_COMMON = {"mode": "split", "split-attack": True}
S2NERF_PAPER = Scale(
    "paper",
    crowd={},
    run_config={**SPLIT_COMMON, "split-steps": 20000, "split-batch-rays": 1024},
    downscale=1.0,
    differs="lego at 200x200 (the paper: 3D-FRONT, Hypersim, ScanNet rooms) with the App's "
    "hash-grid split field, 20,000 exchanges of 1,024 rays",
)
S2NERF_CPU = Scale(
    "cpu",
    crowd={},
    run_config={**SPLIT_COMMON, "split-steps": 600, "split-record-every": 10},
    downscale=8.0,
    differs="lego at 25x25, 600 exchanges of 256 rays x 48 samples; the attack on every "
    "10th exchange",
)
S2NERF_TOY = Scale(
    "toy",
    crowd={},
    run_config={
        **SPLIT_COMMON,
        "split-steps": 40,
        "split-batch-rays": 64,
        "split-samples": 24,
        "split-record-every": 5,
        "hash-log2-size": 12,
    },
    downscale=8.0,
    differs="seconds, for the tests: lego at 25x25, 40 exchanges of 64 rays",
)
S2NERF = {"split-noise-c": 1.2, "split-noise-r": 1e-4}
"""S2NeRF's setting that the paper recommends (Table 4: c = 1.2, r = 1e-4)."""

SDAR_PAPER = Scale(
    "paper",
    crowd={},
    run_config={"steps": 2000},
    downscale=1.0,
    differs="scikit-learn's 8x8 digits with a small CNN for CIFAR-10 and ResNets; 2,000 "
    "split-learning steps",
)
SDAR_CPU = Scale(
    "cpu",
    crowd={},
    run_config={"steps": 400},
    downscale=1.0,
    differs="scikit-learn's 8x8 digits with a small CNN for CIFAR-10 and ResNets; 400 steps",
)
SDAR_TOY = Scale(
    "toy", crowd={}, run_config={"steps": 10}, downscale=1.0, differs="seconds, for the tests"
)
SDAR_LEVELS = {f"blocks-{level}": {"split-level": level} for level in (1, 2, 3)}
"""Vanilla split learning with 1, 2 or 3 of the CNN's conv blocks on the client."""

SECURE = {"secure-aggregation": True, "min-train-nodes": 3}
"""DecentNeRF as the paper runs it: every upload summed under SecAgg+ (the server reads only
the aggregate, so its personal-content score is the aggregate's)."""

TABLES = {
    table.name: table
    for table in (
        Table(
            "decentnerf-table1",
            "DecentNeRF Table 1 (lego) and Fig. 7a: clean quality and what the server reads",
            settings={
                "fednerf": {"strategy": "fedavg"},
                "decentnerf": {"strategy": "decentnerf", **SECURE},
            },
            scales=SCALES,
            metrics=(
                "heldout-psnr",
                "heldout-ssim",
                "heldout-lpips",
                "clean-psnr",
                "personal-psnr",
                "personal-psnr-floor",
                "upload-personal-psnr",
            ),
            values=(
                Value("fednerf", "heldout-psnr", 17.7, "Table 1"),
                Value("decentnerf", "heldout-psnr", 26.25, "Table 1"),
            ),
            differences=(
                Difference(
                    "decentnerf",
                    "fednerf",
                    "heldout-psnr",
                    8.55,
                    "DecentNeRF beats FedNeRF on clean held-out views (Table 1)",
                ),
                Difference(
                    "fednerf",
                    "decentnerf",
                    "upload-personal-psnr",
                    10.0,
                    "FedNeRF's uploads show the server more personal content than "
                    "DecentNeRF's securely summed field (Fig. 7a, about 10 dB)",
                    metric_b="personal-psnr",
                ),
            ),
        ),
        Table(
            "decentnerf-fig4",
            "DecentNeRF Fig. 4: learned federation weights on a heterogeneous crowd",
            settings={
                "learned": {"strategy": "decentnerf"},
                "fixed": {"strategy": "decentnerf", "alpha-lr": 0.0},
            },
            scales=SCALES,
            metrics=("heldout-psnr", "heldout-ssim", "heldout-lpips", "clean-psnr"),
            differences=(
                Difference(
                    "learned",
                    "fixed",
                    "heldout-psnr",
                    None,
                    "learned alpha weighs lightly occluded users up and beats fixed "
                    "weights (Fig. 4; the paper gives no figure)",
                ),
            ),
            preset="heterogeneous",
        ),
        Table(
            "fedmenf-table1",
            "FedMeNF Table 1 (images) and Table 2: utility after TTO, PSNR_p of the uploads, "
            "membership inference",
            settings={
                "maml": {"strategy": "fedavg", "meta-learner": "maml"},
                "fedmenf": {"strategy": "fedavg", "meta-learner": "fedmenf"},
            },
            scales={s.name: s for s in (FEDMENF_PAPER, FEDMENF_CPU, FEDMENF_TOY)},
            metrics=("psnr", "ssim", "psnr_p", "delta", "mia-accuracy", "mia-auc"),
            values=(
                Value("maml", "psnr", 27.39, "Table 1, PetFace, FedAvg"),
                Value("fedmenf", "psnr", 27.00, "Table 1, PetFace, FedAvg"),
                Value("maml", "psnr_p", 16.57, "Table 1, PetFace, FedAvg"),
                Value("fedmenf", "psnr_p", 14.77, "Table 1, PetFace, FedAvg"),
                Value("maml", "mia-accuracy", 0.958, "Table 2, Cars"),
            ),
            differences=(
                Difference(
                    "maml",
                    "fedmenf",
                    "psnr",
                    0.39,
                    "FedMeNF keeps MAML's utility after TTO: within 1 dB (Table 1: 0.39 dB)",
                    within=1.0,
                ),
                Difference(
                    "maml",
                    "fedmenf",
                    "psnr_p",
                    1.80,
                    "FedMeNF's uploads render the clients' query images worse than MAML's "
                    "(PSNR_p, Table 1)",
                ),
                Difference(
                    "maml",
                    "fedmenf",
                    "mia-accuracy",
                    None,
                    "membership inference does better against MAML's uploads than FedMeNF's "
                    "(Table 2, Cars)",
                ),
            ),
            job="meta",
        ),
        Table(
            "s2nerf-table4",
            "S2NeRF Tables 4 and 5: decaying gradient noise and NoisyLabel against the "
            "Surrogate Model Attack (10/t, ratio 0.01)",
            settings={
                "undefended": {},
                "s2nerf": S2NERF,
                "noisylabel": {"split-label-noise": 1.0},
            },
            scales={s.name: s for s in (S2NERF_PAPER, S2NERF_CPU, S2NERF_TOY)},
            metrics=(
                "heldout-psnr",
                "heldout-ssim",
                "attack.attacked.ssim_depth",
                "attack.attacked.lpips_depth",
                "attack.attacked.ssim_grey",
                "attack.untrained.ssim_depth",
            ),
            values=(
                Value("s2nerf", "attack.attacked.ssim_depth", 0.53, "Table 4, 3D-FRONT"),
                Value("noisylabel", "attack.attacked.ssim_depth", 0.95, "Table 5, 3D-FRONT, 1"),
            ),
            differences=(
                Difference(
                    "undefended",
                    "s2nerf",
                    "attack.attacked.ssim_depth",
                    None,
                    "S2NeRF's noise lowers what the attack recovers (SSIM-depth; Table 4 gives "
                    "no undefended row)",
                ),
                Difference(
                    "undefended",
                    "s2nerf",
                    "heldout-psnr",
                    0.41,
                    "at little utility cost: within 1 dB of undefended (Table 4, 3D-FRONT: "
                    "20.83 vs 21.24)",
                    within=1.0,
                ),
                Difference(
                    "noisylabel",
                    "s2nerf",
                    "attack.attacked.ssim_depth",
                    0.42,
                    "NoisyLabel (sigma 1) leaks more than S2NeRF (Tables 4-5, 3D-FRONT: 0.95 "
                    "vs 0.53)",
                ),
            ),
            job="split",
        ),
        Table(
            "sdar-levels",
            "SDAR (vanilla split learning, digits): SDAR against naive SDA at every split level",
            settings=SDAR_LEVELS,
            scales={s.name: s for s in (SDAR_PAPER, SDAR_CPU, SDAR_TOY)},
            metrics=("test-accuracy", "sdar-mse", "naive-mse", "class-mean-mse"),
            differences=tuple(
                Difference(
                    level,
                    level,
                    "naive-mse",
                    None,
                    f"SDAR reconstructs the client's private inputs better than naive SDA, "
                    f"{level.replace('-', ' ')} (Sec. V; the paper's MSE is on CIFAR)",
                    metric_b="sdar-mse",
                )
                for level in SDAR_LEVELS
            ),
            job="sdar",
        ),
    )
}


@dataclass
class Results:
    """Each setting's metrics per seed, as read from the finished runs."""

    runs: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)

    def values(self, setting: str, metric: str) -> dict[int, float]:
        """seed -> the metric, for the seeds whose run reports it."""
        return {
            seed: metrics[metric]
            for seed, metrics in self.runs.get(setting, {}).items()
            if metric in metrics
        }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.reproduce",
        description="Reproduce a paper table over seeds through the App and print the paper's "
        "values beside ours (mean ± std, paired 95% intervals).",
    )
    parser.add_argument("table", choices=sorted(TABLES), help="the table or figure")
    parser.add_argument(
        "--scale", choices=sorted(SCALES), default="cpu", help="paper (GPU) | cpu | toy (tests)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="at least 3")
    parser.add_argument("--out", type=Path, default=None, help="default runs/reproduce-TABLE-SCALE")
    parser.add_argument(
        "--scene", type=Path, default=LEGO, help="the scene the crowds are built on"
    )
    parser.add_argument(
        "--run-config",
        default="",
        help='the scale\'s run-config changed for every setting, e.g. "num-server-rounds=3"',
    )
    parser.add_argument("--table-only", action="store_true", help="rebuild from runs on disk")
    parser.add_argument(
        "--crowds-only",
        action="store_true",
        help="build the seeds' crowds into --out and stop (to carry them to a GPU machine)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    return args


def crowd_dir(out: Path, table: Table, scale: Scale, seed: int, scene: Path) -> Path:
    """The crowd of seed `seed`, built on first use (its own seed: crowds differ across seeds)."""
    folder = out / "crowds" / f"seed-{seed}"
    if (folder / "crowd.json").is_file():
        return folder
    config = CrowdConfig(**{**PRESETS[table.preset], **scale.crowd, "seed": seed})
    crowd = crowd_from_scene_dir(scene, config, downscale=scale.downscale, progress=False)
    source = {"scene": str(scene), "downscale": scale.downscale, "config": asdict(config)}
    write_crowd(crowd, folder, source=source)
    return folder


def run_sdar(config: dict[str, Any], run_dir: Path) -> None:
    """SDAR and naive SDA watching one vanilla split-learning run of the digits CNN
    (`fedfields.privacy.attacks.sdar_digits`, no Flower: split learning of two parties); its
    config.json and a summary.json with the scores, written atomically."""
    import time

    from fedfields.privacy.attacks.sdar import SDARConfig
    from fedfields.privacy.attacks.sdar_digits import DigitsSplitConfig, digits_audit

    started = time.perf_counter()
    split = DigitsSplitConfig(config["split-level"], steps=config["steps"], seed=config["seed"])
    result = digits_audit(split, {"sdar": SDARConfig(), "naive": SDARConfig.naive()})
    final = {
        "test-accuracy": result.test_accuracy,
        "sdar-mse": result.scores["sdar"].mse,
        "naive-mse": result.scores["naive"].mse,
        "mean-digit-mse": result.mean_image_mse,
        "class-mean-mse": result.class_mean_mse,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(run_dir / "config.json", config)
    summary = {"final": final, "seconds": time.perf_counter() - started}
    atomic.write_json(run_dir / "summary.json", summary)


def run_split(config: dict[str, Any]) -> None:
    """The App's split job in process, its audit attacking the wire it records (no round
    checkpoint: a cut split run starts afresh)."""
    import strategies
    from simulations.in_process_grid import InProcessGrid
    from simulations.run import client_app
    from simulations.split_job import run_split_job

    config = {**config, "simulation-audit": True}
    config.pop("resume", None)
    run_split_job(InProcessGrid([client_app(config)]), strategies.parse_app_config(config))


def run_one(
    table: Table,
    scale: Scale,
    setting: str,
    seed: int,
    crowd: Path | None,
    run_dir: Path,
    scene: Path = LEGO,
) -> None:
    """One setting at one seed through the App's job in process: the scene job on `crowd`, the
    meta job with its simulation audit (PSNR_p, the inference attacks), or the split job on
    `scene` with the Surrogate Model Attack. Resumed from its round checkpoint when a killed
    run left one, else started afresh."""
    import strategies
    from fedfields.config import meta_settings
    from simulations.federated_nerf import run_federated_nerf
    from simulations.in_process_grid import InProcessGrid
    from simulations.meta_job import run_meta_job
    from simulations.run import client_app

    config = {
        **scale.run_config,
        **table.settings[setting],
        "seed": seed,
        "state-dir": str(run_dir.with_suffix(".nodes")),
        "run-dir": str(run_dir),
    }
    if (run_dir / RESUME_FILE).is_file():
        config["resume"] = True
    else:  # cut before its first round checkpoint: start it afresh
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(run_dir.with_suffix(".nodes"), ignore_errors=True)
    if table.job == "sdar":
        run_sdar({**scale.run_config, **table.settings[setting], "seed": seed}, run_dir)
        return
    if table.job == "split":
        run_split(config | {"data-dir": str(scene), "downscale": scale.downscale})
        return
    if table.job == "meta":
        config["simulation-audit"] = True
        parsed = strategies.parse_app_config(config)
        nodes = meta_settings(parsed).num_clients
        run_meta_job(InProcessGrid([client_app(config)] * nodes), parsed)
        return
    assert crowd is not None
    config["data-dir"] = str(crowd)
    users = len(list(crowd.glob("user_*")))
    grid = InProcessGrid([client_app(config)] * users)  # a failed client is counted, as in the App
    run_federated_nerf(grid, strategies.parse_app_config(config), observe=True)


class OtherSettingsError(RuntimeError):
    """A finished run in `--out` was made with other run-config values than the ones asked."""


def changed_scale(table: Table, scale: Scale, run_config: str) -> Scale:
    """`scale` with `run_config`'s keys (Flower's "KEY=VALUE ..." syntax) over its shared
    run-config, named in its `differs`; ValueError for a key one of the table's settings sets
    or a setting the App refuses (an unknown key, a value out of range)."""
    if not run_config.strip():
        return scale
    if table.job == "sdar":
        raise ValueError(f"--run-config: {table.name} runs no App job (SDAR's own trainer)")
    overrides = parse_config_args([run_config])
    fixed = sorted(key for key in overrides for values in table.settings.values() if key in values)
    if fixed:
        raise ValueError(f"--run-config {fixed[0]}: set by the table's settings, not the scale")
    changed = replace(
        scale,
        run_config={**scale.run_config, **overrides},
        differs=f"{scale.differs}; with --run-config {run_config.strip()}",
    )
    import strategies

    for values in table.settings.values():
        strategies.parse_app_config({**changed.run_config, **values})
    return changed


def recorded_difference(run_dir: Path, scale: Scale) -> str | None:
    """The first of `scale`'s run-config keys whose value differs in the finished run's
    config.json ("key: recorded -> wanted"); None when all agree or nothing is recorded."""
    try:
        recorded = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key, wanted in scale.run_config.items():
        if key in recorded and recorded[key] != wanted:
            return f"{key}: {recorded[key]!r} -> {wanted!r}"
    return None


def run_metrics(run_dir: Path) -> dict[str, float] | None:
    """A finished run's final scores (and a split run's attack scores) plus its last round's
    metrics that the final lacks (upload-personal-psnr: what the server read of each user's
    upload); None if unfinished."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not is_complete(summary):
        return None
    metrics = final_metrics(summary) | flatten_numbers({"attack": summary.get("attack", {})})
    history = run_dir / "metrics.jsonl"  # none for the SDAR table's runs
    lines = history.read_text().splitlines() if history.is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    numbers = {k: float(v) for k, v in last.items() if isinstance(v, int | float)}
    return {**numbers, **metrics}


def reproduce(
    table: Table,
    scale: Scale,
    seeds: Sequence[int],
    out: Path,
    scene: Path,
    progress: bool = True,
    table_only: bool = False,
) -> Results:
    """Every (seed, setting) run, finished ones skipped, then their metrics."""
    results = Results()
    pending = [(seed, name) for seed in seeds for name in table.settings]
    bar = tqdm(pending, desc=f"{table.name} ({scale.name})", disable=not progress)
    for seed, name in bar:
        run_dir = out / name / f"seed-{seed}"
        finished = run_metrics(run_dir) is not None
        if finished and (change := recorded_difference(run_dir, scale)):
            raise OtherSettingsError(f"{run_dir} finished with other settings ({change})")
        if not table_only and not finished:
            bar.set_postfix_str(f"{name} seed {seed}")
            crowd = crowd_dir(out, table, scale, seed, scene) if table.job == "scene" else None
            run_one(table, scale, name, seed, crowd, run_dir, scene)
        metrics = run_metrics(run_dir)
        if metrics is not None:
            results.runs.setdefault(name, {})[seed] = metrics
    return results


def cell(values: dict[int, float]) -> str:
    """mean ± std over seeds (n)."""
    summary = describe(list(values.values()))
    if summary.n == 0:
        return "—"
    spread = "" if math.isnan(summary.std) else f" ± {summary.std:.3g}"
    return f"{summary.mean:.4g}{spread} (n={summary.n})"


def verdict(difference: Difference, paired: Paired) -> str:
    """met when the paired interval lies above the claim's margin (0 when none), or for a claim
    of closeness below its `within`; missed when it does not, undecided below two seeds."""
    if math.isnan(paired.low):
        return "undecided (fewer than 2 seeds)"
    if difference.within is not None:
        return "met" if paired.high < difference.within else "missed"
    return "met" if paired.low > difference.margin else "missed"


def render_table(table: Table, scale: Scale, results: Results) -> tuple[str, dict[str, Any]]:
    """The markdown report and its JSON: settings x metrics, the paper's values, claims."""
    header = ["metric", *table.settings]
    rows = [
        [metric, *(cell(results.values(s, metric)) for s in table.settings)]
        for metric in table.metrics
    ]
    lines = [
        f"### {table.title}",
        "",
        f"Scale `{scale.name}`: {scale.differs}. Mean ± std over seeds.",
        "",
        markdown_table(header, rows),
        "",
    ]
    record: dict[str, Any] = {
        "table": table.name,
        "scale": scale.name,
        "differs": scale.differs,
        "values": [],
        "differences": [],
    }
    if table.values:
        value_rows = []
        for value in table.values:
            ours = results.values(value.setting, value.metric)
            value_rows.append(
                [f"{value.setting} {value.metric}", f"{value.paper:g} ({value.source})", cell(ours)]
            )
            record["values"].append(
                {
                    "setting": value.setting,
                    "metric": value.metric,
                    "paper": value.paper,
                    "ours": list(ours.values()),
                }
            )
        lines += [markdown_table(["figure", "paper", "ours"], value_rows), ""]
    claim_rows = []
    for difference in table.differences:
        paired = paired_difference(
            results.values(difference.a, difference.metric),
            results.values(difference.b, difference.metric_b or difference.metric),
        )
        paper = "—" if difference.paper is None else f"{difference.paper:+g}"
        interval = f"{paired.mean:+.3g} [{paired.low:+.3g}, {paired.high:+.3g}]"
        claim_rows.append(
            [
                difference.claim,
                f"{difference.a} {difference.metric} − {difference.b} "
                f"{difference.metric_b or difference.metric}",
                paper,
                interval,
                verdict(difference, paired),
            ]
        )
        record["differences"].append(
            {
                "a": difference.a,
                "b": difference.b,
                "metric": difference.metric,
                "paper": difference.paper,
                "seeds": list(paired.seeds),
                "mean": paired.mean,
                "low": paired.low,
                "high": paired.high,
                "verdict": verdict(difference, paired),
            }
        )
    if claim_rows:
        header = ["claim", "difference", "paper", "ours: mean [95% interval]", "met?"]
        lines += [markdown_table(header, claim_rows), ""]
    return "\n".join(lines), record


def plot(path: Path, table: Table, results: Results) -> None:
    """Each metric's mean ± std per setting (one panel per PSNR-like metric present)."""
    metrics = [m for m in table.metrics if any(results.values(s, m) for s in table.settings)]
    figure = Figure(figsize=(3.2 * max(1, len(metrics)), 3.2))
    for index, metric in enumerate(metrics):
        axes = figure.add_subplot(1, max(1, len(metrics)), index + 1)
        for position, setting in enumerate(table.settings):
            summary = describe(list(results.values(setting, metric).values()))
            error = 0.0 if math.isnan(summary.std) else summary.std
            axes.bar(position, summary.mean, yerr=error, capsize=4)
        axes.set_xticks(range(len(table.settings)), list(table.settings), rotation=20)
        axes.set_title(metric, fontsize=9)
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    table = TABLES[args.table]
    out = (args.out or APP_DIR / "runs" / f"reproduce-{table.name}-{args.scale}").resolve()
    if len(args.seeds) < 3:
        print(f"reproduce: {len(args.seeds)} seed(s): intervals need 3 or more", file=sys.stderr)
    try:
        scale = changed_scale(table, table.scales[args.scale], args.run_config)
    except ValueError as error:
        print(f"reproduce: {error}", file=sys.stderr)
        return 2
    if args.crowds_only:
        if table.job != "scene":
            print(f"reproduce: --crowds-only: {table.name} builds no crowds", file=sys.stderr)
            return 2
        for seed in args.seeds:
            print(f"reproduce: crowd in {crowd_dir(out, table, scale, seed, args.scene)}")
        return 0
    try:
        results = reproduce(
            table, scale, args.seeds, out, args.scene, not args.no_progress, args.table_only
        )
    except OtherSettingsError as error:
        print(f"reproduce: {error}: give another --out", file=sys.stderr)
        return 2
    text, record = render_table(table, scale, results)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "table.md", text + "\n")
    atomic.write_json(out / "table.json", record)
    plot(out / "figure.png", table, results)
    print(text)
    print(f"reproduce: table in {out / 'table.md'}, figure in {out / 'figure.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
