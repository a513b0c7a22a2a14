"""Devices: the settings a user may write, resolved and checked, and the guard that makes a
tensor's CUDA device current around a kernel launch."""

from __future__ import annotations

import contextlib

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
"""The device settings a user may write (node-config `device`, `--device`, `server-device`)."""


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' means CUDA when a device is present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def canonical_device(device: str | torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device (cuda:0 unless changed), so
    "cuda" and "cuda:0" compare equal and key one cache entry; other devices as they are."""
    device = resolve_device(device)
    if device.type == "cuda" and device.index is None:
        # before CUDA is initialised the current device is 0 (and asking would initialise it)
        return torch.device(
            "cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        )
    return device


def is_device_text(value: str) -> bool:
    """Whether `value` is one of `DEVICE_CHOICES` (case and surrounding blanks aside)."""
    kind, colon, index = str(value).strip().lower().partition(":")
    return (kind in ("auto", "cpu", "cuda") and not colon) or (kind == "cuda" and index.isdigit())


def parse_device(value: str, where: str) -> torch.device:
    """A user's device setting checked and resolved; one ValueError starting with `where`
    (e.g. "node-config 'device'") names the value when it is malformed or names a CUDA
    device this process cannot see (so a node never falls back to the CPU silently)."""
    text = str(value).strip().lower()
    if not is_device_text(text):
        raise ValueError(f"{where} = {value!r}: expected {DEVICE_CHOICES}")
    device = resolve_device(text)
    if device.type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            raise ValueError(
                f"{where} = {value!r}: no CUDA device is visible to this process "
                "(torch.cuda.is_available() is False); use cpu or auto"
            )
        if device.index is not None and device.index >= visible:
            raise ValueError(
                f"{where} = {value!r}: only {visible} CUDA device(s) are visible "
                f"(cuda:0 to cuda:{visible - 1})"
            )
    return device


def triton_launch_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` current around a Triton launch (Triton launches on the current CUDA
    device, so a node on cuda:1 would otherwise launch on cuda:0); nothing for CPU tensors."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
