"""The fedfields ServerApp: runs the federated NeRF job named by the run-config.

`flwr run .` starts it; `simulations.federated_nerf.run_federated_nerf` does the work.
"""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from simulations.federated_nerf import run_federated_nerf

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the shared field over the grid's nodes and write the run directory."""
    run_federated_nerf(grid, dict(context.run_config))
