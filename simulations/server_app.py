"""Placeholder ServerApp for the fedfields Flower App.

It logs the run config and returns. The federated NeRF job (strategy, rounds,
evaluation of the server's global field) arrives with the federation issue.
"""

from logging import INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Log the run config; no rounds are run yet."""
    cfg = dict(context.run_config)
    log(INFO, "fedfields ServerApp run config: %s", cfg)
    log(
        INFO,
        "fedfields: the federated NeRF job (%s rounds on scene %r, downscale %s) arrives "
        "with the federation issue; nothing to run yet.",
        cfg.get("num-server-rounds"),
        cfg.get("scene-dir"),
        cfg.get("downscale"),
    )
