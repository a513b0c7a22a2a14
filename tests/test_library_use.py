"""fedfields as a library: the wheel holds only `fedfields`, and a separate Flower app, written
here with its own pyproject, ClientApp and ServerApp, runs fedfields' DecentNeRF (with its
client half) and FedAvg for two rounds with `flwr run` against the installed wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from simulations import APP_DIR
from simulations.planner import LocalSuperLink, reserved_ports, stop_launch

NODES = 3
ROUNDS = 2

APP_FILES = {
    "pyproject.toml": """
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "tinyapp"
        version = "1.0.0"
        dependencies = ["fedfields"]

        [tool.hatch.build.targets.wheel]
        packages = ["tinyapp"]

        [tool.flwr.app]
        publisher = "someone"

        [tool.flwr.app.components]
        serverapp = "tinyapp.server_app:app"
        clientapp = "tinyapp.client_app:app"

        [tool.flwr.app.config]
        num-server-rounds = 2
        alpha-lr = 0.05
        out-file = ""
    """,
    "tinyapp/__init__.py": "",
    "tinyapp/task.py": '''
        """A linear model y = x w + b; each node holds its own noisy samples of one truth."""

        import torch

        TRUTH = {"weight": torch.tensor([[1.0, -2.0, 0.5, 3.0]]), "bias": torch.tensor([0.7])}


        def make_model() -> torch.nn.Linear:
            torch.manual_seed(0)
            return torch.nn.Linear(4, 1)


        def node_data(partition: int) -> tuple[torch.Tensor, torch.Tensor]:
            generator = torch.Generator().manual_seed(partition)
            x = torch.randn(64, 4, generator=generator)
            noise = 0.1 * torch.randn(64, 1, generator=generator)
            return x, x @ TRUTH["weight"].T + TRUTH["bias"] + noise


        def error(state: dict[str, torch.Tensor]) -> float:
            return float(sum((state[k] - v).pow(2).sum() for k, v in TRUTH.items()))
    ''',
    "tinyapp/client_app.py": '''
        """The app's own ClientApp: local SGD; the method's reply from fedfields.flower."""

        import torch
        from flwr.app import Context, Message
        from flwr.clientapp import ClientApp

        import fedfields
        from fedfields.flower import (
            DecentNeRFClient, NodeState, answer_gradient_query, reply_parts,
            secure_aggregation_mod,
        )
        from fedfields.flower.protocol import (
            ARRAYS, CONFIG, LOCAL_STEPS, ReplyParts, arrays_to_state,
        )
        from fedfields.flower.protocol import USER_KEY_ACTION
        from fedfields.flower.node import answer_user_key
        from tinyapp.task import make_model, node_data

        app = ClientApp(mods=[secure_aggregation_mod])
        app.query(USER_KEY_ACTION)(answer_user_key)  # the server samples by user, not node id


        def _model(received):
            model = make_model()
            model.load_state_dict(received)
            return model


        def _loss(model, context):
            x, y = node_data(int(context.node_config["partition-id"]))
            return torch.nn.functional.mse_loss(model(x), y)


        @app.train()
        def train(msg: Message, context: Context) -> Message:
            model = _model(arrays_to_state(msg.content[ARRAYS]))
            optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(int(msg.content[CONFIG][LOCAL_STEPS])):
                optimiser.zero_grad()
                loss = _loss(model, context)
                loss.backward()
                optimiser.step()
            local = {k: v.detach().clone() for k, v in model.state_dict().items()}
            metrics = {"train-loss": float(loss), "from-wheel": float(_from_wheel())}
            state = NodeState(context)
            parts = reply_parts(msg, state, local, metrics, num_examples=64)  # any method's
            alpha = DecentNeRFClient(state).alpha  # 1.0 unless DecentNeRF's reply moved it
            return ReplyParts(parts.records, {**parts.metrics, "alpha": alpha}).message(msg)


        @app.query("gradient")
        def gradient(msg: Message, context: Context) -> Message:
            def loss_gradient(received):
                model = _model(received)
                _loss(model, context).backward()
                return {name: p.grad for name, p in model.named_parameters()}

            return answer_gradient_query(msg, loss_gradient)


        def _from_wheel() -> bool:
            return fedfields.__file__.startswith(__import__("os").environ["WHEEL_TARGET"])
    ''',
    "tinyapp/server_app.py": '''
        """The app's own ServerApp: fedfields' DecentNeRF, then FedAvg, from run-config."""

        import json
        from pathlib import Path

        from flwr.app import Context
        from flwr.serverapp import Grid, ServerApp

        import fedfields
        from fedfields.flower import DecentNeRF, FedAvg
        from fedfields.flower.protocol import arrays_to_state, state_to_arrays
        from tinyapp.task import error, make_model

        app = ServerApp()


        @app.main()
        def main(grid: Grid, context: Context) -> None:
            config = context.run_config
            sampling = dict(fraction_train=1.0, min_train_nodes=3, min_available_nodes=3,
                            fraction_evaluate=0.0, local_steps=5, node_timeout=120.0,
                            sample_by_user=True)
            initial = {k: v.detach() for k, v in make_model().state_dict().items()}
            report = {"fedfields": fedfields.__file__, "initial-error": error(initial)}
            for strategy in (DecentNeRF.from_config(config, **sampling), FedAvg(**sampling)):
                result = strategy.start(grid, state_to_arrays(initial),
                                        num_rounds=int(config["num-server-rounds"]))
                report[strategy.strategy_name] = {
                    "alpha-lr": getattr(strategy.method, "alpha_lr", None),
                    "error": error(arrays_to_state(result.arrays)),
                    "rounds": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
                }
            Path(str(config["out-file"])).write_text(json.dumps(report))
    ''',
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fedfields' wheel, built from this checkout without network access."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(out), str(APP_DIR)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("fedfields-*.whl")
    return built


def test_the_wheel_installs_only_fedfields(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"fedfields", "fedfields-0.1.0.dist-info"}, tops
    assert "fedfields/flower/decentnerf.py" in names
    assert "fedfields/flower/secure_aggregation.py" in names


@pytest.mark.slow
def test_a_separate_flower_app_runs_fedfields_strategies_from_the_wheel(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    app = tmp_path / "tinyapp"
    for name, text in APP_FILES.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(textwrap.dedent(text).lstrip())
    out_file = tmp_path / "report.json"
    flwr_home = tmp_path / "flwr-home"
    scripts = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PYTHONPATH": str(target),  # the installed wheel, not this checkout
        "WHEEL_TARGET": str(target),
        "PATH": f"{scripts}:{os.environ.get('PATH', '')}",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    }
    command = [str(Path(scripts) / "flwr"), "run", str(app), "--stream"]
    command += ["--federation-config", f"num-supernodes={NODES} client-resources-num-cpus=1"]
    command += ["--run-config", f"out-file={json.dumps(str(out_file))}"]
    try:
        with reserved_ports(2) as ports:  # the local SuperLink's, as simulations.launch picks
            env.update(LocalSuperLink(flwr_home, *ports).environment())
            run = subprocess.run(
                command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
    finally:
        stop_launch(flwr_home)
    assert out_file.is_file(), f"the app wrote no report:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
    report = json.loads(out_file.read_text())
    assert report["fedfields"].startswith(str(target))
    for name in ("decentnerf", "fedavg"):
        rounds = report[name]["rounds"]
        assert sorted(rounds) == [str(r) for r in range(1, ROUNDS + 1)]
        for metrics in rounds.values():
            assert metrics["num-replies"] == NODES and metrics["num-failures"] == 0
            assert metrics["from-wheel"] == 1.0  # every ClientApp imported the wheel's fedfields
        assert report[name]["error"] < 0.5 * report["initial-error"]
    decent = report["decentnerf"]
    assert decent["alpha-lr"] == 0.05  # DecentNeRF.from_config read the app's run-config
    assert decent["rounds"]["1"]["alpha"] == 1.0  # no G in round 1
    assert decent["rounds"]["2"]["alpha"] != 1.0  # Eq. 2 moved the clients' alphas
