"""Benchmark (issue 45): bytes up and down per round, seconds per round and final clean PSNR (and
DecentNeRF's personal-mask PSNR) on the Novel Blender crowd, each compression scheme at two or
three strengths against none, for FedNeRF (strategy fedavg), Scaffold (its control delta
compressed too) and DecentNeRF, in plaintext and
under SecAgg+ (`--sums plaintext secure`), with `--download` the global sent down compressed
too (run-config compression-download), through Flower's simulation engine (Ray) with the App's
run-config defaults plus `--run-config`.

Each setting is one run-config (`setting_run_config`) validated by the run-config schema before
anything runs; a setting the App refuses (low-rank or top-k under SecAgg+) is printed with the
App's reason and skipped. The rows (`read_row`) come from each run's metrics.jsonl (mean bytes-up
per round: the float32 or compressed uploads in plaintext, the masked SecAgg+ vectors of every
stage when secure; mean bytes-down: every train and query message's arrays), its wall seconds over
its rounds (Ray's start-up included) and summary.json (final scores); the table goes to
compression.md (and rows.json), the bytes-versus-PSNR figure to compression.png under `--out`;
`--combine DIR ...` writes one table and figure from earlier runs' folders. `--seeds 0 1 2` runs
every setting at each seed and adds a table over seeds: clean PSNR and its change against the same
seed's uncompressed run, mean ± std (the change is paired: same seed, same users each round, same
initial field); `--combine` builds it too from folders run at different seeds. `--bytes-only`
trains nothing: it prints the bytes of one compressed plaintext upload of the run's global field (a
seeded random update) per setting, against the float32 upload.

    python -m simulations.bench.compressed_uploads --users 4 --rounds 2 --schemes topk \
        --fractions 0.05
    python -m simulations.bench.compressed_uploads --strategies decentnerf --sums secure --bits 4
    python -m simulations.bench.compressed_uploads --schemes quantise --bits 4 --download
    python -m simulations.bench.compressed_uploads --schemes quantise --bits 2 --seeds 0 1 2
    python -m simulations.bench.compressed_uploads --bytes-only
    python -m simulations.bench.compressed_uploads --combine runs/a runs/b --out runs/both
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.common.config import parse_config_args
from matplotlib.figure import Figure

from fedfields import atomic
from fedfields.compression import compress, full_bytes, record_bytes
from fedfields.flower.protocol import BYTES_DOWN, BYTES_UP, NUM_MISSING
from fedfields.train.builders import global_field
from fedfields.train.federated import federated_state
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.bench.secure_twins import SECURE, twin_config
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


STRATEGIES = ("fedavg", "scaffold", "decentnerf")
PATIENT_SECONDS = 86_400.0
"""The bench measures bytes and PSNR, not latency: its rounds (round-timeout) and SecAgg+
stages (secagg-timeout, secure settings) wait a day for every reply, so a loaded machine slows
a run down instead of cutting replies from its rounds (`--run-config` may set either key)."""
ROWS_FILE = "rows.json"
"""A bench run's rows, beside its compression.md: what `--combine` reads back."""


@dataclass(frozen=True)
class Setting:
    """One run of the benchmark: a strategy, plaintext or SecAgg+, and a scheme ("none":
    uncompressed) at one strength, for uploads only or downloads too."""

    scheme: str
    strength: float | int | None = None
    strategy: str = "fedavg"
    secure: bool = False
    download: bool = False

    @property
    def name(self) -> str:
        """The run's folder name, e.g. "fedavg-topk-0.05", "fedavg-quantise-4-down" or
        "decentnerf-secure-none"."""
        scheme = self.scheme if self.strength is None else f"{self.scheme}-{self.strength:g}"
        down = "-down" if self.download else ""
        return f"{self.strategy}-{'secure-' if self.secure else ''}{scheme}{down}"

    @property
    def baseline(self) -> str:
        """The name of the uncompressed run this one is compared with."""
        return Setting("none", None, self.strategy, self.secure).name


@dataclass(frozen=True)
class Row:
    """What a run measured: mean bytes up and wall seconds per round, the final scores, mean
    bytes down per round (0: not read, rows of runs before it was), the run's seed (None: rows
    of runs before it was read), the replies missing over its rounds (`num-missing`)."""

    setting: Setting
    bytes_up: float
    seconds: float
    clean_psnr: float | None
    personal_psnr: float | None = None
    bytes_down: float = 0.0
    seed: int | None = None
    missing: int = 0


