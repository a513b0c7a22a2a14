"""Benchmark: fedfields simulated at scale through Ray (issue 16).

For 10, 100 and 1000 virtual SuperNodes with `--sampled` of them per round, each job runs the
way a user runs it (`python -m simulations.launch`, i.e. `flwr run .` on Flower's simulation
engine) and this script measures, side by side:
- seconds per round, split into client compute (the clients' own "client-seconds", summed
  and divided by the number of Ray actors working in parallel) and the rest: Flower/Ray
  overhead (message passing, polling, actor scheduling, server work);
- peak memory (PSS, so shared pages count once) of the whole process tree: the launcher,
  `flwr`, the SuperLink, the simulation runtime, Ray's GCS, raylet and workers;
- server aggregation time (`RunningSum` over N replies' ArrayRecords, as the strategies do)
  against one numpy pass over the same N x d floats (`weights @ X`).

Data. The scene job's clients share views: client i holds user i mod 16 of a Novel Blender
crowd (`simulations.launch --clients N` links the folders as `<crowd>.x<N>`), so 1000
clients are 1000 private states (personal fields, alphas, occupancy grids: files in each
node's state directory, loaded only when the node is sampled) over 16 users' photos.
FedMeNF's objects task gives every client its own procedural object (`fedfields data
objects`, built once). Nothing here measures accuracy.

    python -m simulations.bench.scale --crowd runs/crowd_nb_ds4 [--clients 10 100 1000] \\
        [--sampled 10] [--rounds 5] [--jobs decentnerf fedavg objects]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from fedfields.flower.protocol import arrays_to_state, checked_state, state_to_arrays
from fedfields.methods import RunningSum
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.planner import launch_home, superlinks_with_home
from strategies import parse_app_config

CPUS = psutil.cpu_count(logical=True) or 1


class TreeMemory:
    """Samples the PSS of a process tree (plus the SuperLinks with Flower home `flwr_home`,
    when given) and keeps the peak."""

    def __init__(self, root: int, flwr_home: Path | None = None, interval: float = 1.0) -> None:
        self.root, self.flwr_home, self.interval = root, flwr_home, interval
        self.peak_bytes = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def processes(self) -> list[psutil.Process]:
        """The root, its descendants and its launch's SuperLinks' trees (flwr detaches them)."""
        found: dict[int, psutil.Process] = {}
        homes = [] if self.flwr_home is None else superlinks_with_home(self.flwr_home)
        for pid in [self.root, *homes]:
            try:
                top = psutil.Process(pid)
                for proc in [top, *top.children(recursive=True)]:
                    found[proc.pid] = proc
            except psutil.NoSuchProcess:
                continue
        return list(found.values())

    def sample(self) -> int:
        """Summed PSS of the tree now, in bytes."""
        total, count = 0, 0
        for proc in self.processes():
            try:
                total += proc.memory_full_info().pss
                count += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.peak_processes = max(self.peak_processes, count)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            self._stop.wait(self.interval)


def job_run_config(job: str, clients: int, sampled: int, rounds: int) -> str:
    """The run-config of one job: `sampled` of `clients` per round, `rounds` rounds."""
    if job == "objects":
        return (
            f"task='objects' num-clients={clients} clients-per-round={sampled} "
            f"num-server-rounds={rounds} privacy-audit=false"
        )
    fraction = sampled / clients
    return (
        f"strategy='{job}' num-server-rounds={rounds} fraction-train={fraction:.12g} "
        f"min-train-nodes={sampled} client-eval-views=0"
    )


def run_job(
    job: str,
    clients: int,
    sampled: int,
    rounds: int,
    crowd: Path,
    out: Path,
    ray_address: str,
    device: str = "cpu",
) -> dict[str, Any]:
    """One launcher run with memory sampling (the server on `device`, the clients on the
    CPU); its per-round split from metrics.jsonl."""
    run_dir = out / f"{job}_{clients}"
    command = [sys.executable, "-m", "simulations.launch", "--no-audit", "--run-dir", str(run_dir)]
    run_config = f"{job_run_config(job, clients, sampled, rounds)} server-device='{device}'"
    command += ["--run-config", run_config]
    if job == "objects":
        command += ["--objects", str(out / f"collection_{clients}")]
    else:
        command += ["--crowd", str(crowd), "--clients", str(clients)]
    if ray_address:
        command += ["--ray-address", ray_address]
    log = (out / f"{job}_{clients}.log").open("w")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=APP_DIR, stdout=log, stderr=subprocess.STDOUT)
    with TreeMemory(process.pid, launch_home(run_dir, process.pid)) as memory:
        code = process.wait()
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"{job} with {clients} clients failed (exit {code}); see {log.name}")
    return {
        "job": job,
        "clients": clients,
        "sampled": sampled,
        "wall-seconds": wall,
        "peak-pss-gib": memory.peak_bytes / 2**30,
        "peak-processes": memory.peak_processes,
        **round_split(run_dir, sampled),
    }


def round_split(run_dir: Path, sampled: int) -> dict[str, Any]:
    """Per-round seconds, client compute per actor and the overhead, from metrics.jsonl.

    Rounds after the first (which carries Ray's actor start-up) are averaged.
    """
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rounds = [json.loads(line) for line in lines if line.strip()]
    ends = [0.0] + [r["seconds"] for r in rounds]
    actors = min(sampled, CPUS)  # one actor per CPU (client-resources-num-cpus=1)
    rows = []
    for index, record in enumerate(rounds):
        seconds = ends[index + 1] - ends[index]
        compute = record.get("client-seconds", 0.0) * record.get("num-replies", 0) / actors
        rows.append({"seconds": seconds, "compute": compute, "overhead": seconds - compute})
    steady = rows[1:] or rows
    mean = {key: float(np.mean([row[key] for row in steady])) for key in rows[0]}
    return {
        "rounds": rows,
        "round-seconds": mean["seconds"],
        "client-compute-seconds": mean["compute"],
        "overhead-seconds": mean["overhead"],
        "overhead-ratio": mean["overhead"] / max(mean["compute"], 1e-9),
        "first-round-seconds": rows[0]["seconds"],
    }


def aggregation_timing(
    num_replies: int, shapes: dict[str, tuple[int, ...]], repeats: int = 5
) -> dict[str, Any]:
    """Seconds of the strategies' server path over `num_replies` ArrayRecords (`checked_state`:
    a read-only view, key/shape/finiteness checks; then `RunningSum.add`, float64) against
    one numpy pass over the same N x d float32 values: `X.sum(0)` and BLAS `weights @ X`
    (best of `repeats` each)."""
    gen = torch.Generator().manual_seed(0)
    replies = [
        state_to_arrays({k: torch.randn(s, generator=gen) for k, s in shapes.items()})
        for _ in range(num_replies)
    ]
    weights = np.arange(1, num_replies + 1, dtype=np.float32)
    matrix = np.stack(
        [np.concatenate([a.numpy().ravel() for a in r.values()]) for r in replies]
    )  # fmt: skip

    def ours() -> None:
        total = RunningSum()
        for index, (record, weight) in enumerate(zip(replies, weights, strict=True)):
            total.add(checked_state(record, shapes, f"reply {index}"), float(weight), checked=True)
        total.mean()

    def unchecked() -> None:  # ablation: the same sum without the per-reply checks
        total = RunningSum()
        for record, weight in zip(replies, weights, strict=True):
            total.add(arrays_to_state(record, copy=False), float(weight), checked=True)
        total.mean()

    def float32_sum() -> None:  # ablation: accumulating in float32 instead of float64
        total: dict[str, torch.Tensor] = {}
        for record, weight in zip(replies, weights, strict=True):
            for key, value in arrays_to_state(record, copy=False).items():
                if key in total:
                    total[key].add_(value, alpha=float(weight))
                else:
                    total[key] = value * float(weight)

    timings = {
        "running-sum-seconds": best_of(ours, repeats),
        "float32-sum-seconds": best_of(float32_sum, repeats),
        "unchecked-running-sum-seconds": best_of(unchecked, repeats),
        "numpy-sum-seconds": best_of(lambda: matrix.sum(axis=0), repeats),
        "numpy-gemv-seconds": best_of(lambda: weights @ matrix, repeats),
    }
    return {
        "replies": num_replies,
        "floats": int(matrix.size),
        **timings,
        "ratio-to-sum": timings["running-sum-seconds"] / timings["numpy-sum-seconds"],
        "ratio-to-gemv": timings["running-sum-seconds"] / timings["numpy-gemv-seconds"],
        "unchecked-ratio-to-sum": timings["unchecked-running-sum-seconds"]
        / timings["numpy-sum-seconds"],
        "float32-ratio-to-sum": timings["float32-sum-seconds"] / timings["numpy-sum-seconds"],
    }


def best_of(work: Any, repeats: int) -> float:
    """The shortest of `repeats` timed calls of `work()`."""
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        work()
        times.append(time.perf_counter() - tick)
    return min(times)


def global_shapes(run_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The App's global field's shapes under `run_config` (the d of the aggregation)."""
    from fedfields.train.builders import global_field

    field = global_field(parse_app_config(run_config))
    return {key: tuple(value.shape) for key, value in field.state_dict().items()}


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per job and client count."""
    lines = [
        "| job | clients | sampled | s/round (rounds 2+) | client compute s/round | "
        "overhead s/round | overhead / compute | round 1 s | peak PSS GiB | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['job']} | {r['clients']} | {r['sampled']} | {r['round-seconds']:.1f} "
            f"| {r['client-compute-seconds']:.1f} | {r['overhead-seconds']:.1f} "
            f"| {r['overhead-ratio']:.1%} | {r['first-round-seconds']:.1f} "
            f"| {r['peak-pss-gib']:.2f} | {r['wall-seconds']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crowd", type=Path, default=APP_DIR / "runs" / "crowd_nb_ds4")
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--sampled", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--jobs", nargs="+", default=["decentnerf"], choices=["decentnerf", "fedavg", "objects"]
    )
    parser.add_argument("--ray-address", default="", help="an existing Ray cluster to run on")
    parser.add_argument("--skip-jobs", action="store_true", help="aggregation timing only")
    parser.add_argument("--out", type=Path, default=APP_DIR / "runs" / "bench_scale")
    add_device_argument(parser, "the ServerApp (the clients train on the CPU)", default="cpu")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = global_shapes({})
    aggregation = [aggregation_timing(n, shapes) for n in (args.sampled, 20)]
    print(json.dumps(aggregation, indent=1))
    results = []
    for job in [] if args.skip_jobs else args.jobs:
        for clients in args.clients:
            print(f"{job}: {clients} clients, {args.sampled} per round", flush=True)
            result = run_job(job, clients, args.sampled, args.rounds, args.crowd.resolve(),
                             args.out, args.ray_address, args.device)  # fmt: skip
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "rounds"}), flush=True)
            (args.out / "results.json").write_text(
                json.dumps({"jobs": results, "aggregation": aggregation}, indent=1)
            )
    if results:
        print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
