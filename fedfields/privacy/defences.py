"""Client-side defences of split-learning NeRF training (paper 000, Sec. 6).

S2NeRF (Sec. 6, "S^2NeRF"): before returning the cut-layer gradients g_1, ..., g_B of a batch
(one d-dimensional g_i = dLoss/dE_i per sample point), the client adds
<g_i> = g_i + eta_i, eta_i ~ N(0, sigma_t^2 I_d), sigma_t = c * max_i ||g_i|| * r^(t/T),
so the noise follows the gradients' scale and decays from c * max||g_i|| at step 0 to
c * max||g_i|| * r at step T (r = 1: no decay). Paper default c = 1.2, r = 1e-4.

NoisyLabelNeRF (Sec. 6, the baseline): <C(r)> = C(r) + xi, xi ~ N(0, sigma_l^2), on the
target pixel colours before the loss; fresh noise at every step.

Both draw their noise from `step_noise(seed, step)`: independent across steps, repeatable
from the seed, whether one defence object serves the whole run or one is built per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


class ClientDefence:
    """Hooks a client defence may override: targets before the loss, the gradient it returns."""

    def perturb_targets(self, targets: Tensor, step: int) -> Tensor:
        """Target pixel colours [R, 3] the loss is computed against at `step` (default: as is)."""
        return targets

    def perturb_gradient(self, gradient: Tensor, step: int) -> Tensor:
        """Cut-layer gradient [N, d] sent to the server at `step` (default: as is)."""
        return gradient


def step_noise(seed: int, step: int, like: Tensor) -> Tensor:
    """N(0, 1) samples shaped, typed and placed like `like`: a function of (seed, step) alone.

    Each step draws from its own generator, seeded by mixing (seed, step) with NumPy's
    SeedSequence, so the noise is independent across steps even when the defence is rebuilt
    for every step (a Flower client between messages; one shared pattern would let the server
    average it away), and a rerun with the same seed repeats it exactly.
    """
    if seed < 0 or step < 0:
        raise ValueError(f"noise seed and step must be >= 0, got seed {seed}, step {step}")
    (mixed,) = np.random.SeedSequence([seed, step]).generate_state(1, dtype=np.uint64)
    generator = torch.Generator(device=like.device).manual_seed(int(mixed))
    return torch.randn(like.shape, generator=generator, dtype=like.dtype, device=like.device)


@dataclass(kw_only=True)
class S2NeRFNoise(ClientDefence):
    """Decaying, gradient-scaled Gaussian noise on the returned cut-layer gradients (S2NeRF)."""

    c: float = 1.2  # noise scale
    r: float = 1e-4  # decay ratio over the run, in (0, 1]; 1 keeps the noise constant
    total_steps: int  # T: the training steps the decay spans (the run's length)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.c >= 0:
            raise ValueError(f"S2NeRF noise scale c must be >= 0, got {self.c}")
        if not 0 < self.r <= 1:
            raise ValueError(f"S2NeRF decay ratio r must be in (0, 1], got {self.r}")
        if self.total_steps < 1:
            raise ValueError(f"S2NeRF total_steps must be >= 1, got {self.total_steps}")

    def sigma(self, gradient: Tensor, step: int) -> Tensor:
        """sigma_t = c * max_i ||g_i|| * r^(t/T) over the rows g_i of `gradient` [..., d]."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        max_norm = gradient.reshape(-1, gradient.shape[-1]).norm(dim=-1).max()
        return self.c * max_norm * self.r ** (step / self.total_steps)

    def perturb_gradient(self, gradient: Tensor, step: int) -> Tensor:
        """<g_i> = g_i + eta_i with eta_i ~ N(0, sigma_t^2 I_d), one sigma_t for the batch."""
        return gradient + self.sigma(gradient, step) * step_noise(self.seed, step, gradient)


@dataclass
class NoisyLabel(ClientDefence):
    """NoisyLabelNeRF baseline: Gaussian noise of std `sigma` on the target pixel colours."""

    sigma: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sigma >= 0:
            raise ValueError(f"NoisyLabel sigma must be >= 0, got {self.sigma}")

    def perturb_targets(self, targets: Tensor, step: int) -> Tensor:
        """<C(r)> = C(r) + xi, xi ~ N(0, sigma^2) per colour channel (not clipped)."""
        return targets + self.sigma * step_noise(self.seed, step, targets)