def plan(args: argparse.Namespace) -> list[Setting]:
    """The runs per strategy and sum (`--sums`): none first, then each scheme asked for at each
    of its strengths."""
    strengths = {"lowrank": args.ranks, "quantise": args.bits, "topk": args.fractions}
    settings = []
    for strategy in args.strategies:
        for secure in (sum_kind == "secure" for sum_kind in args.sums):
            settings.append(Setting("none", None, strategy, secure))
            settings += [
                Setting(scheme, strength, strategy, secure, args.download)
                for scheme in args.schemes
                for strength in strengths[scheme]
            ]
    return settings


def setting_run_config(setting: Setting, extra: str = "") -> dict[str, Any]:
    """The App's run-config of `setting` plus `extra`, validated by the schema: a setting the
    App refuses is its ValueError before anything runs."""
    text = f"strategy='{setting.strategy}' compression='{setting.scheme}' {extra}"
    if setting.strength is not None:
        text += f" {STRENGTH_KEYS[setting.scheme]}={setting.strength}"
    if setting.secure:
        text += " " + " ".join(f"{key}={json.dumps(value)}" for key, value in SECURE.items())
        if "secagg-timeout" not in given_keys(extra):
            text += f" secagg-timeout={PATIENT_SECONDS}"
    if setting.download:
        text += " compression-download=true"
    return job_config(text).to_run_config()


def seeded_runs(
    configs: dict[Setting, dict[str, Any]], seeds: list[int] | None
) -> list[tuple[str, Setting, dict[str, Any]]]:
    """(folder name, setting, run-config) of each run: every setting once at its run-config's
    seed, or with `seeds` every setting at each seed in turn (folders "<setting>-seed<s>")."""
    if seeds is None:
        return [(setting.name, setting, config) for setting, config in configs.items()]
    return [
        (f"{setting.name}-seed{seed}", setting, {**config, "seed": seed})
        for seed, (setting, config) in itertools.product(seeds, configs.items())
    ]


def accepted(settings: list[Setting], extra: str) -> dict[Setting, dict[str, Any]]:
    """The run-config of each setting the App accepts; each refused one printed with why."""
    configs = {}
    for setting in settings:
        try:
            configs[setting] = setting_run_config(setting, extra)
        except ValueError as error:
            print(f"{setting.name}: refused by the App, skipped: {error}")
    return configs


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


def read_row(setting: Setting, run_dir: Path, seconds: float) -> Row:
    """A finished run's row: mean "bytes-up" and "bytes-down" over its rounds, `seconds` (the
    run's wall time) over its rounds, summary.json's clean and personal-mask PSNR and seed."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    final = summary.get("final", {})
    uploads = [float(line[BYTES_UP]) for line in lines if BYTES_UP in line]
    downloads = [float(line[BYTES_DOWN]) for line in lines if BYTES_DOWN in line]
    return Row(
        setting,
        statistics.fmean(uploads) if uploads else 0.0,
        seconds / max(len(uploads), 1),
        final.get("clean-psnr"),
        final.get("personal-psnr"),
        statistics.fmean(downloads) if downloads else 0.0,
        summary.get("seed"),
        int(sum(line.get(NUM_MISSING, 0) for line in lines)),
    )


def _cell(value: float | None, form: str) -> str:
    """`value` formatted, or "-" when not measured."""
    return "-" if value is None else format(value, form)


def first_seed(rows: list[Row]) -> list[Row]:
    """Each setting's row of the first seed it was run at (the per-run table's and the
    figure's rows)."""
    firsts: dict[str, Row] = {}
    for row in rows:
        firsts.setdefault(row.setting.name, row)
    return list(firsts.values())


