"""The `fedfields` command line: centralised training, evaluation, dataset building, and the
audit of finished runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from fedfields import atomic
from fedfields.data import Scene, SceneError, holdout_indices, load_scene
from fedfields.data.crowd import (
    LAYOUTS,
    PARTITIONS,
    PRESETS,
    CrowdConfig,
    crowd_from_scene_dir,
    write_crowd,
)
from fedfields.data.figures import OBJECT_KINDS
from fedfields.data.objects import CollectionConfig, write_collection
from fedfields.devices import DEVICE_CHOICES, parse_device, resolve_device
from fedfields.train import (
    default_setup,
    evaluate,
    load_checkpoint,
    save_checkpoint,
    train,
    write_renders,
)
from fedfields.train.splats import SplatTrainConfig, splat_render_config, train_splats

BACKGROUNDS = {"white": (1.0, 1.0, 1.0), "black": (0.0, 0.0, 0.0)}
SPLAT_MINUTES_STEP_CAP = 30_000
"""Steps a `--minutes` splat run may take at most (3DGS's schedule); the clock usually stops it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedfields", description="Train and evaluate neural fields (NeRF, hash grid)."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train_parser = commands.add_parser(
        "train",
        help="train a field centrally on a scene",
        description="Train a field on a scene; writes checkpoint.pt, metrics.json and renders/.",
    )
    train_parser.add_argument("--scene", required=True, type=Path, help="scene directory")
    train_parser.add_argument(
        "--model",
        choices=["hashgrid", "nerf", "splats"],
        default="hashgrid",
        help="splats: 3D Gaussians, rasterised, with gsplat's density control (the 'splats' "
        "extra); --static-step and --cuda-graph are for the ray-marched fields",
    )
    train_parser.add_argument("--downscale", type=float, default=1.0, help="image downscale")
    train_parser.add_argument(
        "--gaussians",
        type=int,
        default=SplatTrainConfig.initial_count,
        help="--model splats: Gaussians to start from, uniform in the scene box",
    )
    train_parser.add_argument(
        "--max-gaussians",
        type=int,
        default=SplatTrainConfig.max_gaussians,
        help="--model splats: the most Gaussians density control may grow to (this machine's "
        "memory budget); the faintest are pruned above it",
    )
    budget = train_parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="wall-clock training budget")
    budget.add_argument("--steps", type=int, help="number of optimisation steps")
    train_parser.add_argument(
        "--holdout",
        type=int,
        default=8,
        help="hold out every K-th view for evaluation (0: evaluate on the training views)",
    )
    train_parser.add_argument("--out", required=True, type=Path, help="output directory")
    train_parser.add_argument("--background", choices=sorted(BACKGROUNDS), default="white")
    train_parser.add_argument("--seed", type=int, default=0)
    steps = train_parser.add_mutually_exclusive_group()
    steps.add_argument(
        "--static-step",
        action="store_true",
        help="fixed-shape steps with no host sync (fedfields.train.static_step)",
    )
    steps.add_argument(
        "--cuda-graph",
        action="store_true",
        help="static steps captured once per batch shape as CUDA graphs (needs CUDA)",
    )
    train_parser.add_argument("--no-progress", action="store_true", help="hide progress bars")

    eval_parser = commands.add_parser(
        "eval",
        help="score a checkpoint on a scene",
        description="Render views of a scene from a checkpoint; print mean psnr/ssim/lpips JSON.",
    )
    eval_parser.add_argument("--checkpoint", required=True, type=Path)
    eval_parser.add_argument("--scene", required=True, type=Path, help="scene directory")
    eval_parser.add_argument("--downscale", type=float, default=1.0, help="image downscale")
    eval_parser.add_argument(
        "--views",
        choices=["all", "holdout", "train"],
        default="all",
        help="all views, or the held-out / training views of the checkpoint's --holdout split",
    )
    eval_parser.add_argument("--renders", type=Path, help="also write PNG renders here")
    eval_parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    _add_data_commands(commands)
    _add_attack_commands(commands)
    _add_audit_command(commands)
    return parser


