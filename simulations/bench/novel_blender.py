"""Benchmark: DecentNeRF's Novel Blender claims (paper 002/003, Table 1, Figs. 4, 5, 7).

Side by side on one crowd, every user every round, about one epoch of local rays per round:
centralised NeRF-W on all photos; FedNeRF (FedAvg over global-only fields); DecentNeRF(-L)
(global + personal fields, NeRF-W loss, FedAvg weights); DecentNeRF (learned alpha, exact
gradient through the normalised aggregation). The federation runs in this process through the
library's strategies and their round (`simulations.bench.novel_blender_federation`: FedAvg and
DecentNeRF over an in-process grid): the code the Flower App runs, without Ray's per-message
overhead, so one method's 30 rounds fit a CPU budget.

Leakage is scored on what the server can read (paper Fig. 7a): each user's uploaded global
field for FedNeRF (plaintext), the securely aggregated field for DecentNeRF, both inside the
user's personal-content masks against the photo, next to the floor (the clean view against
the photo: a field that renders no person). Fig. 7b: each DecentNeRF user's own global and
personal field inside the same masks.

    python -m simulations.bench.novel_blender --crowd runs/crowd_nb_ds2 --downscale 2 \\
        [--rounds 30] [--methods centralised fednerf decentnerf-l decentnerf]
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from PIL import Image
from torch import Tensor
from tqdm.auto import tqdm

from fedfields.config import FederatedConfig
from fedfields.config.schema import SceneSection
from fedfields.data import Scene
from fedfields.data.crowd import CrowdData, CrowdUser
from fedfields.fields import Field
from fedfields.fields.encodings import HashGridConfig
from fedfields.fields.personal import PersonalField, PersonalFieldConfig
from fedfields.metrics import psnr, ssim
from fedfields.render import OccupancyGrid, RenderConfig, render_image
from fedfields.train.builders import client_seed, global_field
from fedfields.train.builders import render_config as default_render_config
from fedfields.train.federated import (
    LocalTrainConfig,
    federated_state,
    load_federated_state,
    local_train,
)
from fedfields.train.static_step import StepMode
from simulations.bench.devices import add_device_argument

METHODS = ("centralised", "fednerf", "decentnerf-l", "decentnerf")
LABELS = {
    "centralised": "Centralised NeRF-W (all photos)",
    "fednerf": "FedNeRF (FedAvg, global field only)",
    "decentnerf-l": "DecentNeRF(-L) (FedAvg weights)",
    "decentnerf": "DecentNeRF (learned alpha)",
}
OCCUPANCY_PASSES = 2
STEP_SCALE = {"value": 1.0}
"""Marching step relative to the App's default, set once from --step-scale for every method."""


def personal_field(num_images: int, aabb: Tensor, log2_hashmap_size: int = 13) -> PersonalField:
    """A user's personal field, lighter than the App's (6 levels up to 128, 2^13 entries per
    level by default): persons span 10-20 pixels of the 50x50 views this benchmark affords."""
    encoding = HashGridConfig(num_levels=6, log2_hashmap_size=log2_hashmap_size,
                              max_resolution=128)  # fmt: skip
    config = PersonalFieldConfig(num_images=num_images, encoding=encoding,
                                 aabb=tuple(aabb.flatten().tolist()))  # fmt: skip
    return PersonalField(config)


def render_config(config: FederatedConfig, scene: Scene | None) -> RenderConfig:
    """The App's render settings with the benchmark's marching step."""
    settings = default_render_config(config, scene)
    return replace(settings, step_size=settings.step_size * STEP_SCALE["value"])


