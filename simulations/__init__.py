"""This repository's Flower App: ServerApp jobs, launchers, simulation observers, benchmarks.

Not installed by the wheel (it holds only `fedfields`): the App runs from its directory, a
checkout or a Flower App bundle, which `APP_DIR` names for the launchers and benchmarks.
"""

from pathlib import Path

APP_DIR = Path(__file__).resolve().parent.parent
"""The Flower App's directory: pyproject.toml, the bundled data/ and the default runs/."""
