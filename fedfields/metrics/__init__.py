"""Image quality and leakage metrics."""

from fedfields.metrics.flops import linear_flops_per_sample, matmul_peak_flops
from fedfields.metrics.image import lpips, psnr, ssim

__all__ = ["linear_flops_per_sample", "lpips", "matmul_peak_flops", "psnr", "ssim"]
