"""Benchmark: FedNeRF's and DecentNeRF's objectives trained centrally, one crowd per seed.

FedAvg with every user every round and short local rounds converges towards the one global
field that fits every user's photos; DecentNeRF's users fit the same photos with a global and
a personal field under NeRF-W's loss. Trained centrally (one field, every photo, one step per
batch where a federated round takes one per user), a step costs a sixteenth of a 16-user
round, so the fields train on two CPU cores where the federated runs stay near 15 dB
(docs/experiments/2026-12-05-reproduce-decentnerf-table1.md). It asks, without the
federation's client drift and dilution: does the fitted global field keep the persons (the
paper's FedNeRF collapse, Table 1's 17.7 dB), and what does a personal field gain over it?

Objectives, each from the same initial field: `photos` (the global field on every photo:
FedNeRF's objective), `nerfw` (global + one personal field with per-photo appearance,
NeRF-W's loss: DecentNeRF's objective, and Table 1's NeRF-W row), `clean` (the global field on
the clean views of the same poses: the ceiling). Fields and sampling are the reproduce
command's `--scale` (DecentNeRF's MLPs; `--run-config` changes them) or the App's defaults
(`--scale app`: its hash grid, as the Novel Blender bench federates it), trained with the App's
`local_train` in chunks of `--eval-every` steps (Adam restarts each chunk, as a user's does
each round). Scored as the App scores a run: every held-out pose no user photographed, and each
user's first view against its clean version and inside its personal masks, beside
`persons-kept-psnr`, what a field that renders every person exactly scores on those clean
views. Results per seed and objective are kept in `--out` (`seed-N/OBJECTIVE.json`; the scores
so far in `OBJECTIVE.progress.jsonl` while it trains); rerunning skips finished ones.

    python -m simulations.bench.novel_blender_objectives \\
        --crowds runs/reproduce-decentnerf-table1-cpu/crowds/seed-0 [...] --steps 1200
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common.config import parse_config_args
from matplotlib.figure import Figure
from tqdm import tqdm

import strategies
from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data import Scene
from fedfields.data.crowd import CrowdData
from fedfields.fields.personal import PersonalField
from fedfields.metrics import psnr
from fedfields.privacy.leakage import score_crowd
from fedfields.render import OccupancyGrid
from fedfields.train.builders import (
    client_seed,
    global_field,
    marches,
    personal_field_config,
    render_config,
)
from fedfields.train.evaluation import FieldRenderer
from fedfields.train.federated import LocalTrainConfig, federated_state, local_train
from simulations.bench.devices import add_device_argument
from simulations.bench.federated_lego import all_photos
from simulations.reproduce import SCALES
from simulations.sweep_statistics import describe, markdown_table, paired_difference

OBJECTIVES = ("photos", "nerfw", "clean")
METRICS = ("heldout-psnr", "heldout-ssim", "clean-psnr", "personal-psnr", "personal-psnr-floor")
PAIRS = (("nerfw", "photos"), ("clean", "photos"), ("clean", "nerfw"))
"""The differences the table gives: a personal field's gain, and what persons cost each."""
APP_DEFAULTS = "app"
"""`--scale app`: the App's own defaults, its hash-grid fields, beside the reproduce scales."""
PAPER = "the paper (Table 1, lego at 800x800): NeRF-W 27.09, FedNeRF 17.7, DecentNeRF 26.25 dB"