def table(rows: list[Row]) -> str:
    """The markdown table: per setting at its first seed, bytes up and down per round and
    their ratios to the same strategy's uncompressed run (plaintext or secure) of that seed,
    seconds per round, clean PSNR and its change, personal-mask PSNR."""
    by_run = {(row.setting.name, row.seed): row for row in rows}
    rows = first_seed(rows)
    lines = [
        "| strategy | sum | setting | bytes up / round | x fewer | bytes down / round "
        "| x fewer down | s / round | clean PSNR (dB) | vs none (dB) | personal-mask PSNR (dB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = by_run.get((row.setting.baseline, row.seed))
        ratio = base.bytes_up / row.bytes_up if base and row.bytes_up else None
        down = (
            base.bytes_down / row.bytes_down
            if base and base.bytes_down and row.bytes_down
            else None
        )
        delta = None
        if base and row.clean_psnr is not None and base.clean_psnr is not None:
            delta = row.clean_psnr - base.clean_psnr
        setting = row.setting
        scheme = (
            setting.scheme if setting.strength is None else f"{setting.scheme} {setting.strength:g}"
        ) + (", downloads too" if setting.download else "")
        if row.missing:
            scheme += f" ({row.missing} replies missing)"
        cells = [
            setting.strategy,
            "SecAgg+" if setting.secure else "plaintext",
            scheme,
            f"{row.bytes_up:,.0f}",
            _cell(ratio, ".1f"),
            f"{row.bytes_down:,.0f}" if row.bytes_down else "-",
            _cell(down, ".1f"),
            f"{row.seconds:.1f}",
            _cell(row.clean_psnr, ".2f"),
            _cell(delta, "+.2f"),
            _cell(row.personal_psnr, ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mean_std(values: list[float], signed: bool = False) -> str:
    """ "mean ± std" (sample std) of `values`, 2 decimals, the mean signed if `signed`."""
    form = "+.2f" if signed else ".2f"
    return f"{statistics.fmean(values):{form}} ± {statistics.stdev(values):.2f}"


def seed_table(rows: list[Row]) -> str:
    """Per setting run at two or more seeds: its seeds, clean PSNR and its paired change against
    the same strategy's none run of each seed (mean ± std over seeds), mean bytes up ratio;
    "" when no setting ran at two seeds."""
    by_run = {(row.setting.name, row.seed): row for row in rows}
    seeds: dict[str, list[int]] = {}
    for row in rows:
        if row.seed is not None and row.clean_psnr is not None:
            seeds.setdefault(row.setting.name, []).append(row.seed)
    lines = []
    for name, runs in seeds.items():
        if len(runs) < 2:
            continue
        own = [by_run[(name, seed)] for seed in runs]
        bases = [by_run.get((own[0].setting.baseline, seed)) for seed in runs]
        paired = [
            row.clean_psnr - base.clean_psnr
            for row, base in zip(own, bases, strict=True)
            if base is not None and base.clean_psnr is not None and row.clean_psnr is not None
        ]
        fewer = [
            base.bytes_up / row.bytes_up
            for row, base in zip(own, bases, strict=True)
            if base is not None and row.bytes_up
        ]
        psnr = _mean_std([row.clean_psnr for row in own if row.clean_psnr is not None])
        lines.append(
            f"| {name} | {', '.join(map(str, runs))} | {psnr} | "
            f"{_mean_std(paired, signed=True) if len(paired) > 1 else '-'} | "
            f"{_cell(statistics.fmean(fewer) if fewer else None, '.1f')} |"
        )
    if not lines:
        return ""
    header = (
        "| setting | seeds | clean PSNR (dB), mean ± std | vs none of the same seed (dB), "
        "mean ± std | x fewer bytes up |\n|---|---|---|---|---|\n"
    )
    return header + "\n".join(lines) + "\n"


def figure(rows: list[Row]) -> Figure:
    """Bytes up per round (log scale) against final clean PSNR at each setting's first seed,
    one series per strategy and sum, each point labelled with its setting."""
    plot = Figure(figsize=(7, 4.5))
    axes = plot.subplots()
    series: dict[str, list[Row]] = {}
    for row in first_seed(rows):
        if row.clean_psnr is not None:
            label = f"{row.setting.strategy}, {'SecAgg+' if row.setting.secure else 'plaintext'}"
            series.setdefault(label, []).append(row)
    for label, points in series.items():
        axes.scatter([p.bytes_up for p in points], [p.clean_psnr for p in points], label=label)
        for point in points:
            name = point.setting.name.split("-", 1)[1].replace("secure-", "")
            axes.annotate(name, (point.bytes_up, point.clean_psnr), fontsize=7)
    axes.set_xscale("log")
    axes.set_xlabel("bytes up per round (log)")
    axes.set_ylabel("final clean PSNR (dB)")
    axes.legend(fontsize=8)
    axes.set_title("Update compression: bytes against quality")
    plot.tight_layout()
    return plot


def given_keys(run_config: str) -> set[str]:
    """The keys a run-config override string sets."""
    return set(parse_config_args([run_config])) if run_config.strip() else set()


def run_config_extra(args: argparse.Namespace) -> str:
    """Every run's run-config beyond its setting: the rounds, the device, a round-timeout of
    `PATIENT_SECONDS` unless `--run-config` sets one, then `--run-config`."""
    settings = f"num-server-rounds={args.rounds} server-device='{args.device}'"
    if "round-timeout" not in given_keys(args.run_config):
        settings += f" round-timeout={PATIENT_SECONDS}"
    return f"{settings} {args.run_config}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's settings; strengths out of a scheme's range are refused by `plan`'s
    run-configs, not here."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--strategies", nargs="+", choices=STRATEGIES, default=["fedavg", "decentnerf"]
    )
    parser.add_argument(
        "--sums",
        nargs="+",
        choices=("plaintext", "secure"),
        default=["plaintext"],
        help="plaintext uploads, SecAgg+ (quantise only), or both",
    )
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 8], help="lowrank: r")
    parser.add_argument("--bits", nargs="+", type=int, default=[8, 4, 2], help="quantise: b")
    parser.add_argument(
        "--fractions", nargs="+", type=float, default=[0.01, 0.05, 0.1], help="topk: f"
    )
    parser.add_argument(
        "--download", action="store_true", help="compressed settings compress downloads too"
    )
    parser.add_argument("--rounds", type=int, default=8, help="num-server-rounds of every run")
    parser.add_argument("--users", type=int, default=16, help="crowd users, one node each")
    parser.add_argument("--run-config", default="", help="extra run-config for every run")
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        help="run every setting at each seed (folders <setting>-seed<s>; default: the "
        "run-config's seed, once) and add a table of mean ± std over seeds",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/)")
    parser.add_argument(
        "--bytes-only", action="store_true", help="print one upload's bytes per setting, no runs"
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: one table and figure in --out from earlier runs' output folders",
    )
    add_device_argument(parser, "the server and the Ray clients")
    return parser.parse_args(argv)


