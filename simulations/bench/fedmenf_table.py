"""Benchmark: a miniature of FedMeNF's Table 1, one run per strategy x meta-learner.

Each run goes through Flower's simulation engine (Ray) with the task's preset
(`fedfields.train.builders.META_PRESETS`, one virtual SuperNode per client) and reports the
final round's held-out PSNR after test-time optimisation (TTO), PSNR_p of the round's
uploads, their difference Delta, PSNR_p averaged over all rounds, and the accuracy of FedMeNF
App. C's membership (its CNN, and threshold attacks on the pairs' MSE and on the raw outputs'
correlation) and property inference attacks on every client's last upload. A "Local
(no federation)" row gives the TTO from a random initialisation (summary.json's "initial",
at the last TTO step): each client fits its own support set from scratch and shares nothing,
so it has no PSNR_p. Prints a markdown table; run directories land in runs/bench_fedmenf/.
The objects collection is built on first use, as `simulations.launch` does.

    python -m simulations.bench.fedmenf_table --task faces --strategies fedavg fedprox scaffold
    python -m simulations.bench.fedmenf_table --task objects --strategies fedavg fedprox scaffold
    python -m simulations.bench.fedmenf_table --task objects --object-resolution 64 --rounds 20

`--report RUN_DIR ...` prints the table of existing run directories without training.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.clientapp.typing import Mod
from flwr.common.config import parse_config_args

from fedfields.config import MetaSettings, meta_settings
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.planner import DataOptions, object_collection
from simulations.run import run_with_ray
from strategies import STRATEGIES, parse_app_config

LEARNERS: dict[str, dict[str, Any]] = {
    "MAML": {"meta-learner": "maml"},
    "FOMAML": {"meta-learner": "fomaml"},
    "Reptile": {"meta-learner": "reptile"},
    "FedMeNF gamma 0.75": {"meta-learner": "fedmenf", "gamma": 0.75},
    "FedMeNF adaptive": {"meta-learner": "fedmenf", "privacy-budget": 1e-3},
}
OUT = APP_DIR / "runs" / "bench_fedmenf"


@dataclass(frozen=True)
class Row:
    """One run's final round, read back from its run directory."""

    run_dir: Path
    task: str
    strategy: str
    learner: str
    psnr: float
    psnr_p: float
    psnr_p_mean: float  # over all rounds: each round's 5 uploads differ a lot on objects
    seconds: float  # the job's own time (summary.json), without Ray's start-up
    local_psnr: float  # TTO from a random initialisation, at the last TTO step
    local_steps: int
    mia: float | None  # membership-inference accuracy on the last uploads (chance 0.5)
    mia_mse: float | None  # the loss-threshold attack on the same pairs
    mia_correlation: float | None  # the correlation-threshold attack on the raw outputs
    pia: float | None  # property-inference accuracy (objects: the kind; chance pia_chance)
    pia_chance: float | None


def learner_name(config: dict[str, Any]) -> str:
    """The table's name for a run-config's meta-learner (inverse of LEARNERS)."""
    learner = config["meta-learner"]
    if learner != "fedmenf":
        return {"maml": "MAML", "fomaml": "FOMAML", "reptile": "Reptile"}[learner]
    if config.get("privacy-budget", 0.0) > 0:
        return "FedMeNF adaptive"
    return f"FedMeNF gamma {config['gamma']:g}"


def read_row(run_dir: Path) -> Row:
    """The final round and the random-init TTO of a finished run directory."""
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rounds[-1]
    steps = max(int(step) for step in summary["initial"])
    return Row(
        run_dir=run_dir,
        task=config["task"],
        strategy=config["strategy"],
        learner=learner_name(config),
        psnr=last["psnr"],
        psnr_p=last["psnr_p"],
        psnr_p_mean=sum(r["psnr_p"] for r in rounds) / len(rounds),
        seconds=summary["seconds"],
        local_psnr=summary["initial"][str(steps)]["psnr"],
        local_steps=steps,
        mia=summary["final"].get("mia-accuracy"),
        mia_mse=summary["final"].get("mia-mse-accuracy"),
        mia_correlation=summary["final"].get("mia-correlation-accuracy"),
        pia=summary["final"].get("pia-accuracy"),
        pia_chance=summary["final"].get("pia-chance"),
    )


