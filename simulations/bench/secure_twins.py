"""Benchmark: the default scene job with and without secure aggregation, same seeds, side by side.

Both runs go through Flower's simulation engine (Ray) with the App's run-config defaults (the
`make demo` job: DecentNeRF, 16 users of the Novel Blender crowd, 8 sampled a round, 8
rounds) plus `--run-config`; the secure twin adds `secure-aggregation=true min-train-nodes=3`.
The strategies sample nodes with their own seeded RNG, so both runs train the same users each
round, and SecAgg+ should change the global field by its quantisation error only. Prints,
per round, the observer's clean PSNR of both runs, then the final audit (all views) and the
relative L2 difference of the two final fields.

    python -m simulations.bench.secure_twins [--rounds 8] [--run-config "strategy='fedavg'"]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.planner import ENVIRONMENT, DataOptions, crowd_dataset, job_config
from simulations.run import run_with_ray

SECURE = {"secure-aggregation": True, "min-train-nodes": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m simulations.bench.secure_twins")
    parser.add_argument("--rounds", type=int, default=8, help="num-server-rounds of both runs")
    parser.add_argument("--users", type=int, default=16, help="crowd users, one node each")
    parser.add_argument("--run-config", default="", help="extra run-config for both runs")
    parser.add_argument(
        "--out", type=Path, default=None, help="runs folder (default runs/<time>-secure-twins)"
    )
    add_device_argument(parser, "the server and the Ray clients")
    return parser.parse_args(argv)


def twin_config(base: dict, out: Path, name: str, crowd: Path, secure: bool) -> dict:
    """One twin's run-config: the App's defaults and overrides, its own run and state folders."""
    run_dir = out / name
    config = {
        **base,
        "data-dir": str(crowd),
        "run-dir": str(run_dir),
        "state-dir": str(run_dir.with_name(name + ".nodes")),
        "simulation-audit": True,
    }
    return config | (SECURE if secure else {})


def final_field(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's final global field (checkpoint.pt)."""
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["state_dict"]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every tensor."""
    difference = torch.cat([(a[k].double() - b[k].double()).flatten() for k in b])
    return float(difference.norm() / torch.cat([b[k].double().flatten() for k in b]).norm())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.update(ENVIRONMENT)
    out = args.out or APP_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-secure-twins"
    out.mkdir(parents=True, exist_ok=True)
    crowd = crowd_dataset(
        DataOptions(scene=APP_DIR / "data" / "lego", users=args.users), dict(os.environ)
    )
    extra = f"num-server-rounds={args.rounds} server-device='{args.device}' {args.run_config}"
    base = job_config(extra).to_run_config()
    rows: dict[str, list[dict]] = {}
    for name, secure in (("plain", False), ("secure", True)):
        started = time.perf_counter()
        config = twin_config(base, out, name, crowd, secure)
        run_dir = run_with_ray(config, args.users, client_device=args.device)
        seconds = time.perf_counter() - started
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        rows[name] = [json.loads(line) for line in lines]
        summary = json.loads((run_dir / "summary.json").read_text())
        print(f"{name}: {seconds:.0f} s, {run_dir}; final {json.dumps(summary.get('final'))}")
    print("round | plain clean-psnr | secure clean-psnr")
    for plain, secure in zip(rows["plain"], rows["secure"], strict=True):
        print(f"{plain['round']:5d} | {plain['clean-psnr']:.2f} | {secure['clean-psnr']:.2f}")
    difference = relative_difference(final_field(out / "secure"), final_field(out / "plain"))
    print(f"final fields: relative L2 difference {difference:.2e}")


if __name__ == "__main__":
    main()