def _add_audit_command(commands: argparse._SubParsersAction) -> None:
    """`fedfields audit RUN_DIR ...`: utility versus leakage of finished runs."""
    audit = commands.add_parser(
        "audit",
        help="run every attack and metric that applies to finished runs; one table",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Audit finished runs (directories with config.json and checkpoint.pt) as the experimenter,
reading the ground truth their run-config names (data-dir); prints one utility-versus-leakage
table, one row per run, and writes audit.json and audit.png into each run directory.

  scene (fednerf, decentnerf, fedavg...): utility = clean-view PSNR/SSIM of the checkpoint's
    global field on the crowd's views; leakage = PSNR inside each user's person masks against
    the photo, rendered from that field (what the server reads), next to the floor (a field
    that renders no person); plus the observer's per-round figures (uploads' personal PSNR)
    as recorded during the run.
  meta (faces, photos, video, objects): utility = PSNR after test-time optimisation from
    theta on the held-out tasks; leakage = PSNR_p of theta on the clients' query sets (blind
    and oracle rescaled too) and membership inference against theta; plus summary.json's
    figures of the clients' uploads as recorded during the run.
  split: utility = held-out PSNR of the client's joint field; leakage = SSIM-depth/grey of the
    Surrogate Model Attack (offline and online), SDAR and its naive baseline against the
    client's renders, from transcript.pt (runs made with split-attack); reference = an
    untrained surrogate head.""",
    )
    audit.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directory")
    audit.add_argument("--seed", type=int, default=0, help="seed of the attacks (default 0)")
    audit.add_argument("--max-views", type=int, help="scene: first N views of each user")
    audit.add_argument("--max-clients", type=int, help="meta: first N clients' query sets")
    audit.add_argument(
        "--sdar-aux",
        choices=OBJECT_KINDS,
        default="car",
        help="split: the procedural object the SDAR attacker owns (default car)",
    )
    audit.add_argument(
        "--device",
        default="auto",
        help=f"scene and meta audits render on it: {DEVICE_CHOICES} (default auto: CUDA if any)",
    )
    audit.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run_audit(args: argparse.Namespace) -> int:
    from fedfields.audit import AuditConfig, audit_runs, format_table, write_audit

    parse_device(args.device, "--device")  # a bad device fails before any run is read
    config = AuditConfig(
        device=args.device,
        seed=args.seed,
        max_views=args.max_views,
        max_clients=args.max_clients,
        sdar_aux=args.sdar_aux,
        progress=not args.no_progress,
    )
    results = audit_runs(args.run_dirs, config)
    write_audit(results)
    print(format_table(results))
    return 0


def _add_data_commands(commands: argparse._SubParsersAction) -> None:
    """`fedfields data crowd|objects`: build crowdsourced scenes and object collections."""
    data_parser = commands.add_parser(
        "data",
        help="build datasets: crowdsourced scenes, object collections",
        description="Build federated datasets with ground truth for privacy measurements.",
    )
    data_commands = data_parser.add_subparsers(dest="data_command", required=True)
    crowd = data_commands.add_parser(
        "crowd",
        help="split a scene among users, each with their own person in their views",
        description=(
            "Partition a transforms.json scene's views among users and composite Lego-like "
            "persons into them. Default (layout novel-blender, DecentNeRF's benchmark): users "
            "hold yaw sectors; every view shows the user's static person (same 3D spot in all "
            "its views) and --transients-per-view passers-by, all standing on the object's "
            "ground around it, occluded by the object where it is nearer. --preset "
            "heterogeneous: 8 users x 10 random views, 4 heavily occluded (larger persons and "
            "passers-by) and 4 lightly (static person only). --layout front: one person per "
            "user in front of the scene (older layout). Writes DIR/user_NN/transforms.json "
            "with file_path (composited), mask_path (all persons), personal_mask_path (static "
            "person), transient_mask_path and clean_path per frame, DIR/crowd.json (persons, "
            "occlusion, coverage) and DIR/contact_sheet.png."
        ),
    )
    crowd.add_argument("--scene", required=True, type=Path, help="scene directory")
    crowd.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="novel-blender",
        help="novel-blender: 16 users x 5 views (default); heterogeneous: DecentNeRF Fig. 4, "
        "8 users x 10 random views, half heavily and half lightly occluded",
    )
    crowd.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        default="novel-blender",
        help="novel-blender: persons on the ground around the object (default); front: one "
        "person per user between its cameras and the scene",
    )
    crowd.add_argument("--users", type=int, help="number of users (default 16, preset's)")
    crowd.add_argument("--views-per-user", type=int, help="views per user (default 5, preset's)")
    crowd.add_argument("--downscale", type=float, default=1.0, help="image downscale")
    crowd.add_argument(
        "--heldout-views",
        type=int,
        default=0,
        help="clean views no user photographed, spread evenly around the scene and set aside "
        "before the users' views are drawn (heldout/): every scene table scores on them "
        "(default 0: only views the partition leaves)",
    )
    crowd.add_argument(
        "--partition",
        choices=list(PARTITIONS),
        help="yaw: contiguous yaw sectors (novel-blender default); directions: balanced "
        "clusters of nearby viewing directions (front default); random (heterogeneous)",
    )
    crowd.add_argument(
        "--transients-per-view",
        type=int,
        default=5,
        help="novel-blender: passers-by in every view (default 5)",
    )
    crowd.add_argument(
        "--person-scale",
        type=float,
        default=CrowdConfig.person_scale,
        help=(
            "novel-blender: a person's height as a share of the object's height above the "
            f"ground (default {CrowdConfig.person_scale})"
        ),
    )
    crowd.add_argument(
        "--transients",
        type=float,
        default=0.0,
        help="front: probability that a view also shows a one-off passer-by (default 0)",
    )
    crowd.add_argument("--seed", type=int, default=0)
    crowd.add_argument("--out", required=True, type=Path, help="output directory (new or empty)")
    crowd.add_argument("--no-progress", action="store_true", help="hide progress bars")

    objects = data_commands.add_parser(
        "objects",
        help="render a collection of procedural objects for few-shot NeRF",
        description=(
            "Render N procedural objects (cars, chairs, tables, ...) from V random views on a "
            "sphere on white; write DIR/object_NNN/transforms.json whose frames are tagged "
            "support/query/test (Dirichlet(alpha) counts, mean 4 + 4) and DIR/collection.json."
        ),
    )
    objects.add_argument("--count", type=int, required=True, help="number of objects")
    objects.add_argument("--views", type=int, required=True, help="views rendered per object")
    objects.add_argument("--resolution", type=int, default=64, help="image size (default 64)")
    objects.add_argument("--alpha", type=float, default=1.0, help="Dirichlet concentration")
    objects.add_argument("--seed", type=int, default=0)
    objects.add_argument("--out", required=True, type=Path, help="output directory (new or empty)")
    objects.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _add_attack_commands(commands: argparse._SubParsersAction) -> None:
    """`fedfields sdar-digits`: the SDAR audit of a split CNN on scikit-learn's digits."""
    sdar = commands.add_parser(
        "sdar-digits",
        help="train a split CNN on digits while SDAR and the naive attack watch; score them",
        description="SDAR (paper 001) against split learning of a small CNN on load_digits: "
        "the client's private half trains with the server; the attacker holds the other half. "
        "Prints utility and attack scores as JSON and writes <attack>.png (private digits "
        "over their reconstructions) to --out.",
    )
    sdar.add_argument("--split-level", type=int, default=2, help="conv blocks on the client")
    sdar.add_argument("--u-shaped", action="store_true", help="the client also holds the top")
    sdar.add_argument("--steps", type=int, default=400)
    sdar.add_argument("--dropout", type=float, default=0.0, help="defence (paper Sec. VI)")
    sdar.add_argument("--l2", type=float, default=0.0, help="defence (paper Sec. VI)")
    sdar.add_argument("--seed", type=int, default=0)
    sdar.add_argument("--out", type=Path, required=True, help="folder for the PNGs")


