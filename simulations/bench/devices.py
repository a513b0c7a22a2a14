"""The `--device` every benchmark takes (issue 34): checked once, with one clear error."""

from __future__ import annotations

import argparse

from fedfields.devices import DEVICE_CHOICES, parse_device


def device_setting(value: str) -> str:
    """A `--device` value resolved ("auto" becomes cuda or cpu); argparse reports a bad one."""
    try:
        return str(parse_device(value, "--device"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_device_argument(parser: argparse.ArgumentParser, what: str, default: str = "auto") -> None:
    """`--device` (default auto: CUDA when visible), for `what` the benchmark runs on it."""
    parser.add_argument(
        "--device",
        type=device_setting,
        default=default,
        help=f"{DEVICE_CHOICES} for {what} (default {default})",
    )


def add_cpu_only_device_argument(parser: argparse.ArgumentParser, why: str) -> None:
    """`--device cpu`, the only choice of a benchmark whose work has no device path (`why`)."""
    parser.add_argument("--device", choices=["cpu"], default="cpu", help=f"cpu only: {why}")
