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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from PIL import Image

from fedfields.config import FederatedConfig
from fedfields.data.crowd import CrowdData
from fedfields.train.builders import global_field
from fedfields.train.federated import (
    load_federated_state,
)
from simulations.bench.devices import add_device_argument
from simulations.bench.novel_blender_setup import (
    LABELS,
    METHODS,
    STEP_SCALE,
    Settings,
    eval_views,
    fresh_grid,
    parse_run_config,
    render,
    run_centralised,
)


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


if __name__ == "__main__":
    raise SystemExit(main())
