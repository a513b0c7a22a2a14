"""Federated meta-learning (FedMeNF Algorithm 1): meta-gradients, gamma, TTO and PSNR_p."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from fedfields.data.scene import Scene
from fedfields.data.tasks import ImageTask, VideoTask, lfw_faces
from fedfields.fields import NeRFField, NeRFFieldConfig, Siren, SirenConfig
from fedfields.geometry.cameras import orbit_cameras
from fedfields.methods.fedprox import ProximalHook
from fedfields.methods.scaffold import ScaffoldHook
from fedfields.train import meta
from fedfields.train.meta import MetaConfig, adaptive_gamma, local_meta_update, privacy_metrics
from fedfields.train.meta_tasks import CoordinateTask, MetaTask, RayTask, coordinate_tasks

FULL = 1 << 20  # a batch size covering every pixel: batches are then the whole set, in order
NO_CLIP = 1e12


def _siren(seed: int = 0, dtype: torch.dtype = torch.float64, **options: int) -> Siren:
    torch.manual_seed(seed)
    config = SirenConfig(in_features=2, out_features=1, width=8, depth=2, w0=10.0)
    return Siren(replace(config, **options)).to(dtype)


def _image_task(seed: int = 0, size: int = 8) -> CoordinateTask:
    rng = np.random.default_rng(seed)
    return CoordinateTask(ImageTask.from_array(f"noise{seed}", rng.random((size, size, 1))))


def _weights(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _config(learner: str, **options: float) -> MetaConfig:
    """One full-batch outer step with SGD(lr=1) and no clipping: w_1 = w_0 - g."""
    defaults = dict(
        outer_steps=1,
        inner_steps=2,
        inner_lr=0.05,
        outer_lr=1.0,
        max_grad_norm=NO_CLIP,
        support_batch=FULL,
        query_batch=FULL,
    )
    return MetaConfig(learner=learner, **{**defaults, **options})


def _adapt(model: nn.Module, task: MetaTask, weights: dict[str, Tensor], steps: int, lr: float):
    """phi_K: `steps` plain full-batch SGD steps on the support set (Eq. 8), no graph kept."""
    phi = {name: w.clone().requires_grad_() for name, w in weights.items()}
    generator = torch.Generator()
    for _ in range(steps):
        loss = task.loss(model, phi, task.support_batch(FULL, generator))
        grads = torch.autograd.grad(loss, list(phi.values()))
        phi = {
            n: (p - lr * g).detach().requires_grad_()
            for (n, p), g in zip(phi.items(), grads, strict=True)
        }
    return phi


def _query_loss(model: nn.Module, task: MetaTask, params: dict[str, Tensor]) -> Tensor:
    return task.loss(model, params, task.query_batch(FULL, torch.Generator()))


def _query_gradient(model: nn.Module, task: MetaTask, params: dict[str, Tensor]):
    params = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
    grads = torch.autograd.grad(_query_loss(model, task, params), list(params.values()))
    return dict(zip(params, grads, strict=True))


def _assert_dicts_close(actual: dict[str, Tensor], expected: dict[str, Tensor], **tol) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], **tol, msg=name)


def test_maml_meta_gradient_matches_finite_differences() -> None:
    model, task = _siren(), _image_task()
    w0 = _weights(model)
    result = local_meta_update(model, [task], _config("maml"))
    _assert_dicts_close(  # SGD(lr=1): the step is the applied meta-gradient
        {n: w0[n] - result.state[n] for n in w0}, result.mean_outer_gradient, rtol=0, atol=1e-12
    )

    def outer_loss(weights: dict[str, Tensor]) -> float:
        return _query_loss(model, task, _adapt(model, task, weights, 2, 0.05)).item()

    eps = 1e-6
    for name, w in w0.items():
        numeric = torch.empty_like(w).flatten()
        for i in range(w.numel()):
            shift = torch.zeros_like(w).flatten()
            shift[i] = eps
            plus = outer_loss({**w0, name: w + shift.view_as(w)})
            minus = outer_loss({**w0, name: w - shift.view_as(w)})
            numeric[i] = (plus - minus) / (2 * eps)
        torch.testing.assert_close(
            result.mean_outer_gradient[name], numeric.view_as(w), rtol=1e-5, atol=1e-8, msg=name
        )
    fomaml = local_meta_update(_siren(), [task], _config("fomaml")).mean_outer_gradient
    difference = sum(float((fomaml[n] - result.mean_outer_gradient[n]).norm()) for n in w0)
    assert difference > 1e-4  # the second-order terms matter


def test_fomaml_gradient_is_the_query_gradient_at_phi_k() -> None:
    model, task = _siren(), _image_task()
    w0 = _weights(model)
    result = local_meta_update(model, [task], _config("fomaml"))
    expected = _query_gradient(model, task, _adapt(model, task, w0, 2, 0.05))
    _assert_dicts_close(result.mean_outer_gradient, expected, rtol=1e-10, atol=1e-12)
    _assert_dicts_close(result.state, {n: w0[n] - expected[n] for n in w0}, rtol=0, atol=1e-12)


def test_fedmenf_with_gamma_one_and_no_inner_steps_leaves_w_unchanged() -> None:
    model, task = _siren(), _image_task()
    w0 = _weights(model)
    result = local_meta_update(model, [task], _config("fedmenf", inner_steps=0, gamma=1.0))
    _assert_dicts_close(result.state, w0, rtol=0, atol=1e-15)
    assert result.gammas == [1.0] and result.outer_losses == [pytest.approx(0.0, abs=1e-15)]


def test_fedmenf_gradient_is_maml_minus_gamma_times_memorising_gradient() -> None:
    task, gamma = _image_task(), 0.3
    maml = local_meta_update(_siren(), [task], _config("maml"))
    model = _siren()
    w0 = _weights(model)
    result = local_meta_update(model, [task], _config("fedmenf", gamma=gamma))
    memorising = _query_gradient(model, task, w0)  # g_K = grad_w L(w, B_K)
    expected = {n: maml.mean_outer_gradient[n] - gamma * memorising[n] for n in w0}  # Eq. 10
    _assert_dicts_close(result.mean_outer_gradient, expected, rtol=1e-9, atol=1e-12)
    l_pp = maml.outer_losses[0] - gamma * _query_loss(model, task, w0).item()
    assert result.outer_losses == [pytest.approx(l_pp, rel=1e-12)]
    assert result.gammas == [gamma] and maml.gammas == []


def test_memorising_bound_stops_the_push_only_beyond_it() -> None:
    """With L(w) above the bound the -gamma L(w) term has no gradient (FedMeNF's step is
    MAML's); below it, the step is the unbounded FedMeNF step."""
    task, gamma = _image_task(), 0.3
    loss_w = _query_loss(_siren(), task, _weights(_siren())).item()
    maml = local_meta_update(_siren(), [task], _config("maml"))
    unbounded = local_meta_update(_siren(), [task], _config("fedmenf", gamma=gamma))
    above = local_meta_update(
        _siren(), [task], _config("fedmenf", gamma=gamma, memorising_bound=0.5 * loss_w)
    )
    below = local_meta_update(
        _siren(), [task], _config("fedmenf", gamma=gamma, memorising_bound=2.0 * loss_w)
    )
    _assert_dicts_close(above.mean_outer_gradient, maml.mean_outer_gradient, rtol=0, atol=0)
    _assert_dicts_close(below.mean_outer_gradient, unbounded.mean_outer_gradient, rtol=0, atol=0)
    assert above.outer_losses[0] == pytest.approx(maml.outer_losses[0] - gamma * 0.5 * loss_w)


def test_adaptive_gamma_follows_eq_14_and_is_clipped() -> None:
    # 1 - N zeta / (R E M lambda_o |g_K|^2) = 1 - 50 * 0.01 / (10 * 4 * 5 * 0.05 * 2) = 0.975
    assert adaptive_gamma(0.01, 50, 10, 4, 5, 0.05, 2.0) == pytest.approx(0.975)
    assert adaptive_gamma(0.01, 50, 10, 4, 5, 0.05, 1e-4) == 0.0  # budget exceeds leakage
    assert adaptive_gamma(0.0, 50, 10, 4, 5, 0.05, 2.0) == 1.0  # no budget: remove all of g_K
    assert adaptive_gamma(0.01, 50, 10, 4, 5, 0.05, 0.0) == 0.0  # nothing to remove
    for grad_norm_sq in (1e-6, 0.3, 1.0, 1e6):
        assert 0.0 <= adaptive_gamma(0.01, 50, 10, 4, 5, 0.05, grad_norm_sq) <= 1.0


def test_local_meta_update_uses_the_adaptive_gamma_of_the_memorising_gradient() -> None:
    model, task = _siren(), _image_task()
    w0 = _weights(model)
    options = dict(privacy_budget=1e-3, num_clients=8, rounds=3, clients_per_round=2)
    result = local_meta_update(model, [task], _config("fedmenf", outer_lr=0.05, **options))
    g_k = _query_gradient(model, task, w0)
    grad_norm_sq = sum(float(g.pow(2).sum()) for g in g_k.values())
    expected = adaptive_gamma(1e-3, 8, 3, 1, 2, 0.05, grad_norm_sq)
    assert 0.0 < expected < 1.0
    assert result.gammas == [pytest.approx(expected, rel=1e-9)]


def test_reptile_moves_w_towards_phi_k() -> None:
    model, task = _siren(), _image_task()
    w0 = _weights(model)
    result = local_meta_update(model, [task], _config("reptile", outer_lr=0.25))
    phi = _adapt(model, task, w0, 2, 0.05)
    expected = {n: w0[n] + 0.25 * (phi[n].detach() - w0[n]) for n in w0}
    _assert_dicts_close(result.state, expected, rtol=1e-10, atol=1e-12)
    assert result.gammas == []


def test_proximal_term_and_scaffold_correction_enter_the_outer_step() -> None:
    task, mu = _image_task(), 0.1
    plain = local_meta_update(_siren(), [task], _config("fomaml")).mean_outer_gradient
    model = _siren()
    w0 = _weights(model)
    reference = {n: w - 1.0 for n, w in w0.items()}
    server = {n: torch.full_like(w, 0.5) for n, w in w0.items()}
    client = {n: torch.zeros_like(w) for n, w in w0.items()}
    hooks = [ProximalHook(mu, reference), ScaffoldHook(server, client)]
    result = local_meta_update(model, [task], _config("fomaml"), hooks)
    expected = {n: plain[n] + mu * 1.0 for n in w0}  # grad of mu/2 ||w - w_global||^2
    _assert_dicts_close(result.mean_outer_gradient, expected, rtol=1e-10, atol=1e-12)
    stepped = {n: w0[n] - (expected[n] + 0.5) for n in w0}  # c - c_i is applied, not recorded
    _assert_dicts_close(result.state, stepped, rtol=0, atol=1e-12)


def test_outer_gradient_is_clipped_and_examples_are_summed() -> None:
    tasks = [_image_task(0), _image_task(1, size=9)]
    model = _siren()
    w0 = _weights(model)
    result = local_meta_update(model, tasks, _config("fomaml", max_grad_norm=1e-3))
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in result.mean_outer_gradient.values()))
    assert norm == pytest.approx(1e-3, rel=1e-4)
    step = math.sqrt(sum(float((result.state[n] - w0[n]).pow(2).sum()) for n in w0))
    assert step == pytest.approx(1e-3, rel=1e-4)
    assert result.num_examples == 64 + 81


