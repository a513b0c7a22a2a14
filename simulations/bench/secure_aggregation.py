"""Benchmark: seconds per FedAvg round, plaintext versus Flower SecAgg+, and the sum's error.

Each configuration runs 3 rounds through Flower's simulation engine (Ray). Clients skip
training and reply a fixed payload the size of the default global field (NeRF hash grid,
912,645 floats) or of the faces SIREN 6x128 (83,073 floats): the round time is then
messaging plus aggregation, which is what secure aggregation changes. Rounds 2-3 are timed
(round 1 carries Ray's actor start-up). The relative L2 error compares the secure aggregate
with the float64 weighted mean of the same payloads computed here.

    python -m simulations.bench.secure_aggregation [--clients 5 10 20 50] [--models nerf siren]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import Tensor

from fedfields.config import meta_settings
from fedfields.fields import HashGridField, HashGridFieldConfig
from fedfields.fields.hashgrid import HashGridConfig
from fedfields.flower import FedAvg
from fedfields.flower.protocol import (
    ARRAYS,
    METRICS,
    NUM_EXAMPLES,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.secure_aggregation import secure_aggregation_mod
from fedfields.privacy.secagg_plan import SecureAggregationConfig
from fedfields.train.builders import meta_model
from fedfields.train.federated import federated_state
from simulations.bench.devices import add_cpu_only_device_argument
from strategies import parse_app_config

ROUNDS = 3
NEIGHBOURS = 10
"""SecAgg+ neighbours per client beyond 10 clients (num_shares = 11 / n), as Flower advises."""


def model_state(model: str) -> dict[str, Tensor]:
    """The default federated state of the scene job ("nerf") or the faces preset ("siren")."""
    torch.manual_seed(0)
    if model == "nerf":
        encoding = HashGridConfig(max_resolution=400, log2_hashmap_size=15)  # lego at 100x100
        field = HashGridField(HashGridFieldConfig(encoding=encoding, aabb=(-1.5,) * 3 + (1.5,) * 3))
        return federated_state(field)
    config = parse_app_config({"task": "faces"})
    return federated_state(meta_model(config, meta_settings(config)))


def client_payload(base: dict[str, Tensor], partition: int) -> tuple[dict[str, Tensor], float]:
    """Client `partition`'s reply: the base state plus seeded noise, and its example count."""
    generator = torch.Generator().manual_seed(1000 + partition)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in base.items()}
    return state, float(100 + 17 * partition)


def plaintext_mean(base: dict[str, Tensor], num_clients: int) -> dict[str, Tensor]:
    """The float64 weighted mean every round's aggregate should equal."""
    payloads = [client_payload(base, k) for k in range(num_clients)]
    total = sum(weight for _, weight in payloads)
    return {
        key: sum(state[key].double() * weight for state, weight in payloads) / total for key in base
    }


def bench_client_app(base: dict[str, Tensor]) -> ClientApp:
    """Replies its fixed payload to every train message (behind the secure-aggregation mod)."""
    app = ClientApp(mods=[secure_aggregation_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        state, weight = client_payload(base, int(context.node_config["partition-id"]))
        content = RecordDict(
            {ARRAYS: state_to_arrays(state), METRICS: MetricRecord({NUM_EXAMPLES: weight})}
        )
        return Message(content, reply_to=msg)

    return app


def bench_server_app(
    base: dict[str, Tensor], num_clients: int, secure: SecureAggregationConfig | None, out: dict
) -> ServerApp:
    """FedAvg over all clients for ROUNDS rounds; records round end times and the aggregate."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_evaluate=0.0,
            min_train_nodes=num_clients,
            min_available_nodes=num_clients,
            secure_aggregation=secure,
            sample_by_user=True,
        )
        out["times"] = []

        def clock(server_round: int, arrays: ArrayRecord) -> None:
            out["times"].append(time.perf_counter())

        result = strategy.start(grid, state_to_arrays(base), num_rounds=ROUNDS, evaluate_fn=clock)
        out["aggregate"] = arrays_to_state(result.arrays)

    return app


def run_case(model: str, num_clients: int, secure: bool) -> tuple[float, float]:
    """(seconds per round over rounds 2..ROUNDS, relative L2 error of the aggregate)."""
    from flwr.simulation import run_simulation

    base = model_state(model)
    config = None
    if secure:
        shares = 1.0 if num_clients <= NEIGHBOURS else (NEIGHBOURS + 1) / num_clients
        config = SecureAggregationConfig(num_shares=shares)
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        run_simulation(
            server_app=bench_server_app(base, num_clients, config, out),
            client_app=bench_client_app(base),
            num_supernodes=num_clients,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    times = out["times"]
    seconds = (times[-1] - times[1]) / (ROUNDS - 1)
    reference = plaintext_mean(base, num_clients)
    aggregate = out["aggregate"]
    error = torch.cat([(aggregate[k].double() - reference[k]).flatten() for k in reference])
    norm = torch.cat([reference[k].flatten() for k in reference]).norm()
    return seconds, float(error.norm() / norm)


def main(argv: list[str] | None = None, report: Callable[[str], None] = print) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[5, 10, 20, 50])
    parser.add_argument("--models", nargs="+", default=["siren", "nerf"], choices=["siren", "nerf"])
    add_cpu_only_device_argument(parser, "it times sums of the CPU float32 arrays on the wire")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    rows = []
    for model in args.models:
        for num_clients in args.clients:
            plain_s, plain_error = run_case(model, num_clients, secure=False)
            secure_s, secure_error = run_case(model, num_clients, secure=True)
            rows.append((model, num_clients, plain_s, secure_s, plain_error, secure_error))
            report(f"{rows[-1]}")
    report(
        "\n| model | clients | plaintext s/round | SecAgg+ s/round | ratio "
        "| rel. error plaintext | rel. error SecAgg+ |"
    )
    report("|---|---|---|---|---|---|---|")
    for model, n, plain_s, secure_s, plain_error, secure_error in rows:
        report(
            f"| {model} | {n} | {plain_s:.2f} | {secure_s:.2f} | {secure_s / plain_s:.1f}x | "
            f"{plain_error:.1e} | {secure_error:.1e} |"
        )


if __name__ == "__main__":
    main()