def run_sdar_digits(args: argparse.Namespace) -> int:
    from fedfields.privacy.attacks import SDARConfig
    from fedfields.privacy.attacks.sdar_digits import U_SHAPED_SDAR, DigitsSplitConfig, digits_audit

    config = DigitsSplitConfig(
        args.split_level,
        args.u_shaped,
        args.steps,
        dropout=args.dropout,
        l2=args.l2,
        seed=args.seed,
    )
    sdar = dataclasses.replace(
        U_SHAPED_SDAR if args.u_shaped else SDARConfig(), weight_decay=2 * args.l2
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = digits_audit(config, {"sdar": sdar, "naive": SDARConfig.naive()}, png_dir=args.out)
    scores = {
        name: {
            "mse": score.mse,
            "untrained_mse": score.untrained_mse,
            "label_accuracy": score.label_accuracy,
        }
        for name, score in result.scores.items()
    }
    report = {
        "test_accuracy": result.test_accuracy,
        "mean_image_mse": result.mean_image_mse,
        "attacks": scores,
        "pngs": {name: str(path) for name, path in result.pngs.items()},
    }
    print(json.dumps(report))
    return 0


def split_views(scene: Scene, holdout: int) -> tuple[Scene, Scene]:
    """(training views, evaluation views); holdout 0 evaluates on the training views."""
    if holdout == 0:
        return scene, scene
    train_ids, heldout_ids = holdout_indices(len(scene), holdout)
    if not train_ids:
        raise ValueError(f"--holdout {holdout} holds out every view; use 0 or at least 2")
    return scene.subset(train_ids), scene.subset(heldout_ids)


def run_train(args: argparse.Namespace) -> int:
    scene = load_scene(
        args.scene, downscale=args.downscale, background=BACKGROUNDS[args.background]
    )
    train_scene, eval_scene = split_views(scene, args.holdout)
    if args.model == "splats":
        return run_train_splats(args, train_scene, eval_scene)
    setup = default_setup(args.model, train_scene, seed=args.seed)
    field, render_config, occupancy = setup.field, setup.render_config, setup.occupancy
    step_mode = "cuda-graph" if args.cuda_graph else "static" if args.static_step else "dynamic"
    config = setup.train_config(
        steps=args.steps,
        minutes=args.minutes,
        seed=args.seed,
        progress=not args.no_progress,
        step_mode=step_mode,
    )
    result = train(field, train_scene, config, render_config, occupancy)
    evaluation = evaluate(field, eval_scene, render_config, occupancy, progress=config.progress)
    args.out.mkdir(parents=True, exist_ok=True)
    metadata = {
        "scene": str(args.scene),
        "downscale": args.downscale,
        "holdout": args.holdout,
        "model": args.model,
    }
    save_checkpoint(args.out / "checkpoint.pt", field, render_config, occupancy, metadata)
    write_renders(args.out / "renders", eval_scene, evaluation, render_config)
    metrics = {
        **metadata,
        "eval_views": [p.name for p in eval_scene.image_paths],
        "eval": {**evaluation.summary(), "per_view_psnr": evaluation.per_view_psnr},
        "train": {
            "steps": result.steps,
            "rays": result.rays,
            "seconds": result.seconds,
            "rays_per_second": result.rays_per_second,
            "samples_per_ray": result.samples / max(result.rays, 1),
            "history": result.history,
        },
        "config": {
            "train": asdict(config),
            "render": asdict(render_config),
            "field": field.config_dict(),
        },
    }
    atomic.write_json(args.out / "metrics.json", metrics)
    summary = {**evaluation.summary(), "rays_per_second": result.rays_per_second}
    print(json.dumps(summary))
    return 0


def run_train_splats(args: argparse.Namespace, train_scene: Scene, eval_scene: Scene) -> int:
    """`fedfields train --model splats`: `fedfields.train.splats` on the training views, then
    the same evaluation, renders and files as the ray-marched fields."""
    if args.static_step or args.cuda_graph:
        raise ValueError("--static-step and --cuda-graph are for ray-marched fields, not splats")
    config = SplatTrainConfig(
        steps=args.steps or SPLAT_MINUTES_STEP_CAP,
        initial_count=args.gaussians,
        max_gaussians=args.max_gaussians,
        seconds=None if args.minutes is None else 60.0 * args.minutes,
        seed=args.seed,
    )
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    with tqdm(total=config.steps, desc="splats", disable=args.no_progress) as bar:

        def on_step(step: int, loss: float, count: int) -> None:
            bar.update()
            if step % 100 == 0:
                bar.set_postfix(loss=f"{loss:.4f}", gaussians=count)
                history.append({"step": step, "loss": loss, "gaussians": count})

        field = train_splats(train_scene, config, on_step, resolve_device("auto"))
    seconds = time.perf_counter() - start
    render_config = splat_render_config(train_scene)
    evaluation = evaluate(field, eval_scene, render_config, None, progress=not args.no_progress)
    args.out.mkdir(parents=True, exist_ok=True)
    metadata = {"scene": str(args.scene), "downscale": args.downscale,
                "holdout": args.holdout, "model": args.model}  # fmt: skip
    save_checkpoint(args.out / "checkpoint.pt", field, render_config, None, metadata)
    write_renders(args.out / "renders", eval_scene, evaluation, render_config)
    gaussians = field.config.count
    metrics = {
        **metadata,
        "eval_views": [p.name for p in eval_scene.image_paths],
        "eval": {**evaluation.summary(), "per_view_psnr": evaluation.per_view_psnr},
        "train": {
            "seconds": seconds,
            "gaussians": gaussians,
            "bytes": sum(p.numel() * p.element_size() for p in field.parameters()),
            "history": history,
        },  # fmt: skip
        "config": {
            "train": asdict(config),
            "render": asdict(render_config),
            "field": field.config_dict(),
        },  # fmt: skip
    }
    atomic.write_json(args.out / "metrics.json", metrics)
    print(json.dumps({**evaluation.summary(), "gaussians": gaussians}))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    field, render_config, occupancy, metadata = load_checkpoint(args.checkpoint)
    field.to(resolve_device("auto"))
    scene = load_scene(args.scene, downscale=args.downscale, background=render_config.background)
    if args.views != "all":
        holdout = int(metadata.get("holdout", 0))
        if holdout <= 0:
            raise ValueError(f"--views {args.views}: {args.checkpoint} was trained without holdout")
        train_scene, eval_scene = split_views(scene, holdout)
        scene = eval_scene if args.views == "holdout" else train_scene
    evaluation = evaluate(field, scene, render_config, occupancy, progress=not args.no_progress)
    if args.renders is not None:
        write_renders(args.renders, scene, evaluation, render_config)
    print(json.dumps({**evaluation.summary(), "views": len(scene)}))
    return 0


def run_crowd(args: argparse.Namespace) -> int:
    given = {
        "users": args.users,
        "views_per_user": args.views_per_user,
        "partition": args.partition,
    }
    config = CrowdConfig(
        **{
            **PRESETS[args.preset],
            **{key: value for key, value in given.items() if value is not None},
        },
        layout=args.layout,
        seed=args.seed,
        transients_per_view=args.transients_per_view,
        person_scale=args.person_scale,
        transient_probability=args.transients,
        heldout_views=args.heldout_views,
    )
    crowd = crowd_from_scene_dir(
        args.scene, config, downscale=args.downscale, progress=not args.no_progress
    )
    source = {"scene": str(Path(args.scene).resolve()), "downscale": args.downscale}
    write_crowd(crowd, args.out, source={**source, "config": asdict(config)})
    stats = crowd.partition.stats()
    print(json.dumps({"out": str(args.out), "users": len(crowd.users), "partition": stats}))
    return 0


def run_objects(args: argparse.Namespace) -> int:
    config = CollectionConfig(
        count=args.count,
        views=args.views,
        resolution=args.resolution,
        alpha=args.alpha,
        seed=args.seed,
    )
    summary = write_collection(config, args.out, progress=not args.no_progress)
    print(
        json.dumps(
            {"out": str(args.out), **{k: summary[k] for k in ("support_views", "query_views")}}
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fedfields` command; errors in inputs exit with status 2."""
    args = build_parser().parse_args(argv)
    warnings.formatwarning = lambda message, *_args, **_kw: f"fedfields: warning: {message}\n"
    commands = {
        "train": run_train,
        "eval": run_eval,
        "crowd": run_crowd,
        "objects": run_objects,
        "sdar-digits": run_sdar_digits,
        "audit": run_audit,
    }
    name = args.command if args.command != "data" else args.data_command
    try:
        return commands[name](args)
    except (SceneError, ValueError, FileNotFoundError) as error:
        print(f"fedfields {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
