"""Benchmark: SDAR next to the Surrogate Model Attack on SplitNeRF (lego), with S2NeRF noise.

Issue 8, item 3. For each seed and each client defence (none; S2NeRF c=1.2 r=1e-4, the
paper default; S2NeRF c=2.4 r=1, strong and constant), a hash-grid field is split-trained
on lego's training views (every 8th view held out) from the seed, the server recording
every `--record-every`-th exchange. On the row's transcript and server part:

- surrogate: the Surrogate Model Attack (paper 000, `surrogate_model_attack`, its defaults);
- SDAR: `sdar_nerf_attack` with the default `SDARNeRFConfig` (gradient discriminator
  lambda_1 = 0.4, colour flipping p = 0.2), auxiliary data a procedural object of `--aux`
  kind (`procedural_scene`), one attack step per protocol step;
- flip only: the same without d1 (lambda_1 = 0): paper 001's U-shaped SDAR taken literally,
  since its d1 acts on f~, the identity here;
- naive: `SDARNeRFConfig.naive()`, the simulator trained on the auxiliary scene alone;
- untrained: a freshly initialised head (the surrogate's seed), the no-attack baseline.

Training, rendering and scoring are `simulations.bench.split_defences`'s (same defaults,
so its Surrogate Model Attack numbers line up with this table's): each head renders the
held-out views through the row's server part (depth and grey views), scored with SSIM
against a fixed reference, the undefended run's client renders of the same seed ("vs ref":
the scene the client meant to learn), and against the row's own client ("vs own": what
paper 000 scores; under strong noise the client's model is a haze that even an untrained
head matches). Utility: the joint field's held-out PSNR. Cells give the mean over seeds
and, with several, the range.

    .venv/bin/python -m simulations.bench.sdar_splitnerf [--seeds 0 1] [--aux car]
        [--steps 300] [--out runs/bench_sdar_splitnerf]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedfields.privacy.attacks.sdar_nerf import SDARNeRFConfig, procedural_scene, sdar_nerf_attack
from fedfields.privacy.attacks.surrogate import SurrogateAttackConfig, surrogate_model_attack
from fedfields.privacy.split import ClientPart
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.bench.split_defences import (
    Row,
    Views,
    bench_setup,
    render_views,
    server_views,
    similarity,
    train_row,
    untrained_head,
)

ROWS = (Row("none"), Row("s2nerf", c=1.2, r=1e-4), Row("s2nerf", c=2.4, r=1.0))
ATTACKS = ("surrogate", "sdar", "flip only", "naive", "untrained")
METRICS = ("depth_vs_ref", "grey_vs_ref", "depth_vs_own", "grey_vs_own")


def scores(attacked: Views, reference: Views, own: Views) -> dict[str, float]:
    """SSIM of depth and grey views against the reference and the row's own client."""
    vs_ref, vs_own = similarity(attacked, reference), similarity(attacked, own)
    return {
        "depth_vs_ref": vs_ref["ssim_depth"],
        "grey_vs_ref": vs_ref["ssim_grey"],
        "depth_vs_own": vs_own["ssim_depth"],
        "grey_vs_own": vs_own["ssim_grey"],
    }