def save_rows(out: Path, rows: list[Row]) -> None:
    """`rows` as `out`'s rows.json (what `--combine` reads back) and compression.md (the
    per-run table, then the one over seeds when there is one)."""
    atomic.write_json(out / ROWS_FILE, [asdict(row) for row in rows])
    atomic.write_text(out / "compression.md", report(rows))


def report(rows: list[Row]) -> str:
    """The per-run table and, when some setting ran at two or more seeds, the table over seeds."""
    over_seeds = seed_table(rows)
    return table(rows) + (f"\nOver seeds:\n\n{over_seeds}" if over_seeds else "")


def load_rows(folder: Path) -> list[Row]:
    """The rows a bench run saved in `folder`; ValueError naming the file when it is missing
    or not rows."""
    path = folder / ROWS_FILE
    try:
        return [
            Row(**{**row, "setting": Setting(**row["setting"])})
            for row in json.loads(path.read_text())
        ]
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path}: not the rows of a compression bench run ({error})") from None


def combined(folders: list[Path]) -> list[Row]:
    """The rows of several bench runs in order, each setting once per seed (its first run's
    row)."""
    rows: dict[tuple[str, int | None], Row] = {}
    for folder in folders:
        for row in load_rows(folder):
            rows.setdefault((row.setting.name, row.seed), row)
    return list(rows.values())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.combine:
        out = args.out or APP_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-compression"
        out.mkdir(parents=True, exist_ok=True)
        rows = combined(args.combine)
        save_rows(out, rows)
        atomic.save_figure(out / "compression.png", figure(rows))
        print(report(rows))
        return
    configs = accepted(plan(args), run_config_extra(args))
    if args.bytes_only:
        for setting, config in configs.items():
            if setting.secure:
                continue  # a secure upload's bytes are SecAgg+'s masked vectors: run it
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
    for name, setting, seeded in seeded_runs(configs, args.seeds):
        config = twin_config(seeded, out, name, crowd, secure=False)
        started = time.perf_counter()
        run_dir = run_with_ray(config, args.users, client_device=args.device)
        rows.append(read_row(setting, run_dir, time.perf_counter() - started))
        print(rows[-1])
        save_rows(out, rows)  # what finished, kept as it goes
    atomic.save_figure(out / "compression.png", figure(rows))
    print(report(rows))


if __name__ == "__main__":
    main()
