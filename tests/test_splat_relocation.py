"""The server's structure step for splat fields (issue 59): 3DGS-MCMC's relocation of dead
Gaussians (eq. 9) against the paper's double sum written out, against the render it should
preserve, and against gsplat's CUDA kernel where a GPU is lent; what it changes in a state."""

from __future__ import annotations

import math

import pytest
import torch
from test_splats import camera

from fedfields.fields import SplatField, SplatFieldConfig
from fedfields.fields.splats import (
    GAUSSIAN_TENSORS,
    STATE_PREFIX,
    Gaussians,
    relocate_dead,
    relocated_opacities_and_scales,
)
from fedfields.render.splatting import render_splats
from fedfields.train.federated import federated_state


def paper_scale_factor(opacity: float, copies: int) -> tuple[float, float]:
    """Eq. 9 in scalars, as the paper prints it: o' = 1 - (1 - o)^(1/N), and the factor on
    each scale o / sum_{i=1}^{N} sum_{k=0}^{i-1} C(i-1, k) (-1)^k o'^(k+1) / sqrt(k+1)."""
    new = 1.0 - (1.0 - opacity) ** (1.0 / copies)
    denominator = sum(
        math.comb(i - 1, k) * (-1) ** k * new ** (k + 1) / math.sqrt(k + 1)
        for i in range(1, copies + 1)
        for k in range(i)
    )
    return new, opacity / denominator


def test_eq9_equals_the_paper_s_double_sum_and_n_copies_composite_to_the_original() -> None:
    opacities = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.99, 0.7])
    scales = torch.tensor([[0.1, 0.2, 0.3]]).repeat(6, 1)
    copies = torch.tensor([1, 2, 3, 4, 7, 12])
    new_opacity, new_scales = relocated_opacities_and_scales(opacities, scales, copies)
    for i in range(6):
        expected_opacity, factor = paper_scale_factor(float(opacities[i]), int(copies[i]))
        assert float(new_opacity[i]) == pytest.approx(expected_opacity, rel=1e-6)
        torch.testing.assert_close(new_scales[i], scales[i] * factor, rtol=1e-5, atol=0)
    composite = 1 - (1 - new_opacity.double()) ** copies.double()  # N copies at one place
    torch.testing.assert_close(composite.float(), opacities, rtol=1e-5, atol=1e-6)
    assert new_opacity[0] == opacities[0] and (new_scales[0] == scales[0]).all()  # N = 1


