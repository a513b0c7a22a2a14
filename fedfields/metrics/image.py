"""PSNR, SSIM and LPIPS between images in [0, 1], as reported by the papers we reproduce.

Images are [H, W, C] or [N, H, W, C] numpy arrays or torch tensors with data range 1.
LPIPS needs the `lpips` package (a dependency) and its backbone weights, which torchvision
downloads at first use; without them it is reported as None (with one warning) so that a run
without them still completes. The download gives up after `DOWNLOAD_TIMEOUT_SECONDS` without a
reply, and with environment variable `FEDFIELDS_NO_DOWNLOADS=1` (an air-gapped node, the test
suite) it is never tried: LPIPS then needs the weights already in torch's hub cache.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

ArrayLike = np.ndarray | torch.Tensor


def psnr(prediction: ArrayLike, target: ArrayLike, mask: ArrayLike | None = None) -> float:
    """Peak signal-to-noise ratio in dB (data range 1); `mask` [H, W] (or [N, H, W]) weights pixels.

    With a mask the squared error is averaged over pixels and channels weighted by the mask,
    so a boolean mask restricts PSNR to the selected pixels.
    """
    prediction, target = _pair(prediction, target)
    squared_error = (prediction - target) ** 2
    if mask is None:
        mse = float(squared_error.mean())
    else:
        weights = _mask_weights(mask, prediction.shape[:-1])
        mse = float(
            (squared_error * weights[..., None]).sum() / (weights.sum() * prediction.shape[-1])
        )
    return math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse)


def ssim(prediction: ArrayLike, target: ArrayLike) -> float:
    """Structural similarity (scikit-image, data range 1); for a batch the mean over images.

    scikit-image's metrics load scipy.ndimage (0.3 s), so they are imported here, on first
    use: a deployed node's ClientApp process, started for every message, never scores SSIM.
    """
    from skimage.metrics import structural_similarity

    prediction, target = _pair(prediction, target)
    if prediction.ndim == 3:
        return float(structural_similarity(prediction, target, channel_axis=-1, data_range=1.0))
    return float(
        np.mean(
            [
                structural_similarity(p, t, channel_axis=-1, data_range=1.0)
                for p, t in zip(prediction, target, strict=True)
            ]
        )
    )


NO_DOWNLOADS = "FEDFIELDS_NO_DOWNLOADS"
"""Environment variable: "1" keeps LPIPS from fetching backbone weights."""
DOWNLOAD_TIMEOUT_SECONDS = 60.0
"""A socket wait without a reply after which the backbone download fails (a node whose network
drops packets would otherwise wait forever: torch.hub sets no timeout)."""
BACKBONE_WEIGHTS = {
    "alex": "alexnet-owt-7be5be79.pth",
    "vgg": "vgg16-397923af.pth",
    "squeeze": "squeezenet1_1-b8a52dc0.pth",
}
"""The file torchvision caches for each LPIPS backbone (its IMAGENET1K_V1 weights' URL name)."""

LPIPS_MIN_SIDE = {"alex": 63, "vgg": 16, "squeeze": 17}
"""Smallest image side each LPIPS backbone's pooling takes (torchvision's networks, measured):
a 50x50 crowd has no AlexNet LPIPS."""


def lpips(prediction: ArrayLike, target: ArrayLike, network: str = "alex") -> float | None:
    """LPIPS distance (mean over images); None when the `lpips` package or weights are missing
    or the images are smaller than the backbone takes (`LPIPS_MIN_SIDE`), each said once."""
    prediction, target = _pair(prediction, target)
    height, width = prediction.shape[-3:-1]
    if min(height, width) < LPIPS_MIN_SIDE.get(network, 0):
        _warn_too_small(network, height, width)
        return None
    model = _lpips_model(network)
    if model is None:
        return None
    with torch.no_grad():
        distance = model(_lpips_input(prediction), _lpips_input(target))
    return float(distance.mean())


@functools.cache
def _lpips_model(network: str) -> Any | None:
    """The LPIPS model for `network`, built once; on any failure warn once and return None."""
    previous_timeout = socket.getdefaulttimeout()
    try:
        import lpips as lpips_package

        if os.environ.get(NO_DOWNLOADS) == "1" and not _backbone_cached(network):
            raise FileNotFoundError(
                f"{NO_DOWNLOADS}=1 and no {BACKBONE_WEIGHTS.get(network, network)} in "
                f"{Path(torch.hub.get_dir()) / 'checkpoints'}"
            )
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_SECONDS)
        with warnings.catch_warnings():  # lpips 0.1.4 asks torchvision with its deprecated names
            warnings.filterwarnings("ignore", category=UserWarning, module="torchvision")
            return lpips_package.LPIPS(net=network, verbose=False).eval()
    except Exception as error:  # noqa: BLE001 - any import or weight-loading failure means "unavailable"
        warnings.warn(
            f"LPIPS unavailable: {type(error).__name__}: {error}; install lpips and torchvision "
            f"(a torchvision built for this torch) with backbone weights cached (torchvision "
            f"downloads the {network} weights at first use). LPIPS is reported as None.",
            UserWarning,
            stacklevel=3,
        )
        return None
    finally:
        socket.setdefaulttimeout(previous_timeout)


def _backbone_cached(network: str) -> bool:
    """Whether torch's hub cache holds `network`'s backbone weights."""
    name = BACKBONE_WEIGHTS.get(network)
    return name is not None and (Path(torch.hub.get_dir()) / "checkpoints" / name).is_file()


@functools.cache
def _warn_too_small(network: str, height: int, width: int) -> None:
    """One warning per backbone and image size: LPIPS is None for these images."""
    warnings.warn(
        f"LPIPS ({network}) needs images of at least {LPIPS_MIN_SIDE[network]} pixels a side; "
        f"these are {height}x{width}: LPIPS is reported as None.",
        UserWarning,
        stacklevel=3,
    )


def _lpips_input(images: np.ndarray) -> torch.Tensor:
    """[H, W, C] or [N, H, W, C] in [0, 1] -> float32 NCHW in [-1, 1] on the CPU."""
    batch = images[None] if images.ndim == 3 else images
    return torch.from_numpy(batch).permute(0, 3, 1, 2).float() * 2.0 - 1.0


def _pair(prediction: ArrayLike, target: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Both images as float64 numpy arrays of one shape, [H, W, C] or [N, H, W, C]."""
    prediction, target = _as_numpy(prediction), _as_numpy(target)
    if prediction.shape != target.shape:
        raise ValueError(f"prediction shape {prediction.shape} != target shape {target.shape}")
    if prediction.ndim not in (3, 4):
        raise ValueError(f"images must be [H, W, C] or [N, H, W, C], got shape {prediction.shape}")
    return prediction, target


def _as_numpy(array: ArrayLike) -> np.ndarray:
    """A float64 numpy copy of a numpy array or (any-device) torch tensor."""
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    return np.asarray(array, dtype=np.float64)


def _mask_weights(mask: ArrayLike, pixel_shape: tuple[int, ...]) -> np.ndarray:
    """Non-negative per-pixel weights broadcast to `pixel_shape`; an empty mask is an error."""
    weights = _as_numpy(mask)
    try:
        weights = np.broadcast_to(weights, pixel_shape)
    except ValueError as error:
        raise ValueError(
            f"mask shape {weights.shape} does not match image pixels {pixel_shape}"
        ) from error
    if (weights < 0).any():
        raise ValueError("mask weights must be >= 0")
    if not weights.sum() > 0:
        raise ValueError("mask selects no pixels")
    return weights
