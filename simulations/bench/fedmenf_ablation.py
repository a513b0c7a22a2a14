"""Benchmark: where FedMeNF's utility goes, one change at a time, in process (no Flower).

The `--task` preset's federation (faces or photos: N clients, M sampled per round by a seeded
RNG, FedAvg of the uploads weighted by |D|) run with the library's `local_meta_update`; each
variant's final theta is scored by test-time optimisation on the held-out tasks under several
TTO recipes, beside the final round's PSNR_p of the uploads. Variants: MAML, FedMeNF (gamma
0.75) with the paper's unbounded L_pp, and FedMeNF with L(w) clamped at each `--bounds` MSE
(run-config `memorising-bound`), for each of `--gammas`; `--local` adds TTO from the random
initialisation.

    python -m simulations.bench.fedmenf_ablation --rounds 20 --bounds 0.25 0.15 0.1
    python -m simulations.bench.fedmenf_ablation --rounds 20 --gammas 0.25 1 --bounds 0.15
    python -m simulations.bench.fedmenf_ablation --bounds 0.15 --no-unbounded \\
        --tto adam:1e-4:32 adam:1e-4:256 adam:3e-4:128
    python -m simulations.bench.fedmenf_ablation --task photos --bounds 0.15 --local \\
        --run-config "outer-lr=0.01"
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch
from flwr.common.config import parse_config_args
from torch import nn

from fedfields.config import FederatedConfig, meta_settings
from fedfields.train.builders import (
    client_meta_tasks,
    heldout_meta_tasks,
    meta_config,
    meta_model,
)
from fedfields.train.meta import local_meta_update, privacy_metrics, test_time_optimise
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from strategies import parse_app_config

OUT = APP_DIR / "runs" / "bench_fedmenf_ablation"  # results-<task>.json
TTO_RECIPES = (("adam", 1e-4, 32), ("adam", 1e-3, 128), ("sgd", 0.005, 32))
"""(optimiser, rate, steps): the preset's, a longer faster Adam, SGD at the inner-loop rate."""


def federate(
    learner: str,
    rounds: int,
    bound: float | None,
    gamma: float = 0.75,
    task: str = "faces",
    overrides: dict | None = None,
    device: str = "auto",
) -> dict:
    """`rounds` of FedAvg over the `task` clients' local meta-updates on `device` (run-config
    `overrides` on top of the preset, e.g. "outer-lr"); theta and PSNR_p."""
    run_config = {"task": task, "meta-learner": learner, "num-server-rounds": max(rounds, 1)}
    run_config |= overrides or {}
    if learner == "fedmenf":
        run_config["gamma"] = gamma
    config = parse_app_config(run_config)
    settings = meta_settings(config)
    torch.manual_seed(config.common.seed)
    model = meta_model(config, settings).to(device)  # TTO and PSNR_p follow the model
    theta = {name: p.detach().clone() for name, p in model.named_parameters()}
    sampler = np.random.default_rng(config.common.seed)
    psnr_p: list[float] = []
    for server_round in range(rounds):
        sampled = sampler.choice(settings.num_clients, config.meta.clients_per_round, False)
        uploads, weights, psnr_p = [], [], []
        for client in map(int, sampled):
            model.load_state_dict(theta, strict=False)
            tasks = client_meta_tasks(config, settings, client)
            local = meta_config(
                config,
                settings,
                outer_steps=settings.outer_steps,
                seed=server_round * 1009 + client,
            )
            result = local_meta_update(
                model, tasks, replace(local, memorising_bound=bound, device=device)
            )
            uploads.append(result.state)
            weights.append(result.num_examples)
            psnr_p += [privacy_metrics(model, result.state, t, False)["psnr_p"] for t in tasks]
        total = float(sum(weights))
        theta = {
            name: sum(w / total * upload[name] for upload, w in zip(uploads, weights, strict=True))
            for name in theta
        }
    mean_psnr_p = float(np.mean(psnr_p)) if psnr_p else None  # None: no round, no upload
    return {"theta": theta, "psnr_p": mean_psnr_p, "model": model, "config": config}


