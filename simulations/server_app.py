"""The fedfields ServerApp: runs the job named by the run-config's `task`.

`flwr run .` starts it: task "scene" is the federated NeRF job
(`simulations.federated_nerf.run_federated_nerf`), faces, photos, video and objects the FedMeNF
meta-learning job (`simulations.meta_job.run_meta_job`); mode "split" is split learning
(`simulations.split_job.run_split_job`). The run-config is parsed here, once, and the jobs get
the `FederatedConfig` (their shared skeleton: `simulations.job`). The server starts from
run-config alone; only when a simulation launcher sets run-config `simulation-audit` are the
simulation-only observers (`simulations.observers`) attached, which read the experimenter's
data under `data-dir`.
"""

from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from simulations.federated_nerf import run_federated_nerf
from simulations.meta_job import run_meta_job
from simulations.split_job import run_split_job
from strategies import parse_app_config

app = ServerApp()


def run_job(grid: Grid, run_config: dict[str, Any]) -> Path:
    """Run the run-config's job over the grid's nodes; returns its run directory."""
    config = parse_app_config(run_config)  # the server's one parse
    if config.common.mode == "split":
        return run_split_job(grid, config)
    if config.common.task == "scene":
        return run_federated_nerf(grid, config)
    return run_meta_job(grid, config)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train over the grid's nodes and write the run directory."""
    run_job(grid, dict(context.run_config))