@pytest.fixture(scope="module")
def faces() -> list[CoordinateTask]:
    return coordinate_tasks(lfw_faces(7, size=8))


def test_meta_learned_init_adapts_better_than_its_starting_point(faces) -> None:
    train, held_out = faces[:5], faces[5:]
    model = _siren(dtype=torch.float32, width=32, depth=3, w0=30.0)
    w0 = _weights(model)
    config = MetaConfig(
        learner="maml",
        outer_steps=40,
        inner_steps=2,
        inner_lr=0.01,
        outer_lr=1e-3,
        outer_optimizer="adamw",
        support_batch=FULL,
        query_batch=FULL,
    )
    result = local_meta_update(model, train, config)
    assert len(result.outer_losses) == 40 and result.num_examples == 5 * 64

    def adapted(weights: dict[str, Tensor], tasks: list[CoordinateTask]) -> float:
        losses = [_query_loss(model, t, _adapt(model, t, weights, 2, 0.01)).item() for t in tasks]
        return sum(losses) / len(losses)

    for tasks in (train, held_out):  # K steps from the learned init beat K steps from w0
        assert adapted(result.state, tasks) < 0.5 * adapted(w0, tasks)


def test_test_time_optimise_improves_with_steps_from_the_given_state(faces) -> None:
    model = _siren(dtype=torch.float32, width=32, depth=3, w0=30.0)
    before = _weights(model)
    state = {n: w + 0.01 for n, w in before.items()}
    scores = meta.test_time_optimise(
        model, state, faces[0], steps=(0, 4, 16), learning_rate=1e-3, with_lpips=False
    )
    assert list(scores) == [0, 4, 16]
    assert scores[0]["psnr"] < scores[4]["psnr"] < scores[16]["psnr"]
    assert scores[16]["ssim"] > scores[0]["ssim"] and scores[16]["lpips"] is None
    first = meta.test_time_optimise(
        model, state, faces[0], steps=(0,), learning_rate=1e-3, with_lpips=False
    )
    assert first[0] == scores[0]  # step 0 scores the given state itself
    _assert_dicts_close(_weights(model), before, rtol=0, atol=0)  # the model is untouched


