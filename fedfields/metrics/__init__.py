"""Image quality and leakage metrics."""

from fedfields.metrics.image import lpips, psnr, ssim

__all__ = ["lpips", "psnr", "ssim"]
