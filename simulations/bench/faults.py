"""Benchmark: fault injection. A run survives a killed server, crashing nodes and poisoned
replies; each row's final PSNR (after test-time optimisation) beside the clean run's, or the
error that ended the run.

The job is the faces meta task (FedAvg over FedMeNF's local updates, 20 clients, 5 sampled per
round) through Flower's simulation engine (Ray). Faults come from Flower client mods that wrap
the real ClientApp: `Poison` corrupts a train reply of the nodes it names (NaN, a wrong shape,
a missing key, an update scaled by 1e6, num-examples 1e12, int8 arrays, a NaN train-loss, a
float64 1e39 in the float32 model, a client's own "dp-epsilon" metric, and under secure
aggregation a reply holding nothing back), `Crash` makes their ClientApp
raise (the server sees what a node dying mid-round looks like: an error reply). The killed
server is real: `simulations.launch` runs the job, the simulation process that hosts the
ServerApp is killed (SIGKILL) once round `--kill-after` is in metrics.jsonl, and
`simulations.launch --resume` finishes the run. The all-empty row drops every reply
(max-update-norm 1e-12): the run must end with EmptyRoundsError after max-empty-rounds rounds.
The scaled update is also run with the norm check off under each aggregation rule (mean,
trimmed mean, median, Krum, Multi-Krum, Bulyan with 7 clients a round).

    python -m simulations.bench.faults --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from flwr.app import Array, Context, Message

from fedfields.flower.protocol import ARRAYS, HELD, METRICS, NUM_EXAMPLES, TRAIN_LOSS
from simulations import APP_DIR
from simulations.bench.devices import add_device_argument
from simulations.planner import launch_home
from simulations.run import run_with_ray

OUT = APP_DIR / "runs" / "bench_faults"
NUM_CLIENTS = 20
FAULTY = frozenset(range(4))  # partition ids: about 1 of the 5 nodes sampled per round
POISONS = (
    "nan",
    "shape",
    "missing-key",
    "scaled-1e6",
    "num-examples-1e12",
    "int8",
    "nan-metric",
    "float64-1e39",
    "client-dp-epsilon",
)
SECURE_POISONS = ("no-held",)
"""Poisons of a secure-mode reply (which carries no arrays): `HELD` removed."""
CallNext = Callable[[Message, Context], Message]


@dataclass(frozen=True)
class Poison:
    """A client mod: the train replies of `nodes` (partition ids) corrupted as `kind`."""

    kind: str
    nodes: frozenset[int] = FAULTY

    def __call__(self, msg: Message, context: Context, call_next: CallNext) -> Message:
        reply = call_next(msg, context)
        faulty = int(context.node_config["partition-id"]) in self.nodes
        if msg.metadata.message_type != "train" or not faulty or reply.has_error():
            return reply
        if self.kind == "no-held":
            del reply.content[HELD]
            return reply
        if self.kind == "nan-metric":
            reply.content.metric_records[METRICS][TRAIN_LOSS] = float("nan")
            return reply
        if self.kind == "client-dp-epsilon":  # a privacy loss the run never spent
            reply.content.metric_records[METRICS]["dp-epsilon"] = 0.01
            return reply
        arrays = reply.content.array_records[ARRAYS]
        first = next(iter(arrays))
        if self.kind == "nan":
            arrays[first] = Array(np.full_like(arrays[first].numpy(), np.nan))
        elif self.kind == "shape":
            arrays[first] = Array(arrays[first].numpy().ravel()[:-1].copy())
        elif self.kind == "missing-key":
            del arrays[first]
        elif self.kind == "scaled-1e6":
            for key in list(arrays):
                arrays[key] = Array(arrays[key].numpy() * np.float32(1e6))
        elif self.kind == "num-examples-1e12":
            reply.content.metric_records[METRICS][NUM_EXAMPLES] = 1e12
        elif self.kind == "int8":
            for key in list(arrays):
                arrays[key] = Array(arrays[key].numpy().astype(np.int8))
        elif self.kind == "float64-1e39":  # finite as sent, inf in the float32 model
            values = arrays[first].numpy().astype(np.float64)
            values.flat[0] = 1e39
            arrays[first] = Array(values)
        else:
            raise ValueError(f"unknown poison {self.kind!r}; known: {POISONS}")
        return reply


@dataclass(frozen=True)
class Crash:
    """A client mod: the ClientApp of `nodes` (partition ids) raises on every train message."""

    nodes: frozenset[int]

    def __call__(self, msg: Message, context: Context, call_next: CallNext) -> Message:
        if msg.metadata.message_type == "train" and (
            int(context.node_config["partition-id"]) in self.nodes
        ):
            raise RuntimeError("fault injection: this node died mid-round")
        return call_next(msg, context)


DEVICE = {"value": "auto"}
"""`--device`: the server's and the Ray clients' (set once by main)."""


def job_config(run_dir: Path, rounds: int, **extra: Any) -> dict[str, Any]:
    """The faces job's run-config (FedAvg, preset otherwise), no simulation audit."""
    return {
        "task": "faces",
        "strategy": "fedavg",
        "num-server-rounds": rounds,
        "run-dir": str(run_dir),
        "min-available-nodes": NUM_CLIENTS,
        "server-device": DEVICE["value"],
        **extra,
    }


def outcome(run_dir: Path) -> dict[str, Any]:
    """Final PSNR after TTO (None without summary.json: the run failed), the rounds in
    metrics.jsonl, the replies dropped or failed and the secure sums that failed."""
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"final": {}}
    lines = metrics_path.read_text().splitlines() if metrics_path.is_file() else []
    rounds = [json.loads(line) for line in lines]
    return {
        "psnr": summary["final"].get("psnr"),
        "rounds": [line["round"] for line in rounds],
        "secure-sum-failures": sum(line.get("secure-sum-failures", 0) for line in rounds),
        "failures": sum(line.get("num-failures", 0) for line in rounds),
        "dropped": sum(line.get("num-dropped", 0) for line in rounds),
        "replies": sum(line.get("num-replies", 0) for line in rounds),
    }