def test_privacy_metrics_score_the_uploaded_weights_on_the_private_signal() -> None:
    torch.manual_seed(3)
    model = Siren(SirenConfig(in_features=3, out_features=3, width=16, depth=2))
    frames = np.random.default_rng(3).random((2, 8, 8, 3))
    task = CoordinateTask(VideoTask.from_frames("clip", frames), chunk=50)
    state = _weights(model)
    metrics = privacy_metrics(model, state, task, with_lpips=False)
    with torch.no_grad():
        prediction = model(task.coords).clamp(0.0, 1.0)
    mse = float((prediction - task.pixels).pow(2).mean())
    assert metrics["psnr_p"] == pytest.approx(10 * math.log10(1 / mse), rel=1e-5)
    assert task.query_images(task.render_query(model, state)).shape == (2, 8, 8, 3)
    assert -1.0 <= metrics["ssim_p"] <= 1.0 and metrics["lpips_p"] is None


def _tiny_scene(views: int = 3, resolution: int = 8) -> Scene:
    cameras = orbit_cameras(np.random.default_rng(0), views, resolution, 3.0, (-20.0, 60.0))
    images = torch.rand(
        views, resolution, resolution, 3, generator=torch.Generator().manual_seed(0)
    )
    return Scene(
        images=images,
        masks=torch.ones(views, resolution, resolution),
        cameras=cameras,
        image_paths=tuple(Path(f"r_{view}.png") for view in range(views)),
        background=(1.0, 1.0, 1.0),
        aabb=torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]),
        near=1.8,
        far=4.2,
    )