def tto_recipe(text: str) -> tuple[str, float, int]:
    """An `--tto` recipe "optimiser:rate:steps" (e.g. "adam:1e-4:32") as a TTO_RECIPES entry."""
    try:
        optimiser, rate, steps = text.split(":")
        recipe = (optimiser, float(rate), int(steps))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tto {text!r}: expected optimiser:rate:steps") from None
    if optimiser not in ("adam", "sgd") or recipe[1] <= 0 or recipe[2] < 1:
        raise argparse.ArgumentTypeError(f"--tto {text!r}: adam|sgd, rate > 0, steps >= 1")
    return recipe


def tto_scores(
    model: nn.Module,
    theta: dict,
    config: FederatedConfig,
    recipes: tuple[tuple[str, float, int], ...] = TTO_RECIPES,
) -> dict[str, float]:
    """Mean held-out PSNR after each TTO recipe from theta."""
    settings = meta_settings(config)
    heldout = heldout_meta_tasks(config, settings)
    scores = {}
    for optimiser, rate, steps in recipes:
        curves = [
            test_time_optimise(
                model,
                theta,
                task,
                (steps,),
                learning_rate=rate,
                optimizer=optimiser,
                batch_size=settings.support_batch,
                with_lpips=False,
            )
            for task in heldout
        ]
        scores[f"{optimiser} {rate:g} x{steps}"] = float(
            np.mean([curve[steps]["psnr"] for curve in curves])
        )
    return scores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--task", choices=("faces", "photos"), default="faces")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bounds", type=float, nargs="*", default=[0.25, 0.15, 0.1])
    parser.add_argument(
        "--gammas", type=float, nargs="+", default=[0.75], help="FedMeNF's gamma, each x bounds"
    )
    parser.add_argument(
        "--no-unbounded", action="store_true", help="skip FedMeNF's unbounded (paper's) L_pp"
    )
    parser.add_argument(
        "--tto",
        type=tto_recipe,
        nargs="+",
        default=list(TTO_RECIPES),
        help="TTO recipes optimiser:rate:steps (default: adam:1e-4:32 adam:1e-3:128 sgd:5e-3:32)",
    )
    parser.add_argument(
        "--run-config", default="", help="run-config on top of the preset, e.g. 'outer-lr=0.01'"
    )
    parser.add_argument(
        "--local", action="store_true", help="add TTO from the random initialisation (no rounds)"
    )
    add_device_argument(parser, "meta-learning, TTO and PSNR_p")
    args = parser.parse_args(argv)
    overrides = parse_config_args([args.run_config]) if args.run_config.strip() else {}
    OUT.mkdir(parents=True, exist_ok=True)
    variants: list[tuple[str, str, float | None, float]] = [("MAML", "maml", None, 0.0)]
    local = "Local (random init, no federation)"  # TTO from theta before any round
    if args.local:
        variants.insert(0, (local, "maml", None, 0.0))
    for gamma in args.gammas:
        if not args.no_unbounded:
            variants.append((f"FedMeNF gamma {gamma:g} (paper)", "fedmenf", None, gamma))
        variants += [
            (f"FedMeNF gamma {gamma:g}, bound {b:g}", "fedmenf", b, gamma) for b in args.bounds
        ]
    rows = []
    for name, learner, bound, gamma in variants:
        started = time.perf_counter()
        rounds = 0 if name == local else args.rounds
        run = federate(learner, rounds, bound, gamma, args.task, overrides, args.device)
        rows.append(
            {
                "variant": name,
                "psnr_p": run["psnr_p"],
                **tto_scores(run["model"], run["theta"], run["config"], tuple(args.tto)),
                "seconds": time.perf_counter() - started,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        (OUT / f"results-{args.task}.json").write_text(json.dumps(rows, indent=2))
    recipes = [k for k in rows[0] if k not in ("variant", "psnr_p", "seconds")]
    print("| variant | PSNR_p | " + " | ".join(f"PSNR after TTO {r}" for r in recipes) + " |")
    print("|---" * (len(recipes) + 2) + "|")
    for row in rows:
        cells = [f"{row[r]:.2f}" for r in recipes]
        leak = "-" if row["psnr_p"] is None else f"{row['psnr_p']:.2f}"
        print(f"| {row['variant']} | {leak} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