def run_seed(args: argparse.Namespace, seed: int) -> list[dict]:
    """Every defence row of one seed: train, attack four ways, score."""
    train_scene, test_scene, render_config, split_config = bench_setup(args, seed)
    surrogate_config = SurrogateAttackConfig(seed=seed)
    sdar_configs = {
        "sdar": SDARNeRFConfig(seed=seed),
        "flip only": SDARNeRFConfig(lambda1=0.0, seed=seed),
        "naive": SDARNeRFConfig.naive(seed=seed),
    }
    reference: Views | None = None
    records = []
    for row in ROWS:
        run = train_row(
            row, train_scene, test_scene, split_config, render_config, args.log2_hashmap_size
        )
        held_out = server_views(run.server, test_scene, render_config)
        own = render_views(run.client, held_out, render_config)
        reference = own if reference is None else reference
        # The attacker's own scene, at the distance of the client's (public) ray origins.
        origins = torch.cat([exchange.samples.origins for exchange in run.transcript])
        aux = procedural_scene(
            render_config,
            origins.norm(dim=-1).mean().item(),
            args.aux,
            resolution=max(test_scene.cameras.width, test_scene.cameras.height),
            seed=seed,
        )
        surrogate = surrogate_model_attack(
            run.server, run.transcript, torch.tensor(test_scene.background), surrogate_config
        )
        heads: dict[str, tuple[ClientPart, float]] = {
            "surrogate": (surrogate.head, surrogate.seconds)
        }
        d1_losses: list[float] = []
        for name, config in sdar_configs.items():
            attack = sdar_nerf_attack(run.server, run.transcript, aux, render_config, config)
            heads[name] = (attack.head, attack.seconds)
            if name == "sdar":
                d1_losses = [step["d1"] for step in attack.history]
        heads["untrained"] = (untrained_head(run.server, surrogate_config), 0.0)
        for name, (head, seconds) in heads.items():
            attacked = render_views(head, held_out, render_config)
            records.append(
                {
                    "seed": seed,
                    "defence": row.name,
                    "attack": name,
                    "psnr": run.psnr,
                    "seconds": seconds,
                    **scores(attacked, reference, own),
                }
            )
        print(
            f"seed {seed}, {row.name}: PSNR {run.psnr:.2f} dB (split {run.seconds:.0f} s); "
            + ", ".join(
                f"{record['attack']} {record['depth_vs_ref']:.3f}/{record['depth_vs_own']:.3f}"
                for record in records[-len(heads) :]
            )
            + f" (SSIM-depth vs ref/own); SDAR d1 loss first/last "
            f"{d1_losses[0]:.3f}/{d1_losses[-1]:.3f}",
            flush=True,
        )
    return records


def cell(values: Sequence[float], digits: int = 3) -> str:
    """Mean of the seeds' values with their range in brackets."""
    mean = float(np.mean(values))
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def markdown_table(records: Sequence[dict]) -> str:
    """One line per defence and attack: utility, SSIM-depth and -grey vs ref and own."""
    lines = [
        "| defence | held-out PSNR | attack | SSIM-depth vs ref | SSIM-grey vs ref "
        "| SSIM-depth vs own | SSIM-grey vs own | attack s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        for attack in ATTACKS:
            chosen = [x for x in records if x["defence"] == row.name and x["attack"] == attack]
            cells = [cell([x[m] for x in chosen]) for m in METRICS]
            psnr = cell([x["psnr"] for x in chosen], 2) + " dB"
            seconds = f"{np.mean([x['seconds'] for x in chosen]):.0f}"
            lines.append(
                f"| {row.name} | {psnr} | {attack} | " + " | ".join(cells) + f" | {seconds} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", type=Path, default=APP_DIR / "data" / "lego")
    parser.add_argument("--out", type=Path, default=APP_DIR / "runs" / "bench_sdar_splitnerf")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--aux", default="car", help="procedural object kind of the aux scene")
    parser.add_argument("--downscale", type=float, default=8.0)
    parser.add_argument("--holdout", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-rays", type=int, default=128)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--log2-hashmap-size", type=int, default=14)
    parser.add_argument("--record-every", type=int, default=10)
    add_device_argument(parser, "split training and the attacks", default="cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="LPIPS unavailable")
    start = time.perf_counter()
    print(
        f"lego, downscale {args.downscale:g}, {args.steps} split steps of {args.batch_rays} "
        f"rays x {args.samples} samples, every {args.record_every}th exchange recorded; "
        f"auxiliary scene: procedural {args.aux}; seeds {args.seeds}; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    records = [record for seed in args.seeds for record in run_seed(args, seed)]
    seconds = time.perf_counter() - start
    table = markdown_table(records)
    print(table)
    print(f"wall time {seconds:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"settings": settings, "seconds": seconds, "records": records}
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    (args.out / "table.md").write_text(table + "\n")
    print(f"wrote {args.out / 'results.json'} and table.md")


if __name__ == "__main__":
    main()