def test_ray_task_is_differentiable_and_maml_runs_second_order_on_a_tiny_nerf() -> None:
    scene = _tiny_scene()
    task = RayTask(scene.subset([0, 1]), scene.subset([2]), num_samples=8, perturb=False)
    assert isinstance(task, MetaTask) and task.num_examples == 3 * 64
    torch.manual_seed(0)
    field = NeRFField(
        NeRFFieldConfig(
            depth=2, width=16, skips=(), position_frequencies=2, direction_frequencies=1
        )
    )
    with torch.no_grad():
        field.density_out.bias.fill_(1.0)  # matter in the box, so every ray sees the field
    params = dict(field.named_parameters())
    loss = task.loss(field, params, task.support_batch(12, torch.Generator().manual_seed(0)))
    grads = torch.autograd.grad(loss, list(params.values()))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    config = MetaConfig(
        learner="maml",
        outer_steps=2,
        inner_steps=1,
        inner_lr=0.1,
        outer_lr=1e-3,
        outer_optimizer="adamw",
        support_batch=12,
        query_batch=12,
    )
    start = _weights(field)
    maml = local_meta_update(copy.deepcopy(field), [task], config)
    fomaml = local_meta_update(copy.deepcopy(field), [task], replace(config, learner="fomaml"))
    assert all(math.isfinite(loss) for loss in maml.outer_losses)
    assert any(not torch.equal(maml.state[n], start[n]) for n in start)
    difference = sum(
        float((maml.mean_outer_gradient[n] - fomaml.mean_outer_gradient[n]).abs().sum())
        for n in start
    )
    assert difference > 0  # second-order terms through the volume renderer
    rendered = task.render_query(field, maml.state)
    assert rendered.shape == task.query_targets.shape == (1, 8, 8, 3)
    assert privacy_metrics(field, maml.state, task, with_lpips=False)["psnr_p"] > 0


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"learner": "sgd"}, "learner"),
        ({"outer_optimizer": "adam"}, "outer_optimizer"),
        ({"outer_steps": 0}, "outer_steps"),
        ({"inner_steps": -1}, "inner_steps"),
        ({"inner_lr": 0.0}, "inner_lr"),
        ({"gamma": 1.5}, "gamma"),
        ({"learner": "maml", "gamma": 0.5}, "gamma"),
        ({"privacy_budget": -1.0}, "privacy_budget"),
        ({"memorising_bound": 0.0}, "memorising_bound"),
        ({"learner": "maml", "memorising_bound": 0.1}, "memorising_bound"),
        ({"num_clients": 2, "clients_per_round": 3}, "clients_per_round"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"support_batch": 0}, "support_batch"),
    ],
)
def test_meta_config_rejects_bad_values_naming_the_field(options: dict, field: str) -> None:
    base = dict(learner="fedmenf", outer_steps=1, inner_steps=1, inner_lr=0.1, outer_lr=0.1)
    with pytest.raises(ValueError, match=field):
        MetaConfig(**{**base, **options})


def test_rescaling_attacker_recovers_a_dimmed_memorised_upload() -> None:
    frames = np.random.default_rng(4).random((2, 8, 8, 3))
    task = CoordinateTask(VideoTask.from_frames("clip", frames), chunk=10_000)

    class Memorised(torch.nn.Module):
        """An upload that stores the private pixels dimmed to a tenth, plus an offset."""

        def __init__(self) -> None:
            super().__init__()
            self.values = torch.nn.Parameter(0.1 * task.pixels.clone() - 0.3)

        def forward(self, coords: torch.Tensor) -> torch.Tensor:
            return self.values[: len(coords)]

    model = Memorised()
    state = _weights(model)
    plain = privacy_metrics(model, state, task, with_lpips=False)["psnr_p"]
    rescaled = meta.rescaled_privacy_psnr(model, state, task)
    assert plain < 10  # clamping hides the content: mostly black
    assert rescaled["psnr_p_oracle"] > 60  # an exact affine map brings it all back
    assert rescaled["psnr_p_rescaled"] > plain + 10  # min-max alone recovers most of it