def crowd_seed(crowd_dir: Path) -> int:
    """The seed the crowd was built with (its crowd.json), the run's seed too."""
    path = crowd_dir / "crowd.json"
    if not path.is_file():
        build = "python -m simulations.reproduce decentnerf-table1 --crowds-only"
        raise FileNotFoundError(f"{path}: not found; build crowds with `{build}`")
    try:
        return int(json.loads(path.read_text())["source"]["config"]["seed"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: no source.config.seed ({error!r})") from error


def clean_views(data: CrowdData) -> Scene:
    """Every user's poses with their clean views as the images: the ceiling's training set."""
    photos = all_photos(data)
    return replace(photos, images=torch.cat([user.clean_images for user in data.users]))


def persons_kept_psnr(data: CrowdData) -> float:
    """Mean PSNR of each user's first photo against its clean view: what a field rendering
    every person exactly scores as clean-psnr (a collapse reaches down to it)."""
    return float(np.mean([psnr(u.scene.images[0], u.clean_images[0]) for u in data.users]))


def score(
    config: FederatedConfig, state: dict[str, torch.Tensor], data: CrowdData, device: str
) -> dict[str, float]:
    """The field scored as a run's observer scores it: held-out poses, users' first views."""
    renderer = FieldRenderer(config, device)
    renderer.load(state)
    scores = score_crowd(renderer, data.users, views=[0])
    if data.heldout is not None:
        heldout = renderer.score_scene(data.heldout, range(len(data.heldout)))
        scores |= {f"heldout-{name}": value for name, value in heldout.items()}
    return scores


def train_objective(
    objective: str,
    config: FederatedConfig,
    data: CrowdData,
    steps: int,
    eval_every: int,
    device: str,
    progress: Path | None = None,
) -> tuple[list[dict[str, float]], str | None]:
    """Train `objective`'s fields for `steps` from the run seed's initial global field: the
    scores after every `eval_every` steps, each also appended to `progress` as it comes (a
    cut run keeps its curve), and None, or how training diverged (a non-finite loss ends it:
    the table reports it rather than the last scores)."""
    scene = clean_views(data) if objective == "clean" else all_photos(data)
    settings = render_config(config, scene)
    seed = config.common.seed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        field = global_field(config)
        torch.manual_seed(client_seed(seed, 0))
        personal = (
            PersonalField(personal_field_config(config, settings, len(scene)))
            if objective == "nerfw"
            else None
        )
    occupancy = OccupancyGrid(field.aabb) if marches(config) else None
    history, started, done = [], time.perf_counter(), 0
    with tqdm(total=steps, desc=objective, unit="step") as bar:
        while done < steps:
            chunk = min(eval_every, steps - done)
            local = LocalTrainConfig(
                steps=chunk,
                learning_rate=config.scene.learning_rate,
                personal_learning_rate=config.scene.personal_learning_rate,
                target_samples=config.scene.target_samples,
                personal_density_weight=config.scene.personal_density_weight,
                beta_min=config.scene.beta_min,
                seed=client_seed(seed, 0, done),
                device=device,
            )
            try:
                result = local_train(
                    field, scene, local, settings, occupancy, personal_field=personal
                )
            except FloatingPointError as error:
                return history, f"in the steps after {done}: {error}"
            done += chunk
            bar.update(chunk)
            record = {"step": done, "train-psnr": result.psnr}
            record |= score(config, federated_state(field), data, device)
            record["seconds"] = time.perf_counter() - started
            history.append(record)
            if progress is not None:
                atomic.append_json_line(progress, record)
            bar.set_postfix(heldout=f"{record.get('heldout-psnr', math.nan):.2f}")
    return history, None


def load_results(out: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """objective -> seed -> its saved result, for every finished run under `out` (diverged
    ones included)."""
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(out.glob("seed-*/*.json")):
        result = json.loads(path.read_text())
        results.setdefault(result["objective"], {})[result["seed"]] = result
    return results


def trained(results: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[int, dict]]:
    """The results whose training ran its steps without diverging."""
    kept = {
        objective: {seed: result for seed, result in by_seed.items() if not result["diverged"]}
        for objective, by_seed in results.items()
    }
    return {objective: by_seed for objective, by_seed in kept.items() if by_seed}


def final(result: dict[str, Any], metric: str) -> float:
    """`metric` after the run's last step (persons-kept-psnr: the crowd's)."""
    if metric == "persons-kept-psnr":
        return float(result[metric])
    return float(result["history"][-1][metric])


def table(everything: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Mean ± std per objective over seeds, the paired differences with 95% intervals, and
    the runs that diverged (left out of both)."""
    results = trained(everything)
    objectives = [o for o in OBJECTIVES if o in results]
    rows = []
    for metric in (*METRICS, "persons-kept-psnr"):
        cells = []
        for objective in objectives:
            summary = describe([final(r, metric) for r in results[objective].values()])
            std = "" if math.isnan(summary.std) else f" ± {summary.std:.2f}"
            cells.append(f"{summary.mean:.2f}{std} (n={summary.n})")
        rows.append([metric, *cells])
    differences = []
    for a, b in PAIRS:
        if a in results and b in results:
            values = [{s: final(r, "heldout-psnr") for s, r in results[o].items()} for o in (a, b)]
            paired = paired_difference(*values)
            interval = "–" if math.isnan(paired.low) else f"[{paired.low:+.2f}, {paired.high:+.2f}]"
            seeds = " ".join(map(str, paired.seeds))
            differences.append([f"{a} − {b}", f"{paired.mean:+.2f} dB", interval, seeds])
    header = ("difference (heldout-psnr)", "mean", "95% interval", "seeds")
    lines = [markdown_table(("metric", *objectives), rows), markdown_table(header, differences)]
    diverged = [
        f"{objective} seed {seed} diverged {result['diverged']}"
        for objective, by_seed in everything.items()
        for seed, result in sorted(by_seed.items())
        if result["diverged"]
    ]
    if diverged:
        lines.append("Left out: " + "; ".join(diverged) + ".\n")
    return "\n".join([*lines, f"For comparison, {PAPER}."])


def plot(path: Path, results: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Held-out PSNR against steps, a line per seed and objective: is it still rising?"""
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    results = trained(results)
    for index, objective in enumerate(o for o in OBJECTIVES if o in results):
        for seed, result in sorted(results[objective].items()):
            steps = [r["step"] for r in result["history"]]
            values = [r["heldout-psnr"] for r in result["history"]]
            label = objective if seed == min(results[objective]) else None
            axes.plot(steps, values, color=f"C{index}", label=label)
    axes.set(xlabel="steps", ylabel="held-out PSNR (dB)", title="objectives trained centrally")
    axes.legend(fontsize=8)
    figure.tight_layout()
    atomic.save_figure(path, figure, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--crowds",
        type=Path,
        nargs="+",
        required=True,
        help="crowd folders, one per seed (`reproduce ... --crowds-only`)",
    )
    parser.add_argument(
        "--scale",
        choices=(*SCALES, APP_DEFAULTS),
        default="cpu",
        help="the reproduce command's decentnerf-table1 scale (its MLP fields and samples), or "
        "app: the App's defaults (its hash grid)",
    )
    parser.add_argument(
        "--run-config",
        default="",
        help='the scale\'s run-config changed, e.g. "target-samples=65536"',
    )
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    parser.add_argument("--steps", type=int, default=1200, help="training steps per objective")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between scores")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_novel_blender_objectives"))
    add_device_argument(parser, "training and scoring")
    return parser


def bench_config(scale: str, run_config: str, seed: int) -> FederatedConfig:
    """The App's parse of `scale`'s run-config (none for `app`) changed by `run_config`
    (Flower's "KEY=VALUE ..."), with the crowd's `seed`."""
    shared = SCALES[scale].run_config if scale in SCALES else {}
    overrides = parse_config_args([run_config]) if run_config.strip() else {}
    return strategies.parse_app_config({**shared, **overrides, "seed": seed})


def recorded_elsewhere(path: Path, wanted: dict[str, Any]) -> str | None:
    """How the finished result in `path` was made (scale, run-config, steps, eval-every),
    where that differs from `wanted`, this command's."""
    record = json.loads(path.read_text())
    made = {key: record.get(key) for key in wanted}
    differs = [f"--{key} {made[key]!r}" for key in wanted if made[key] != wanted[key]]
    return " ".join(differs) or None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be positive")
    wanted = {
        "scale": args.scale,
        "run-config": args.run_config,
        "steps": args.steps,
        "eval-every": args.eval_every,
    }
    for crowd_dir in args.crowds:
        seed = crowd_seed(crowd_dir)
        config = bench_config(args.scale, args.run_config, seed)
        data = CrowdData.load(crowd_dir, config.common.downscale)
        for objective in args.objectives:
            path = args.out / f"seed-{seed}" / f"{objective}.json"
            if path.is_file():
                if made := recorded_elsewhere(path, wanted):
                    parser.error(f"{path} was made with {made}; give another --out")
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            progress = path.with_suffix(".progress.jsonl")
            progress.unlink(missing_ok=True)
            history, diverged = train_objective(
                objective, config, data, args.steps, args.eval_every, args.device, progress
            )
            record = {"objective": objective, "seed": seed, "crowd": str(crowd_dir), **wanted}
            record |= {"persons-kept-psnr": persons_kept_psnr(data), "diverged": diverged}
            atomic.write_json(path, record | {"history": history})
    results = load_results(args.out)
    text = table(results)
    atomic.write_text(args.out / "table.md", text + "\n")
    plot(args.out / "curves.png", results)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