@dataclass(frozen=True)
class Settings:
    """The budget and losses shared by every method of one benchmark run."""

    rounds: int = 30
    epochs: float = 1.0  # local passes over a user's pixels per round
    max_steps: int = 400  # cap on local steps per round
    learning_rate: float = 1e-2
    personal_learning_rate: float = SceneSection.personal_learning_rate  # the App's default
    target_samples: int = 1 << 14
    beta_min: float = SceneSection.beta_min  # the App's default (NeRF-W's is 0.03)
    transient_density_weight: float = 0.01
    alpha_lr: float = 1.0
    gradient_rays: int = 4096
    central_transient_log2_hashmap: int = 13  # 17: the hash entries of sixteen users' fields
    fixed_alphas: tuple[float, ...] | None = None  # DecentNeRF(-L)'s weights; None: all 1
    seed: int = 0
    run_config: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"  # every user's local training and every render (the field's device)
    step_mode: StepMode = "dynamic"  # local steps (run-config cuda-graph: "cuda-graph")

    def local(self, round_: int, user: int, personal: bool) -> LocalTrainConfig:
        """One user's round: about `epochs` passes, NeRF-W loss when it has a personal field."""
        return LocalTrainConfig(
            steps=self.max_steps,
            epochs=self.epochs,
            learning_rate=self.learning_rate,
            personal_learning_rate=self.personal_learning_rate,
            target_samples=self.target_samples,
            personal_density_weight=self.transient_density_weight if personal else 0.0,
            beta_min=self.beta_min,
            seed=client_seed(self.seed, user, round_),
            device=self.device,
            step_mode=self.step_mode,
        )


def eval_views(data: CrowdData) -> list[tuple[int, int]]:
    """(user, view) pairs scored every round: each user's view with the most personal pixels."""
    return [
        (index, int(user.personal_masks.flatten(1).sum(1).argmax()))
        for index, user in enumerate(data.users)
    ]


def render(field: Field, scene: Scene, view: int, config: FederatedConfig, grid: OccupancyGrid):
    """[H, W, 3] render of a scene's view on the field's device, clamped, on the CPU."""
    settings = render_config(config, scene)
    return render_image(field, scene.cameras, view, settings, grid).rgb.clamp(0.0, 1.0).cpu()


def fresh_grid(field: Field, config: FederatedConfig) -> OccupancyGrid:
    """An occupancy grid built from a field's density alone (what any holder of it can do)."""
    grid = OccupancyGrid(field.aabb)
    step = render_config(config, None).step_size
    for _ in range(OCCUPANCY_PASSES):
        grid.update(field.density, step)
    return grid


def personal_psnr(image: Tensor, user: CrowdUser, view: int) -> float:
    """PSNR inside the user's personal-content mask against the photo (higher: more leaked)."""
    return psnr(image, user.scene.images[view], user.personal_masks[view])


def floor_psnr(user: CrowdUser, view: int) -> float:
    """The same for the clean view: what a field that renders no person scores."""
    return psnr(user.clean_images[view], user.scene.images[view], user.personal_masks[view])


def score_server_field(
    field: Field, data: CrowdData, config: FederatedConfig, views: list[tuple[int, int]] | None
) -> dict[str, float]:
    """Clean-view PSNR/SSIM and personal-content PSNR with its floor over `views` (None: all)."""
    grid = fresh_grid(field, config)
    pairs = views or [(u, v) for u, user in enumerate(data.users) for v in range(len(user.scene))]
    renders, cleans, personal, floors = [], [], [], []
    for u, v in pairs:
        user = data.users[u]
        image = render(field, user.scene, v, config, grid)
        renders.append(image)
        cleans.append(user.clean_images[v])
        personal.append(personal_psnr(image, user, v))
        floors.append(floor_psnr(user, v))
    return {
        "clean-psnr": float(np.mean([psnr(r, c) for r, c in zip(renders, cleans, strict=True)])),
        "clean-ssim": ssim(torch.stack(renders), torch.stack(cleans)),
        "personal-psnr": float(np.mean(personal)),
        "personal-floor": float(np.mean(floors)),
    }


