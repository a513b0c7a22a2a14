"""Image metrics agree with scikit-image; LPIPS degrades to None with one warning."""

from __future__ import annotations

import math
import socket
import sys
import types
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from fedfields.metrics import image, lpips, psnr, ssim


@pytest.fixture
def images() -> tuple[np.ndarray, np.ndarray]:
    """A target batch [3, 64, 72, 3] (AlexNet's LPIPS takes 63 pixels a side and up) and a
    noisy prediction, both in [0, 1]."""
    rng = np.random.default_rng(0)
    target = rng.random((3, 64, 72, 3))
    prediction = np.clip(target + rng.normal(0.0, 0.1, target.shape), 0.0, 1.0)
    return prediction, target


@pytest.fixture(autouse=True)
def fresh_lpips_model(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test builds (and may warn about) the LPIPS model anew, as a user's process would
    (downloads allowed: the tests here stand in for the package or provide the weights)."""
    monkeypatch.delenv(image.NO_DOWNLOADS, raising=False)
    image._lpips_model.cache_clear()
    yield
    image._lpips_model.cache_clear()


def test_psnr_matches_skimage(images: tuple[np.ndarray, np.ndarray]) -> None:
    prediction, target = images
    expected = peak_signal_noise_ratio(target[0], prediction[0], data_range=1)
    assert psnr(prediction[0], target[0]) == pytest.approx(expected, rel=1e-12)
    assert psnr(torch.from_numpy(prediction[0]), torch.from_numpy(target[0])) == pytest.approx(
        expected, rel=1e-12
    )
    batch_expected = peak_signal_noise_ratio(target, prediction, data_range=1)
    assert psnr(prediction, target) == pytest.approx(batch_expected, rel=1e-12)
    assert psnr(target, target) == math.inf


def test_boolean_mask_restricts_psnr(images: tuple[np.ndarray, np.ndarray]) -> None:
    prediction, target = images[0][0], images[1][0]
    mask = np.zeros(prediction.shape[:2], dtype=bool)
    mask[4:20, 3:11] = True
    mse = np.mean((prediction[mask] - target[mask]) ** 2)
    assert psnr(prediction, target, mask) == pytest.approx(10 * math.log10(1 / mse), rel=1e-12)
    assert psnr(prediction, target, torch.from_numpy(mask)) == pytest.approx(
        10 * math.log10(1 / mse), rel=1e-12
    )


def test_float_mask_weights_pixels(images: tuple[np.ndarray, np.ndarray]) -> None:
    prediction, target = images[0][0], images[1][0]
    weights = np.random.default_rng(1).random(prediction.shape[:2])
    squared = ((prediction - target) ** 2).sum(axis=-1)
    mse = (squared * weights).sum() / (weights.sum() * 3)
    assert psnr(prediction, target, weights) == pytest.approx(10 * math.log10(1 / mse), rel=1e-12)


def test_psnr_rejects_empty_mask_and_mismatched_shapes(
    images: tuple[np.ndarray, np.ndarray],
) -> None:
    prediction, target = images[0][0], images[1][0]
    with pytest.raises(ValueError, match="no pixels"):
        psnr(prediction, target, np.zeros(prediction.shape[:2]))
    with pytest.raises(ValueError, match=r"\(64, 72, 3\).*\(72, 64, 3\)"):
        psnr(prediction, target.transpose(1, 0, 2))
    with pytest.raises(ValueError, match="mask shape"):
        psnr(prediction, target, np.ones((5, 5)))


def test_ssim_matches_skimage_and_averages_batches(images: tuple[np.ndarray, np.ndarray]) -> None:
    prediction, target = images
    per_image = [
        structural_similarity(p, t, channel_axis=-1, data_range=1.0)
        for p, t in zip(prediction, target, strict=True)
    ]
    assert ssim(prediction[1], target[1]) == pytest.approx(per_image[1], rel=1e-12)
    assert ssim(torch.from_numpy(prediction).float(), target) == pytest.approx(
        np.mean(per_image), abs=1e-6
    )
    assert ssim(prediction, target) == pytest.approx(np.mean(per_image), rel=1e-12)


def test_lpips_unavailable_without_package_warns_once(
    monkeypatch: pytest.MonkeyPatch, images: tuple[np.ndarray, np.ndarray]
) -> None:
    monkeypatch.setitem(sys.modules, "lpips", None)  # makes `import lpips` raise ImportError
    prediction, target = images
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lpips(prediction, target) is None
        assert lpips(prediction, target) is None
    assert len(caught) == 1
    assert caught[0].category is UserWarning
    assert "LPIPS unavailable: ModuleNotFoundError" in str(caught[0].message)
    assert "install lpips and torchvision" in str(caught[0].message)


def _fake_lpips_module(model_class: type) -> types.ModuleType:
    module = types.ModuleType("lpips")
    module.LPIPS = model_class  # type: ignore[attr-defined]
    return module


def test_lpips_unavailable_when_weights_cannot_be_fetched(
    monkeypatch: pytest.MonkeyPatch, images: tuple[np.ndarray, np.ndarray]
) -> None:
    class OfflineLPIPS:
        def __init__(self, net: str, verbose: bool) -> None:
            raise OSError(f"cannot download {net} weights")

    monkeypatch.setitem(sys.modules, "lpips", _fake_lpips_module(OfflineLPIPS))
    with pytest.warns(
        UserWarning, match="LPIPS unavailable: OSError: cannot download alex weights"
    ):
        assert lpips(*images) is None


def test_lpips_scales_inputs_and_returns_mean_distance(
    monkeypatch: pytest.MonkeyPatch, images: tuple[np.ndarray, np.ndarray]
) -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    class RecordingLPIPS(torch.nn.Module):
        def __init__(self, net: str, verbose: bool) -> None:
            super().__init__()
            assert net == "vgg"

        def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
            assert not torch.is_grad_enabled()
            seen.append((first, second))
            return torch.tensor([0.1, 0.2, 0.6]).reshape(3, 1, 1, 1)

    monkeypatch.setitem(sys.modules, "lpips", _fake_lpips_module(RecordingLPIPS))
    prediction, target = images
    target[0, 0, 0] = (0.0, 0.5, 1.0)
    assert lpips(prediction, target, network="vgg") == pytest.approx(0.3)
    first, second = seen[0]
    assert first.shape == second.shape == (3, 3, 64, 72)
    assert first.dtype == torch.float32
    torch.testing.assert_close(second[0, :, 0, 0], torch.tensor([-1.0, 0.0, 1.0]))
    assert second.min() == -1.0 and second.max() == 1.0
    torch.testing.assert_close(
        first, torch.from_numpy(prediction).permute(0, 3, 1, 2).float() * 2 - 1
    )


def _real_lpips() -> types.ModuleType | None:
    """The installed lpips package, or None where it (or torchvision under it) cannot import."""
    try:
        import lpips as package
    except Exception:  # noqa: BLE001 - torchvision built for another torch fails with RuntimeError
        return None
    return package


ALEX_LAYERS = (1, 4, 7, 9, 11)
"""torchvision AlexNet `features` indices whose outputs LPIPS compares (relu1 ... relu5)."""


def _lpips_by_hand(package: types.ModuleType, backbone: dict, first: torch.Tensor,
                   second: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """LPIPS (Zhang et al. 2018, Eq. 1) written out from its parts: ImageNet scaling, AlexNet's
    five ReLU outputs unit-normalised over channels, squared differences weighted by the
    package's learned 1x1 weights (v0.1), averaged over space and summed over layers."""
    from pathlib import Path

    import torchvision

    features = torchvision.models.alexnet().features.eval()
    features.load_state_dict({k.removeprefix("features."): v for k, v in backbone.items()
                              if k.startswith("features.")})  # fmt: skip
    weights = torch.load(
        Path(package.__file__).parent / "weights" / "v0.1" / "alex.pth", map_location="cpu"
    )
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
    a, b = (first - shift) / scale, (second - shift) / scale
    total = torch.zeros(first.shape[0])
    layer = 0
    for index, module in enumerate(features):
        a, b = module(a), module(b)
        if index in ALEX_LAYERS:
            unit_a = a / (a.square().sum(1, keepdim=True).sqrt() + 1e-10)
            unit_b = b / (b.square().sum(1, keepdim=True).sqrt() + 1e-10)
            w = weights[f"lin{layer}.model.1.weight"]  # [1, C, 1, 1]
            total += ((unit_a - unit_b).square() * w).sum(1).mean((1, 2))
            layer += 1
    return total


def test_lpips_from_the_real_package_with_backbone_weights_the_test_provides(
    monkeypatch: pytest.MonkeyPatch, tmp_path, images: tuple[np.ndarray, np.ndarray]
) -> None:
    """torchvision finds AlexNet's weights in TORCH_HOME's cache (here a seeded random AlexNet
    the test writes, as a user's first use would download the real one): fedfields' LPIPS
    equals the distance computed by hand from the same parts, and 0 for identical images."""
    package = _real_lpips()
    if package is None:
        pytest.skip("lpips (or torchvision under it) does not import with this torch build")
    import torchvision

    torch.manual_seed(0)
    backbone = torchvision.models.alexnet().state_dict()
    checkpoints = tmp_path / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    url = torchvision.models.AlexNet_Weights.IMAGENET1K_V1.url
    torch.save(backbone, checkpoints / url.rsplit("/", 1)[1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    prediction, target = images
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LPIPS unavailable")
        value = lpips(prediction, target)
        assert lpips(target, target) == pytest.approx(0.0, abs=1e-7)
    as_input = [torch.from_numpy(x).permute(0, 3, 1, 2).float() * 2 - 1 for x in images]
    with torch.no_grad():
        expected = _lpips_by_hand(package, backbone, *as_input).mean()
    assert value == pytest.approx(float(expected), rel=1e-4)


def test_lpips_of_images_below_the_backbones_input_is_none_said_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """25x25 (the tests' crowds) is below AlexNet's 63 pixels: None with one warning naming
    the sizes, and the model is never built."""
    image._warn_too_small.cache_clear()
    monkeypatch.setitem(sys.modules, "lpips", None)  # building the model would warn otherwise
    small = np.zeros((2, 25, 25, 3))
    with pytest.warns(UserWarning, match="at least 63 pixels a side; these are 25x25") as caught:
        assert lpips(small, small) is None
        assert lpips(small, small) is None
    assert len(caught) == 1


def test_without_downloads_lpips_never_reaches_the_network_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path, images: tuple[np.ndarray, np.ndarray]
) -> None:
    """FEDFIELDS_NO_DOWNLOADS=1 (the suite sets it) with an empty hub cache: None with one
    warning naming the variable and the missing file, and torch.hub is never asked."""
    if _real_lpips() is None:
        pytest.skip("lpips (or torchvision under it) does not import with this torch build")

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("a download was tried")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    monkeypatch.setenv(image.NO_DOWNLOADS, "1")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.warns(UserWarning, match="FEDFIELDS_NO_DOWNLOADS=1 and no alexnet-owt") as caught:
        assert lpips(*images) is None
        assert lpips(*images) is None
    assert len(caught) == 1 and str(tmp_path) in str(caught[0].message)


def test_the_backbone_download_waits_at_most_its_timeout_then_the_default_returns(
    monkeypatch: pytest.MonkeyPatch, images: tuple[np.ndarray, np.ndarray]
) -> None:
    """While the model is built (when torchvision would download) sockets time out after
    DOWNLOAD_TIMEOUT_SECONDS; the process's default comes back after, failed or not."""
    package = _real_lpips()
    if package is None:
        pytest.skip("lpips (or torchvision under it) does not import with this torch build")
    seen = []

    def building(*args: object, **kwargs: object) -> None:
        seen.append(socket.getdefaulttimeout())
        raise TimeoutError("timed out")  # as an unanswered download does

    monkeypatch.setattr(package, "LPIPS", building)
    socket.setdefaulttimeout(None)
    with pytest.warns(UserWarning, match="LPIPS unavailable: TimeoutError"):
        assert lpips(*images) is None
    assert seen == [image.DOWNLOAD_TIMEOUT_SECONDS] and socket.getdefaulttimeout() is None