def simulated(name: str, rounds: int, mods: tuple[Any, ...] = (), **extra: Any) -> dict:
    """One run through Ray with `mods`; its outcome, or the error that ended it."""
    run_dir = OUT / name
    started = time.perf_counter()
    try:
        config = job_config(run_dir, rounds, **extra)
        run_with_ray(config, NUM_CLIENTS, mods=mods, client_device=DEVICE["value"])
        result = outcome(run_dir)
    except Exception as error:  # a fault that ends the run is a result, not a crash of ours
        result = {**outcome(run_dir), "error": f"{type(error).__name__}: {error}"[:200]}
    return {"name": name, **result, "wall": time.perf_counter() - started}


def simulation_processes(flwr_home: str) -> list[psutil.Process]:
    """The Flower simulation processes (they host the ServerApp) with Flower home `flwr_home`."""
    found = []
    for process in psutil.process_iter(["cmdline", "environ"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        environ = process.info["environ"] or {}
        if "flwr-simulation" in cmdline and environ.get("FLWR_HOME") == flwr_home:
            found.append(process)
    return found


def killed_and_resumed(rounds: int, kill_after: int) -> dict[str, Any]:
    """The job through `simulations.launch`; its ServerApp's process SIGKILLed after round
    `kill_after`, then `simulations.launch --resume` to the end."""
    run_dir = OUT / "server-killed"
    run_config = " ".join(
        f"{k}={json.dumps(v)}"
        for k, v in job_config(run_dir, rounds).items()
        if k not in ("run-dir", "min-available-nodes")
    )
    launch = [sys.executable, "-m", "simulations.launch", "--no-audit"]
    started = time.perf_counter()
    first = subprocess.Popen(
        [*launch, "--run-dir", str(run_dir), "--run-config", run_config],
        cwd=APP_DIR,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = run_dir / "metrics.jsonl"
    while first.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_after:
            victims = simulation_processes(str(launch_home(run_dir, first.pid)))
            for process in victims:
                os.kill(process.pid, signal.SIGKILL)
            if victims:
                break
        time.sleep(0.5)
    first_code = first.wait()
    completed_before = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    second = subprocess.run(
        [*launch, "--resume", str(run_dir)],
        cwd=APP_DIR,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    result = outcome(run_dir) if (run_dir / "summary.json").is_file() else {"psnr": None}
    return {
        "name": f"server killed after round {kill_after}, resumed",
        "exit codes": [first_code, second.returncode],
        "rounds before the kill": completed_before,
        **result,
        "wall": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only the rows whose name starts so"
    )
    add_device_argument(parser, "the server and the Ray clients (the killed run's: the CPU)")
    args = parser.parse_args(argv)
    DEVICE["value"] = args.device
    OUT.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, Callable[[], dict]]] = [
        ("clean", lambda: simulated("clean", args.rounds)),
        ("server-killed", lambda: killed_and_resumed(args.rounds, args.kill_after)),
        ("clean-again", lambda: simulated("clean-again", args.rounds)),  # Ray's own spread
    ]
    for count in (1, 2, 3):  # 4, 8, 12 of 20 nodes crash: about 1, 2, 3 of 5 per round
        nodes = frozenset(range(4 * count))
        rows.append(
            (
                f"crash-{count}",
                lambda n=nodes, c=count: simulated(f"crash-{c}", args.rounds, (Crash(n),)),
            )
        )
    for kind in POISONS:
        rows.append((kind, lambda k=kind: simulated(k, args.rounds, (Poison(k),))))
    for kind in SECURE_POISONS:
        name, secure = f"secure-{kind}", {"secure-aggregation": True}
        rows.append(
            (name, lambda n=name, k=kind, e=secure: simulated(n, args.rounds, (Poison(k),), **e))
        )
    empty = {"max-update-norm": 1e-12}  # every reply dropped: EmptyRoundsError
    rows.append(("all-empty", lambda e=empty: simulated("all-empty", args.rounds, **e)))
    float64 = {"max-update-norm": 0.0, "max-num-examples": 0.0}  # every cap off
    rows.append(
        (
            "float64-1e39-unchecked",
            lambda e=float64: simulated(
                "float64-1e39-unchecked", args.rounds, (Poison("float64-1e39"),), **e
            ),
        )
    )
    robust: dict[str, dict[str, Any]] = {
        "mean": {},
        "trimmed-mean": {},
        "median": {},
        "krum": {"num-malicious": 1},
        "multi-krum": {"num-malicious": 1},
        "bulyan": {"num-malicious": 1, "clients-per-round": 7},  # 4f + 3 a round
    }
    for rule, settings in robust.items():  # the norm check off: the rule alone
        name = f"scaled-1e6-unchecked-{rule}"
        extra = {"aggregation-rule": rule, "max-update-norm": 0.0, **settings}
        rows.append(
            (name, lambda n=name, e=extra: simulated(n, args.rounds, (Poison("scaled-1e6"),), **e))
        )
    saved = OUT / "results.json"
    results = json.loads(saved.read_text()) if saved.is_file() else []
    for name, run in rows:
        if args.only is not None and not any(name.startswith(prefix) for prefix in args.only):
            continue
        result = run()
        results = [r for r in results if r["name"] != result["name"]] + [result]
        print(json.dumps(result), flush=True)
        saved.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