def run_one(
    task: str,
    strategy: str,
    learner: str,
    rounds: int,
    out: Path,
    overrides: dict[str, Any] | None = None,
    object_resolution: int = 32,
    mods: Sequence[Mod] = (),
    device: str = "auto",
) -> Path:
    """One federated run of `task` through Ray, server and clients on `device`; returns its
    run directory.

    A simulation: run-config `simulation-audit` attaches the privacy audit; for objects
    `data-dir` is the clients' data root (`simulation_objects`). `mods` wrap the ClientApp
    (e.g. a benchmark's recorder).
    """
    config = parse_app_config({"task": task, **(overrides or {})})
    settings = meta_settings(config)  # one node per client, num-clients overridden or not
    run_dir = out / f"{time.strftime('%H%M%S')}-{task}-{strategy}-{learner.replace(' ', '_')}"
    run_config: dict[str, Any] = {
        "task": task,
        "strategy": strategy,
        "num-server-rounds": rounds,
        "run-dir": str(run_dir),
        "simulation-audit": True,
        "server-device": device,
        **LEARNERS[learner],
        **(overrides or {}),
    }
    if task == "objects":  # the same collection `simulations.launch` builds
        data = DataOptions(object_resolution=object_resolution)
        collection = object_collection(data, settings, dict(os.environ))
        data_dir = run_dir.with_suffix(".data")
        run_config["data-dir"] = str(data_dir)
        run_config["eval-scene-dir"] = str(simulation_objects(collection, settings, data_dir))
    run_with_ray(run_config, num_supernodes=settings.num_clients, mods=mods, client_device=device)
    return run_dir


def simulation_objects(collection: Path, settings: MetaSettings, root: Path) -> Path:
    """Lay out a collection for a simulation; returns the public held-out folder.

    Virtual node i reads root/object_NN (`fedfields.flower.node`), linked to the collection's i-th
    object; the objects after the N clients' are linked into root/heldout, the server's
    `eval-scene-dir`.
    """
    objects = sorted(collection.glob("object_*"))
    heldout = root / "heldout"
    heldout.mkdir(parents=True)
    clients = settings.num_clients
    for index, folder in enumerate(objects[: clients + settings.heldout_tasks]):
        link = root / f"object_{index:02d}" if index < clients else heldout / folder.name
        link.symlink_to(folder)
    return heldout


def table(rows: list[Row]) -> str:
    """Markdown table: one line per run, then the Local baseline of each task."""
    order = {name: index for index, name in enumerate(LEARNERS)}
    rows = sorted(
        rows,
        key=lambda row: (
            row.task,
            list(STRATEGIES).index(row.strategy) if row.strategy in STRATEGIES else len(STRATEGIES),
            order.get(row.learner, len(order)),
            row.run_dir.name,
        ),
    )
    lines = [
        "| task | strategy | meta-learner | PSNR after TTO | PSNR_p | Delta "
        "| PSNR_p, mean of rounds | MIA acc, CNN / MSE / correlation threshold (chance 50%) "
        "| PIA acc (chance) | job s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        mia = " / ".join(
            "-" if value is None else f"{value:.1%}"
            for value in (row.mia, row.mia_mse, row.mia_correlation)
        )
        pia = "-" if row.pia is None else f"{row.pia:.1%} ({row.pia_chance:.0%})"
        lines.append(
            f"| {row.task} | {row.strategy} | {row.learner} | {row.psnr:.2f} | "
            f"{row.psnr_p:.2f} | {row.psnr - row.psnr_p:.2f} | {row.psnr_p_mean:.2f} | "
            f"{mia} | {pia} | {row.seconds:.0f} |"
        )
    for task in sorted({row.task for row in rows}):
        local = [row.local_psnr for row in rows if row.task == task]
        low, high = min(local), max(local)
        value = f"{low:.2f}" if high - low < 0.005 else f"{low:.2f}-{high:.2f}"
        steps = next(row.local_steps for row in rows if row.task == task)
        lines.append(
            f"| {task} | - | Local (no federation, {steps} TTO steps from random init) | "
            f"{value} | - | - | - | - | - | - |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--task", choices=("faces", "photos", "objects"), default="faces")
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedprox", "scaffold"])
    parser.add_argument("--learners", nargs="+", choices=list(LEARNERS), default=list(LEARNERS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=OUT, help="parent of the run directories")
    parser.add_argument(
        "--run-config", default="", help="extra run-config for every run, e.g. 'tto-steps=128'"
    )
    parser.add_argument(
        "--object-resolution",
        type=int,
        default=32,
        help="objects: rendered view size (the collection is built once per size)",
    )
    parser.add_argument(
        "--report", nargs="+", type=Path, default=None, help="only tabulate these run dirs"
    )
    add_device_argument(parser, "the server and the Ray clients")
    args = parser.parse_args()
    if args.report is not None:
        print(table([read_row(run_dir) for run_dir in args.report]))
        return
    overrides = parse_config_args([args.run_config]) if args.run_config.strip() else {}
    rows = []
    for strategy in args.strategies:
        for learner in args.learners:
            started = time.perf_counter()
            run_dir = run_one(
                args.task,
                strategy,
                learner,
                args.rounds,
                args.out,
                overrides,
                args.object_resolution,
                device=args.device,
            )
            row = read_row(run_dir)
            rows.append(row)
            print(
                f"{args.task} {strategy} {learner}: PSNR {row.psnr:.2f}, PSNR_p {row.psnr_p:.2f}, "
                f"{time.perf_counter() - started:.0f} s wall, {run_dir}",
                flush=True,
            )
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
