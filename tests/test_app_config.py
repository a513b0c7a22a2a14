"""The repo's pyproject.toml is a valid Flower 1.41 App."""

import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
DASH_CASE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@pytest.fixture(scope="module")
def config() -> dict:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


def _flat_keys(table: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        if isinstance(value, dict):
            keys += _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_flower_validator_accepts_pyproject() -> None:
    from flwr.cli.config_utils import load_and_validate

    # check_module=True also resolves every component reference from the app dir.
    cfg, warnings = load_and_validate(PYPROJECT, check_module=True)
    assert cfg["project"]["name"] == "fedfields"
    assert warnings == []


def test_no_federations_section(config: dict) -> None:
    # flwr run migrates this section to $FLWR_HOME and comments it out in the repo's file.
    assert "federations" not in config["tool"]["flwr"]


@pytest.mark.parametrize("component", ["serverapp", "clientapp"])
def test_components_import_as_flower_apps(config: dict, component: str) -> None:
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    expected = {"serverapp": ServerApp, "clientapp": ClientApp}[component]
    ref = config["tool"]["flwr"]["app"]["components"][component]
    module_name, _, attr_path = ref.partition(":")
    sys.path.insert(0, str(ROOT))
    try:
        obj = importlib.import_module(module_name)
    finally:
        sys.path.remove(str(ROOT))
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    assert isinstance(obj, expected), f"{ref} is {type(obj).__name__}, not {expected.__name__}"


def test_run_config_keys_are_dash_case(config: dict) -> None:
    run_config = config["tool"]["flwr"]["app"].get("config", {})
    assert run_config, "expected a [tool.flwr.app.config] table"
    for key in _flat_keys(run_config):
        for part in key.split("."):
            assert DASH_CASE.match(part), f"run-config key {key!r} is not dash-case"
