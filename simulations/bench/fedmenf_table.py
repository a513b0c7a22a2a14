"""Benchmark: a miniature of FedMeNF's Table 1 on LFW faces, one run per strategy x learner.

Each run goes through Flower's simulation engine (Ray) with the faces preset and reports the
final round's held-out PSNR after test-time optimisation, PSNR_p of the uploads, and their
difference Delta. Prints a markdown table; run directories land in runs/bench_fedmenf/.

    python -m simulations.bench.fedmenf_faces [--strategies fedavg fedprox scaffold]
"""

from __future__ import annotations

import argparse
import json
import time

from simulations.launch import ROOT
from simulations.run import run_with_ray

LEARNERS = {
    "MAML": {"meta-learner": "maml"},
    "FOMAML": {"meta-learner": "fomaml"},
    "Reptile": {"meta-learner": "reptile"},
    "FedMeNF gamma 0.75": {"meta-learner": "fedmenf", "gamma": 0.75},
    "FedMeNF adaptive": {"meta-learner": "fedmenf", "privacy-budget": 1e-3},
}
NUM_CLIENTS = 20  # the faces preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedprox", "scaffold"])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    out = ROOT / "runs" / "bench_fedmenf"
    rows = []
    for strategy in args.strategies:
        for name, overrides in LEARNERS.items():
            run_dir = out / f"{time.strftime('%H%M%S')}-{strategy}-{name.replace(' ', '_')}"
            config = {
                "task": "faces",
                "strategy": strategy,
                "num-server-rounds": args.rounds,
                "run-dir": str(run_dir),
                **overrides,
            }
            started = time.perf_counter()
            run_with_ray(config, num_supernodes=NUM_CLIENTS)
            last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            rows.append((strategy, name, last, time.perf_counter() - started))
            print(strategy, name, json.dumps({k: last[k] for k in ("psnr", "psnr_p")}), flush=True)
    print("\n| strategy | meta-learner | PSNR after TTO | PSNR_p | Delta | wall s |")
    print("|---|---|---|---|---|---|")
    for strategy, name, last, seconds in rows:
        delta = last["psnr"] - last["psnr_p"]
        print(
            f"| {strategy} | {name} | {last['psnr']:.2f} | {last['psnr_p']:.2f} | "
            f"{delta:.2f} | {seconds:.0f} |"
        )


if __name__ == "__main__":
    main()
