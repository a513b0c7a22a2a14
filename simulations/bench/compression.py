"""Benchmark skeleton (issue 45): bytes up per round and final clean PSNR of FedNeRF (strategy
fedavg, plaintext) on the Novel Blender crowd, each compression scheme at two or three
strengths against none, through Flower's simulation engine (Ray) with the App's run-config
defaults plus `--run-config`.

Each setting is one run-config (`setting_run_config`), validated by the run-config schema
before anything runs, so a setting the App refuses stops the benchmark at once. The rows
(`read_row`) come from each run's metrics.jsonl (mean bytes-up per round) and summary.json
(final clean PSNR); the table goes to compression.md under `--out`. Not built yet: DecentNeRF
(compression refuses it), the SecAgg+ rows and the bytes-versus-PSNR figure.
`--bytes-only` trains nothing: it prints the bytes of one compressed upload of the run's
global field (a seeded random update) per setting, against the float32 upload.

    python -m simulations.bench.compression --users 4 --rounds 2 --schemes topk --fractions 0.05
    python -m simulations.bench.compression --bytes-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedfields import atomic
from fedfields.compression import compress, full_bytes, record_bytes
from fedfields.flower.protocol import BYTES_UP
from fedfields.train.builders import global_field
from fedfields.train.federated import federated_state
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.bench.secure_twins import twin_config
from simulations.planner import ENVIRONMENT, DataOptions, crowd_dataset, job_config
from simulations.run import run_with_ray
from strategies import parse_app_config

SCHEMES = ("lowrank", "quantise", "topk")
STRENGTH_KEYS = {
    "lowrank": "compression-rank",
    "quantise": "compression-bits",
    "topk": "compression-fraction",
}
"""Each scheme -> the run-config key of its strength."""


@dataclass(frozen=True)
class Setting:
    """One run of the benchmark: a scheme ("none": uncompressed) at one strength."""

    scheme: str
    strength: float | int | None = None

    @property
    def name(self) -> str:
        """The run's folder name, e.g. "topk-0.05" or "none"."""
        return self.scheme if self.strength is None else f"{self.scheme}-{self.strength:g}"


@dataclass(frozen=True)
class Row:
    """What a run measured: mean bytes up per round and the final clean PSNR."""

    setting: str
    bytes_up: float
    clean_psnr: float | None


def plan(args: argparse.Namespace) -> list[Setting]:
    """The runs: none first, then each scheme asked for at each of its strengths."""
    strengths = {"lowrank": args.ranks, "quantise": args.bits, "topk": args.fractions}
    return [Setting("none")] + [
        Setting(scheme, strength) for scheme in args.schemes for strength in strengths[scheme]
    ]


def setting_run_config(setting: Setting, extra: str = "") -> dict[str, Any]:
    """The App's run-config of `setting` (strategy fedavg plus `extra`), validated by the
    schema: a setting the App refuses is its ValueError before anything runs."""
    text = f"strategy='fedavg' compression='{setting.scheme}' {extra}"
    if setting.strength is not None:
        text += f" {STRENGTH_KEYS[setting.scheme]}={setting.strength}"
    return job_config(text).to_run_config()


def upload_bytes(setting: Setting, run_config: dict[str, Any]) -> tuple[int, int]:
    """(compressed, float32) bytes of one upload of the run's global field under `setting`:
    a seeded random update of the field's shapes (the bytes depend on shapes, not values)."""
    config = parse_app_config(run_config)
    compression = config.compression.compression_config()
    generator = torch.Generator().manual_seed(0)
    update = {
        key: torch.randn(value.shape, generator=generator)
        for key, value in federated_state(global_field(config)).items()
    }
    if compression is None:
        return full_bytes(update), full_bytes(update)
    return record_bytes(compress(update, compression, generator)), full_bytes(update)


def read_row(setting: Setting, run_dir: Path) -> Row:
    """A finished run's row: mean "bytes-up" over its rounds, summary.json's clean PSNR."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    uploads = [float(line[BYTES_UP]) for line in lines if BYTES_UP in line]
    return Row(
        setting.name,
        statistics.fmean(uploads) if uploads else 0.0,
        summary.get("final", {}).get("clean-psnr"),
    )


def table(rows: list[Row]) -> str:
    """The markdown table: bytes up per round, its ratio to none's, clean PSNR and its change."""
    base = next((row for row in rows if row.setting == "none"), None)
    lines = [
        "| setting | bytes up / round | x fewer | clean PSNR (dB) | vs none (dB) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = base.bytes_up / row.bytes_up if base and row.bytes_up else None
        delta = (
            row.clean_psnr - base.clean_psnr
            if base and row.clean_psnr is not None and base.clean_psnr is not None
            else None
        )
        cells = [
            row.setting,
            f"{row.bytes_up:.0f}",
            "-" if ratio is None else f"{ratio:.1f}",
            "-" if row.clean_psnr is None else f"{row.clean_psnr:.2f}",
            "-" if delta is None else f"{delta:+.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's settings; strengths out of a scheme's range are refused by `plan`'s
    run-configs, not here."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 8], help="lowrank: r")
    parser.add_argument("--bits", nargs="+", type=int, default=[8, 4, 2], help="quantise: b")
    parser.add_argument(
        "--fractions", nargs="+", type=float, default=[0.01, 0.05, 0.1], help="topk: f"
    )
    parser.add_argument("--rounds", type=int, default=8, help="num-server-rounds of every run")
    parser.add_argument("--users", type=int, default=16, help="crowd users, one node each")
    parser.add_argument("--run-config", default="", help="extra run-config for every run")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/)")
    parser.add_argument(
        "--bytes-only", action="store_true", help="print one upload's bytes per setting, no runs"
    )
    add_device_argument(parser, "the server and the Ray clients")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    extra = f"num-server-rounds={args.rounds} server-device='{args.device}' {args.run_config}"
    settings = plan(args)
    configs = {setting: setting_run_config(setting, extra) for setting in settings}
    if args.bytes_only:
        for setting, config in configs.items():
            sent, full = upload_bytes(setting, config)
            print(f"{setting.name}: {sent} bytes of {full} ({full / sent:.1f}x fewer)")
        return
    os.environ.update(ENVIRONMENT)
    out = args.out or APP_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-compression"
    out.mkdir(parents=True, exist_ok=True)
    crowd = crowd_dataset(
        DataOptions(scene=APP_DIR / "data" / "lego", users=args.users), dict(os.environ)
    )
    rows = []
    for setting, base in configs.items():
        config = twin_config(base, out, setting.name, crowd, secure=False)
        run_dir = run_with_ray(config, args.users, client_device=args.device)
        rows.append(read_row(setting, run_dir))
        print(rows[-1])
    atomic.write_text(out / "compression.md", table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