def run_centralised(data: CrowdData, config: FederatedConfig, settings: Settings) -> dict[str, Any]:
    """NeRF-W on all photos: one global + personal (transient) field, `rounds` epochs, each
    one `local_train` call (Adam restarts per epoch, as a user's does per round)."""
    # Imported here: federated_lego imports Flower, which this module's federated path (and
    # simulations.bench.gpu, run where Flower is absent) does without.
    from simulations.bench.federated_lego import all_photos

    torch.manual_seed(settings.seed)
    photos = all_photos(data)
    model = global_field(config)
    personal = personal_field(len(photos), model.aabb, settings.central_transient_log2_hashmap)
    grid = OccupancyGrid(model.aabb)
    per_round_views = eval_views(data)
    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    train_seconds, rays = 0.0, 0
    for epoch in tqdm(range(1, settings.rounds + 1), desc="centralised"):
        local = replace(settings.local(epoch, 0, True), steps=settings.max_steps * len(data.users))
        tick = time.perf_counter()
        result = local_train(model, photos, local, render_config(config, photos), grid,
                             personal_field=personal)  # fmt: skip
        train_seconds += time.perf_counter() - tick
        rays += result.rays
        model.eval()
        record = {"round": epoch, **score_server_field(model, data, config, per_round_views)}
        model.train()
        record["seconds"] = time.perf_counter() - started
        history.append(record)
        tqdm.write(json.dumps(record))
    wall = time.perf_counter() - started
    model.eval()
    final = score_server_field(model, data, config, None)
    return {
        "method": "centralised",
        "history": history,
        "final": final,
        "wall-seconds": wall,
        "train-seconds": train_seconds,
        "rays-per-second": rays / max(train_seconds, 1e-9),
        "server-flops-per-round": 0,
        "bytes-per-round": 0,
        "alphas": [],
        "transient-parameters": sum(p.numel() for p in personal.parameters()),
        "state": federated_state(model),
    }


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of final scores, leakage and costs."""
    lines = [
        "| method | clean PSNR | clean SSIM | server-readable personal PSNR (worst round) "
        "| floor | server FLOPs/round | bytes/round | rays/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        final = result["final"]
        leak = leakage_worst_round(result)
        lines.append(
            f"| {LABELS[result['method']]} | {final['clean-psnr']:.2f} | {final['clean-ssim']:.3f} "
            f"| {'n/a' if leak is None else f'{leak:.2f}'} | {final['personal-floor']:.2f} "
            f"| {result['server-flops-per-round']:.3g} | {result['bytes-per-round']:.3g} "
            f"| {result['rays-per-second']:.0f} | {result['wall-seconds']:.0f} |"
        )
    return "\n".join(lines)


def leakage_worst_round(result: dict[str, Any]) -> float | None:
    """Highest per-round personal PSNR of what the server reads: uploads for FedNeRF, the
    aggregate for DecentNeRF; None for centralised training."""
    history = result["history"]
    if not history or result["method"] == "centralised":
        return None
    key = "upload-personal-psnr" if result["method"] == "fednerf" else "personal-psnr"
    return max(record[key] for record in history)


def plot_curves(path: Path, results: list[dict[str, Any]]) -> None:
    """Fig. 7a/b-like: server-readable personal PSNR per round with the floor; own fields."""
    results = [r for r in results if r["history"] and r["method"] != "centralised"]
    if not results:  # centralised training alone: its server holds the photos, no curve
        return
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    for result in results:
        history = result["history"]
        rounds = [r["round"] for r in history]
        key = "upload-personal-psnr" if result["method"] == "fednerf" else "personal-psnr"
        left.plot(rounds, [r[key] for r in history], label=LABELS[result["method"]])
        if "own-global-personal-psnr" in history[0] and result["method"] == "decentnerf":
            right.plot(rounds, [r["own-global-personal-psnr"] for r in history], label="own global")
            right.plot(rounds, [r["own-personal-personal-psnr"] for r in history],
                       label="own personal")  # fmt: skip
            right.plot(rounds, [r["personal-floor"] for r in history], "k--", label="floor")
        floor = [r["personal-floor"] for r in history]
    left.plot(rounds, floor, "k--", label="floor (no person rendered)")
    left.set(xlabel="round", ylabel="PSNR inside personal masks (dB)",
             title="what the server can read (Fig. 7a)")  # fmt: skip
    right.set(xlabel="round", ylabel="PSNR inside personal masks (dB)",
              title="DecentNeRF users' own fields (Fig. 7b)")  # fmt: skip
    left.legend(fontsize=7)
    if right.get_legend_handles_labels()[0]:  # DecentNeRF curves only
        right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def grid_figure(
    path: Path, results: list[dict[str, Any]], data: CrowdData, config: FederatedConfig
) -> None:
    """Fig. 5-like: per user (one view) photo | clean ground truth | each method's server field."""
    model = global_field(config)
    pairs = eval_views(data)[:: max(1, len(data.users) // 4)][:4]
    rows = []
    for u, v in pairs:
        user = data.users[u]
        tiles = [user.scene.images[v], user.clean_images[v]]
        for result in results:
            load_federated_state(model, result["state"])
            model.eval()
            tiles.append(render(model, user.scene, v, config, fresh_grid(model, config)))
        rows.append(torch.cat(tiles, dim=1))
    image = (torch.cat(rows, dim=0).numpy() * 255 + 0.5).astype(np.uint8)
    Image.fromarray(image).save(path)


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crowd", type=Path, required=True, help="`fedfields data crowd` folder")
    parser.add_argument("--downscale", type=float, default=1.0, help="on top of the crowd's size")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epochs", type=float, default=1.0, help="local epochs per round")
    parser.add_argument("--alpha-lr", type=float, default=Settings.alpha_lr)
    parser.add_argument("--beta-min", type=float, default=Settings.beta_min)
    parser.add_argument(
        "--personal-lr",
        type=float,
        default=Settings.personal_learning_rate,
        help="Adam rate of the personal (transient) fields",
    )
    parser.add_argument(
        "--transient-density-weight",
        type=float,
        default=Settings.transient_density_weight,
        help="NeRF-W's lambda_u on the personal (transient) density (NeRF-W: 0.01)",
    )
    parser.add_argument(
        "--heavy-user-weight",
        type=float,
        default=None,
        help="DecentNeRF(-L) with this fixed weight on the heavily occluded users (others 1; "
        "0 gives them the least weight a DecentNeRF server takes, alpha-max x 1e-6): the "
        "weighting learned alpha would have to find (Fig. 4)",
    )
    parser.add_argument(
        "--step-scale", type=float, default=2.0, help="marching step x the App's (2: 50x50 views)"
    )
    parser.add_argument(
        "--central-transient-hashmap",
        type=int,
        default=Settings.central_transient_log2_hashmap,
        help="log2 hash entries per level of centralised NeRF-W's transient field (13: one user's)",
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("runs/bench_novel_blender"))
    parser.add_argument("--run-config", default="", help="extra run-config, e.g. 'hash-levels=12'")
    add_device_argument(parser, "every user's local training and the evaluation renders")
    parser.add_argument(
        "--summarise",
        action="store_true",
        help="print the table, redraw leakage.png and grid.png from the results saved in --out",
    )
    return parser


def settings_of(
    args: argparse.Namespace, run_config: dict[str, Any], config: FederatedConfig
) -> Settings:
    """The run's settings from the command line and its run-config (`config`, parsed from
    `run_config`: its `seed` and `cuda-graph`)."""
    return Settings(rounds=args.rounds, epochs=args.epochs, alpha_lr=args.alpha_lr,
                    device=args.device, seed=config.common.seed,
                    step_mode="cuda-graph" if config.scene.cuda_graph else "dynamic",
                    beta_min=args.beta_min, run_config=run_config,
                    personal_learning_rate=args.personal_lr,
                    transient_density_weight=args.transient_density_weight,
                    fixed_alphas=heavy_weighted(args.crowd, args.heavy_user_weight),
                    central_transient_log2_hashmap=args.central_transient_hashmap)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.summarise:
        saved = [json.loads((args.out / f"{m}.json").read_text()) for m in args.methods
                 if (args.out / f"{m}.json").is_file()]  # fmt: skip
        print(table(saved))
        print(json.dumps(occlusion_alphas(args.crowd, saved)))
        plot_curves(args.out / "leakage.png", saved)
        fields = [{**r, "state": torch.load(args.out / f"{r['method']}.pt")} for r in saved
                  if (args.out / f"{r['method']}.pt").is_file()]  # fmt: skip
        if fields:
            config = FederatedConfig.from_run_config(parse_run_config(args.run_config))
            STEP_SCALE["value"] = args.step_scale
            data = CrowdData.load(str(args.crowd), args.downscale)
            grid_figure(args.out / "grid.png", fields, data, config)
        return 0
    run_config = parse_run_config(args.run_config)
    config = FederatedConfig.from_run_config(run_config)
    settings = settings_of(args, run_config, config)
    STEP_SCALE["value"] = args.step_scale
    data = CrowdData.load(str(args.crowd), args.downscale)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    # Imported here: the federation runs through Flower, which the rest of this module (and
    # simulations.bench.gpu's centralised rows, run where Flower is absent) does without.
    from simulations.bench.novel_blender_federation import run_federated

    for method in args.methods:
        if method == "centralised":
            result = run_centralised(data, config, settings)
        else:
            result = run_federated(method, data, config, settings)
        results.append(result)
        saved = {k: v for k, v in result.items() if k != "state"}
        (args.out / f"{method}.json").write_text(json.dumps(saved, indent=1))
        torch.save(result["state"], args.out / f"{method}.pt")  # the server's final field
        print(json.dumps({"method": method, **result["final"], "wall": result["wall-seconds"]}))
    print(table(results))
    print(json.dumps(occlusion_alphas(args.crowd, results)))
    (args.out / "table.md").write_text(table(results) + "\n")
    plot_curves(args.out / "leakage.png", results)
    grid_figure(args.out / "grid.png", results, data, config)
    return 0


def occlusion_groups(crowd: Path) -> dict[int, str]:
    """Each user's occlusion group from crowd.json ("heavy", "light"; "uniform" otherwise)."""
    persons = json.loads((crowd / "crowd.json").read_text()).get("persons", [])
    return {person["user"]: person.get("occlusion", "uniform") for person in persons}


def occlusion_alphas(crowd: Path, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Final alpha per occlusion group ("heavy", "light") of each learned run (paper Fig. 4)."""
    groups = occlusion_groups(crowd)
    summary: dict[str, Any] = {}
    for result in results:
        if not result["alphas"]:
            continue
        final = [trace[-1] for trace in result["alphas"]]
        by_group: dict[str, list[float]] = {}
        for user, alpha in enumerate(final):
            by_group.setdefault(groups.get(user, "uniform"), []).append(alpha)
        summary[result["method"]] = {
            group: round(float(np.mean(values)), 4) for group, values in by_group.items()
        }
    return summary


def heavy_weighted(crowd: Path, heavy_weight: float | None) -> tuple[float, ...] | None:
    """Per-user weights: `heavy_weight` for the crowd's heavily occluded users, 1 for the
    others (None: no fixed weights)."""
    if heavy_weight is None:
        return None
    if heavy_weight < 0:
        raise SystemExit(f"--heavy-user-weight must be >= 0, got {heavy_weight}")
    groups = occlusion_groups(crowd)
    if "heavy" not in groups.values():
        raise SystemExit(f"--heavy-user-weight: {crowd / 'crowd.json'} has no heavily occluded "
                         "users (build the crowd with --preset heterogeneous)")  # fmt: skip
    return tuple(heavy_weight if groups[user] == "heavy" else 1.0 for user in sorted(groups))


def parse_run_config(text: str) -> dict[str, Any]:
    """'key=value key=value' (values as TOML scalars) into a dict."""
    return tomllib.loads("\n".join(text.split())) if text.strip() else {}


if __name__ == "__main__":
    # The importable module's main: run as __main__, this file would be a second copy whose
    # STEP_SCALE the federation (which imports simulations.bench.novel_blender) never sees.
    from simulations.bench.novel_blender import main as bench_main

    raise SystemExit(bench_main())