def test_two_relocated_copies_render_as_the_gaussian_they_replace() -> None:
    """One Gaussian, then two copies with eq. 9's opacity and scales at its place: the peak
    alpha and the image's summed alpha stay within 1% and 5%, each pixel within 0.03 (eq. 9
    holds at the centre and for the integral, not at every pixel), where copies that kept the
    old scale would add 5% more alpha."""
    cameras = camera(32, 32)
    means = torch.zeros(1, 3)
    quats = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    scales = torch.tensor([[0.3, 0.3, 0.3]])
    opacity = torch.tensor([0.8])
    sh = torch.full((1, 1, 3), 1.0)
    background = torch.zeros(3)
    image, alpha = render_splats(
        Gaussians(means, quats, scales, opacity, sh), cameras, 0, background
    )
    new_opacity, new_scales = relocated_opacities_and_scales(opacity, scales, torch.tensor([2]))

    def two_copies(copy_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        copy = Gaussians(means, quats, copy_scales, new_opacity, sh)
        return render_splats(Gaussians.joined(copy, copy), cameras, 0, background)

    image2, alpha2 = two_copies(new_scales)
    assert float(alpha2.max()) == pytest.approx(float(alpha.max()), abs=1e-2)
    assert float(alpha2.sum() / alpha.sum()) == pytest.approx(1.0, abs=0.05)
    assert float((image2 - image).abs().max()) < 0.03
    _, unscaled = two_copies(scales)
    assert float(unscaled.sum() / alpha.sum()) > 1.05


def splat_state(count: int, seed: int) -> dict[str, torch.Tensor]:
    """A field's federated state with opacities drawn in (0, 1) from `seed`."""
    field = SplatField(SplatFieldConfig(count=count, sh_degree=1, seed=seed))
    state = federated_state(field)
    generator = torch.Generator().manual_seed(seed)
    state[STATE_PREFIX + "opacities"] = torch.logit(torch.rand(count, generator=generator))
    state[STATE_PREFIX + "sh"] = torch.randn(state[STATE_PREFIX + "sh"].shape, generator=generator)
    return state


def test_relocation_moves_every_dead_gaussian_onto_a_live_one_and_keeps_the_shapes() -> None:
    state = splat_state(200, seed=3)
    before = {name: tensor.clone() for name, tensor in state.items()}
    opacities = torch.sigmoid(state[STATE_PREFIX + "opacities"])
    moved, relocation = relocate_dead(state, 0.2, torch.Generator().manual_seed(0))
    assert all(torch.equal(state[name], before[name]) for name in state)  # input untouched
    assert {n: t.shape for n, t in moved.items()} == {n: t.shape for n, t in state.items()}
    assert torch.equal(relocation.dead, (opacities <= 0.2).nonzero().flatten())
    assert len(relocation.dead) > 20 and not (opacities[relocation.sources] <= 0.2).any()
    for name in GAUSSIAN_TENSORS:  # each dead slot now holds its source's Gaussian
        key = STATE_PREFIX + name
        torch.testing.assert_close(moved[key][relocation.dead], moved[key][relocation.sources])
    assert (torch.sigmoid(moved[STATE_PREFIX + "opacities"]) >= 0.2 - 1e-6).all()
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[relocation.dead] = False
    untouched[relocation.sources] = False
    for key in state:
        assert torch.equal(moved[key][untouched], state[key][untouched])
    # each source's opacity falls so that it and its copies composite to what it was
    sources, counts = relocation.sources.unique(return_counts=True)
    new = torch.sigmoid(moved[STATE_PREFIX + "opacities"][sources].double())
    floor = new > 0.2 + 1e-6  # those not lifted to the threshold
    composite = 1 - (1 - new) ** (counts.double() + 1)
    torch.testing.assert_close(composite[floor], opacities[sources][floor].double(), rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_relocation_is_seeded_and_does_nothing_without_a_dead_or_a_live_gaussian() -> None:
    state = splat_state(100, seed=4)
    first, _ = relocate_dead(state, 0.3, torch.Generator().manual_seed(7))
    again, _ = relocate_dead(state, 0.3, torch.Generator().manual_seed(7))
    other, _ = relocate_dead(state, 0.3, torch.Generator().manual_seed(8))
    key = STATE_PREFIX + "means"
    assert torch.equal(first[key], again[key]) and not torch.equal(first[key], other[key])
    for threshold in (1e-9, 0.999999):  # none dead; every one dead
        same, relocation = relocate_dead(state, threshold, torch.Generator().manual_seed(0))
        assert len(relocation.sources) == 0
        assert all(torch.equal(same[name], state[name]) for name in state)


def test_eq9_equals_gsplat_s_cuda_relocation_kernel() -> None:
    """On a CUDA device with gsplat: gsplat's `compute_relocation` gives the same opacities
    and scales (float32 there)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gsplat_relocation = pytest.importorskip("gsplat.relocation")
    generator = torch.Generator().manual_seed(1)
    opacities = 0.01 + 0.98 * torch.rand(64, generator=generator)
    scales = 0.01 + torch.rand(64, 3, generator=generator)
    copies = torch.randint(1, 9, (64,), generator=generator)
    binomials = torch.tensor(
        [[math.comb(n, k) for k in range(51)] for n in range(51)], dtype=torch.float32
    )
    theirs = gsplat_relocation.compute_relocation(
        opacities.cuda(), scales.cuda(), copies.float().cuda(), binomials.cuda()
    )
    ours = relocated_opacities_and_scales(opacities, scales, copies)
    torch.testing.assert_close(theirs[0].cpu(), ours[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(theirs[1].cpu(), ours[1], rtol=1e-4, atol=1e-6)
