"""A federated client's local round: personal fields, FedProx, Scaffold and DecentNeRF's G_k."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from paper_reference import scaffold_client_control_update
from torch import Tensor

from fedfields.data import load_scene
from fedfields.data.scene import Scene
from fedfields.fields import (
    GlobalPersonalField,
    HashGridConfig,
    HashGridField,
    HashGridFieldConfig,
    PersonalField,
    PersonalFieldConfig,
    build_field,
)
from fedfields.fields.personal import DENSITY_BOUND_IMAGES, INITIAL_DENSITY_SHIFT
from fedfields.geometry import Rays, image_rays
from fedfields.methods.fedprox import ProximalHook
from fedfields.methods.scaffold import CLIENT_CONTROL, ScaffoldHook
from fedfields.render import OccupancyGrid, RenderConfig, render_image, render_rays
from fedfields.render.renderer import RayOutputs
from fedfields.train import (
    LocalTrainConfig,
    federated_state,
    load_federated_state,
    local_train,
    loss_gradient,
)
from fedfields.train.nerfw import BETA_MIN

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
VIEWS = 4
RENDER = RenderConfig(num_samples=24)  # dense sampling: every ray gets the same samples


@pytest.fixture(scope="module")
def scene() -> Scene:
    """Four lego views at 25x25 on white."""
    return load_scene(LEGO, downscale=8).subset(list(range(0, 80, 80 // VIEWS)))


def make_global(seed: int = 0) -> HashGridField:
    torch.manual_seed(seed)
    encoding = HashGridConfig(
        num_levels=6, log2_hashmap_size=11, max_resolution=64, implementation="torch"
    )
    return HashGridField(
        HashGridFieldConfig(
            encoding=encoding, geometry_features=7, density_hidden=16, color_hidden=16
        )
    )


def make_personal(seed: int = 1, num_images: int = VIEWS) -> PersonalField:
    torch.manual_seed(seed)
    encoding = HashGridConfig(
        num_levels=4, log2_hashmap_size=10, max_resolution=32, implementation="torch"
    )
    return PersonalField(PersonalFieldConfig(num_images=num_images, encoding=encoding, hidden=16))


def small_config(**overrides: object) -> LocalTrainConfig:
    """A cheap round: 96 dense rays a step (24 samples each)."""
    return replace(LocalTrainConfig(steps=40, batch_rays=96, target_samples=96 * 24), **overrides)


def sample_inputs(num: int = 50, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    points = torch.rand(num, 3, generator=generator) * 2.4 - 1.2
    directions = torch.nn.functional.normalize(torch.randn(num, 3, generator=generator), dim=-1)
    image_index = torch.randint(0, VIEWS, (num,), generator=generator)
    return points, directions, image_index


def set_density_bias(field: HashGridField | PersonalField, bias: float) -> None:
    """Make the density exp(bias - 1) everywhere, whatever shift the field's density uses."""
    shift = INITIAL_DENSITY_SHIFT - 1.0 if isinstance(field, PersonalField) else 0.0
    with torch.no_grad():
        last = field.density_head[-1]
        last.weight[0].zero_()
        last.bias[0] = bias + shift


def all_pixel_rays(scene: Scene) -> tuple[Rays, Tensor, Tensor]:
    """Every pixel's ray, colour and image index, view by view."""
    rays = [image_rays(scene.cameras, view) for view in range(len(scene))]
    origins = torch.cat([r.origins for r in rays])
    directions = torch.cat([r.directions for r in rays])
    image_index = torch.arange(len(scene)).repeat_interleave(
        scene.cameras.height * scene.cameras.width
    )
    return Rays(origins, directions), scene.images.reshape(-1, 3), image_index


def parameters_of(module: torch.nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ------------------------------------------------------------------ federated state


def test_federated_state_round_trips_and_holds_only_the_global_field() -> None:
    source, target = make_global(0), make_global(1)
    state = federated_state(source)
    assert list(state) == [name for name, _ in source.named_parameters()]
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
    load_federated_state(target, state)
    for name, parameter in target.named_parameters():
        assert torch.equal(parameter, state[name])
    state["encoding.table"] += 1.0  # a copy, not a view of the field
    assert not torch.equal(source.encoding.table, state["encoding.table"])
    composite = GlobalPersonalField(source, make_personal())
    assert federated_state(composite).keys() == federated_state(source).keys()
    with pytest.raises(ValueError, match="never federated"):
        federated_state(make_personal())


def test_load_federated_state_names_the_offending_keys() -> None:
    field = make_global()
    state = federated_state(field)
    missing = {k: v for k, v in state.items() if k != "encoding.table"}
    with pytest.raises(ValueError, match=re.escape("missing keys ['encoding.table']")):
        load_federated_state(field, missing)
    with pytest.raises(ValueError, match=re.escape("unexpected keys ['appearance.weight']")):
        load_federated_state(field, {**state, "appearance.weight": torch.zeros(4, 8)})
    wrong = {**state, "color_head.0.bias": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"'color_head.0.bias': shape \(3,\)"):
        load_federated_state(field, wrong)


# ------------------------------------------------------------------ fields


def test_composite_field_adds_densities_and_mixes_colours_by_density() -> None:
    shared, personal = make_global(), make_personal()
    set_density_bias(personal, 1.5)  # comparable densities, so the mix is not trivial
    with torch.no_grad():
        personal.appearance.weight.normal_()
    composite = GlobalPersonalField(shared, personal)
    points, directions, image_index = sample_inputs()
    with torch.no_grad():
        out = composite(points, directions, image_index)
        g, p = shared(points, directions), personal(points, directions, image_index)
    sg, sp = g.density.double().numpy(), p.density.double().numpy()
    expected = (sg[:, None] * g.rgb.double().numpy() + sp[:, None] * p.rgb.double().numpy()) / (
        sg + sp
    )[:, None]
    np.testing.assert_allclose(out.density.numpy(), sg + sp, rtol=1e-6)
    np.testing.assert_allclose(out.rgb.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.personal_density, p.density)
    torch.testing.assert_close(composite.density(points), out.density)
    assert shared(points, directions).personal_density is None


def test_composite_with_negligible_personal_density_is_the_global_field() -> None:
    shared, personal = make_global(), make_personal()
    set_density_bias(personal, -40.0)
    composite = GlobalPersonalField(shared, personal)
    points, directions, image_index = sample_inputs()
    out, g = composite(points, directions, image_index), shared(points, directions)
    torch.testing.assert_close(out.density, g.density, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.rgb, g.rgb, rtol=1e-5, atol=1e-6)


def test_personal_colour_follows_the_embedding_and_none_means_the_mean_embedding() -> None:
    personal = make_personal()
    with torch.no_grad():
        personal.appearance.weight.normal_(std=3.0)
    points, directions, _ = sample_inputs()
    colours = [personal(points, directions, torch.full((50,), i)).rgb for i in range(VIEWS)]
    assert (colours[0] - colours[1]).abs().max() > 0.02
    without_index = personal(points, directions).rgb
    with torch.no_grad():  # every image gets the mean embeddings, which are far from zero
        personal.appearance.weight[:] = personal.appearance.weight.mean(0)
        personal.transient.weight[:] = personal.transient.weight.mean(0)
    assert personal.appearance.weight[0].abs().max() > 0.5
    by_mean = personal(points, directions, torch.zeros(50, dtype=torch.long)).rgb
    torch.testing.assert_close(without_index, by_mean)


def test_personal_density_follows_the_transient_embedding_and_its_bound_is_the_maximum() -> None:
    personal = make_personal()
    with torch.no_grad():
        personal.transient.weight.normal_(std=3.0)
    points, directions, _ = sample_inputs()
    per_image = torch.stack(
        [personal(points, directions, torch.full((50,), i)).density for i in range(VIEWS)]
    )
    assert float((per_image[0] - per_image[1]).abs().max()) > 1e-3 * float(per_image.max())
    torch.testing.assert_close(personal.density(points), per_image.amax(0))
    uncertainty = personal(points, directions, torch.zeros(50, dtype=torch.long)).uncertainty
    assert uncertainty is not None and bool((uncertainty >= 0).all())


def test_personal_density_over_many_images_bounds_a_random_subset_each_call() -> None:
    images = 3 * DENSITY_BOUND_IMAGES
    personal = make_personal(num_images=images)
    with torch.no_grad():
        personal.transient.weight.normal_(std=3.0)
    points, directions, _ = sample_inputs()
    per_image = torch.stack(
        [personal(points, directions, torch.full((50,), i)).density for i in range(images)]
    )
    calls = torch.stack([personal.density(points) for _ in range(40)])
    # each call is the maximum over some images: never above the full maximum, never below
    # the smallest image, and across calls the full maximum is reached
    assert bool((calls <= per_image.amax(0) + 1e-6).all())
    assert bool((calls >= per_image.amin(0) - 1e-6).all())
    assert bool((calls[0] < per_image.amax(0) - 1e-6).any())
    torch.testing.assert_close(calls.amax(0), per_image.amax(0))


@pytest.mark.parametrize("kind", ["personal", "global_personal"])
def test_personal_fields_rebuild_from_their_config(kind: str) -> None:
    personal = make_personal()
    field = personal if kind == "personal" else GlobalPersonalField(make_global(), personal)
    rebuilt = build_field(field.config_dict())
    assert type(rebuilt) is type(field)
    rebuilt.load_state_dict(field.state_dict())
    points, directions, image_index = sample_inputs()
    torch.testing.assert_close(
        rebuilt(points, directions, image_index).rgb, field(points, directions, image_index).rgb
    )


# ------------------------------------------------------------------ renderer


@pytest.mark.parametrize("marching", [False, True])
def test_render_rays_colours_each_ray_with_its_own_image(scene: Scene, marching: bool) -> None:
    shared, personal = make_global(), make_personal()
    set_density_bias(shared, -40.0)  # the personal field alone is visible
    set_density_bias(personal, 3.0)
    with torch.no_grad():
        personal.appearance.weight.normal_(std=3.0)
    composite = GlobalPersonalField(shared, personal)
    occupancy = OccupancyGrid(scene.aabb, resolution=8) if marching else None
    config = replace(RENDER, step_size=0.1)
    rays = image_rays(scene.cameras, 0)[torch.arange(0, 625, 25)]  # 25 rays

    def render(image_index: Tensor | None) -> RayOutputs:
        with torch.no_grad():
            return render_rays(composite, rays, config, occupancy, image_index=image_index)[0]

    per_image = [render(torch.full((25,), i)) for i in range(VIEWS)]
    assert (per_image[0].rgb - per_image[1].rgb).abs().max() > 0.05
    mixed = torch.arange(25) % VIEWS
    expected = torch.stack([per_image[i].rgb[r] for r, i in enumerate(mixed.tolist())])
    rendered, num_samples = render_rays(composite, rays, config, occupancy, image_index=mixed)
    torch.testing.assert_close(rendered.rgb, expected)
    assert rendered.personal_density.shape == (num_samples,) and num_samples > 0
    # No index: the mean embeddings, as a field call without one.
    with torch.no_grad():
        personal.appearance.weight[:] = personal.appearance.weight.mean(0)
        personal.transient.weight[:] = personal.transient.weight.mean(0)
    torch.testing.assert_close(render(None).rgb, render(mixed).rgb)


def test_render_rays_without_index_is_unchanged_for_plain_fields(scene: Scene) -> None:
    """A global-only render equals the composite with no personal density, index or not."""
    shared, personal = make_global(), make_personal()
    set_density_bias(personal, -40.0)
    rays = image_rays(scene.cameras, 1)[torch.arange(0, 625, 7)]
    with torch.no_grad():
        plain, count = render_rays(shared, rays, RENDER)
        composite, composite_count = render_rays(
            GlobalPersonalField(shared, personal), rays, RENDER, image_index=torch.zeros(90).long()
        )
    assert plain.personal_density is None and count == composite_count == 90 * 24
    torch.testing.assert_close(composite.rgb, plain.rgb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(composite.opacity, plain.opacity, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ local training


def composite_mse(field, scene: Scene, personal: PersonalField | None = None) -> float:
    """MSE of every pixel on the white background, each ray with its own image."""
    rays, colours, image_index = all_pixel_rays(scene)
    if personal is not None:
        field = GlobalPersonalField(field, personal)
    with torch.no_grad():
        rendered, _ = render_rays(
            field, rays, RENDER, image_index=image_index if personal is not None else None
        )
    return float(torch.nn.functional.mse_loss(rendered.rgb, colours))


def test_local_train_reduces_the_loss(scene: Scene) -> None:
    field = make_global()
    before = composite_mse(field, scene)
    result = local_train(field, scene, small_config(steps=60), RENDER, None)
    after = composite_mse(field, scene)
    assert after < 0.5 * before
    assert result.steps == 60 and result.rays == 60 * 96 and result.samples == 60 * 96 * 24
    assert result.num_examples == VIEWS * 25 * 25
    assert result.psnr == pytest.approx(-10 * np.log10(result.loss))
    assert result.hook_results == []


def test_an_epoch_budget_ends_the_round_after_one_pass_over_the_pixels(scene: Scene) -> None:
    """epochs=1 stops at the first step whose rays reach the scene's pixel count (2,500 here);
    `steps` stays a cap."""
    result = local_train(make_global(), scene, small_config(steps=500, epochs=1.0), RENDER, None)
    pixels = VIEWS * 25 * 25
    assert result.steps == -(-pixels // 96) and pixels <= result.rays < pixels + 96
    capped = local_train(make_global(), scene, small_config(steps=5, epochs=1.0), RENDER, None)
    assert capped.steps == 5
    with pytest.raises(ValueError, match="epochs must be finite and >= 0"):
        small_config(epochs=-1.0)


def test_local_train_with_a_personal_field_trains_it_but_federates_the_global_field(
    scene: Scene,
) -> None:
    shared, personal = make_global(), make_personal()
    before_mse = composite_mse(shared, scene, personal)
    shared_before, personal_before = parameters_of(shared), parameters_of(personal)
    local_train(shared, scene, small_config(steps=50), RENDER, None, personal_field=personal)
    # NeRF-W's loss first raises beta where errors are large, so the MSE falls slower than
    # under a plain MSE loss (0.6x there).
    assert composite_mse(shared, scene, personal) < 0.8 * before_mse
    for before, module in ((shared_before, shared), (personal_before, personal)):
        for name, parameter in module.named_parameters():
            assert not torch.equal(parameter, before[name]), f"{name} did not train"
    federated = federated_state(GlobalPersonalField(shared, personal))
    assert federated.keys() == shared_before.keys()  # names relative to the global field
    for name, parameter in shared.named_parameters():
        assert torch.equal(federated[name], parameter)


def test_sparsity_weight_keeps_the_personal_field_sparse(scene: Scene) -> None:
    """NeRF-W's L1 term on transient density: a large weight halves what the personal field
    alone renders, the global field still renders the scene."""
    rays, _, image_index = all_pixel_rays(scene)
    opacity = {}
    for weight in (0.0, 100.0):
        shared, personal = make_global(), make_personal()
        config = small_config(steps=40, personal_density_weight=weight)
        local_train(shared, scene, config, RENDER, None, personal_field=personal)
        with torch.no_grad():
            alone, _ = render_rays(personal, rays, RENDER, image_index=image_index)
            shared_alone, _ = render_rays(shared, rays, RENDER)
        opacity[weight] = float(alone.opacity.mean()), float(shared_alone.opacity.mean())
    assert opacity[100.0][0] < 0.5 * opacity[0.0][0]
    assert opacity[100.0][1] > 0.5 * opacity[0.0][1]


def test_occupancy_follows_the_composite_density(scene: Scene) -> None:
    """With an empty global field, only the personal density can fill the grid."""
    frozen = small_config(steps=1, learning_rate=0.0, personal_learning_rate=0.0)
    config = replace(RENDER, step_size=0.1)
    grids = {}
    for with_personal in (False, True):
        shared, personal = make_global(), make_personal()
        set_density_bias(shared, -40.0)
        set_density_bias(personal, 3.0)
        grid = OccupancyGrid(scene.aabb, resolution=8)
        local_train(
            shared, scene, frozen, config, grid, personal_field=personal if with_personal else None
        )
        grids[with_personal] = grid.occupied
    assert not grids[False].any() and grids[True].all()


def test_large_proximal_mu_keeps_the_global_field_near_the_reference(scene: Scene) -> None:
    distances = {}
    for mu in (0.0, 1e4):
        field = make_global()
        start = federated_state(field)
        local_train(field, scene, small_config(steps=30), RENDER, None, hooks=[ProximalHook(mu)])
        end = federated_state(field)
        distances[mu] = sum(float((end[k] - start[k]).square().sum()) for k in start) ** 0.5
    assert distances[1e4] < 0.2 * distances[0.0]


def test_proximal_reference_defaults_to_the_starting_weights(scene: Scene) -> None:
    first, second = make_global(), make_global()
    reference = federated_state(second)
    config = small_config(steps=5)
    local_train(first, scene, config, RENDER, None, hooks=[ProximalHook(10.0)])
    local_train(second, scene, config, RENDER, None, hooks=[ProximalHook(10.0, reference)])
    for name, parameter in first.named_parameters():
        assert torch.equal(parameter, dict(second.named_parameters())[name])


def random_state(field: HashGridField, seed: int, scale: float) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: scale * torch.randn(p.shape, generator=generator)
        for name, p in field.named_parameters()
    }


def test_scaffold_with_equal_controls_is_plain_training(scene: Scene) -> None:
    plain, corrected = make_global(), make_global()
    control = random_state(plain, seed=5, scale=0.3)
    config = small_config(steps=15)
    local_train(plain, scene, config, RENDER, None)
    scaffold = ScaffoldHook(control, {k: v.clone() for k, v in control.items()})
    result = local_train(corrected, scene, config, RENDER, None, hooks=[scaffold])
    for name, parameter in plain.named_parameters():
        assert torch.equal(parameter, dict(corrected.named_parameters())[name]), name
    assert CLIENT_CONTROL in result.hook_results[0].kept


def test_scaffold_control_is_option_two_on_the_local_gradients(scene: Scene) -> None:
    """c_i+ is the mean raw local gradient: option II's value under SGD with those gradients.

    Under Adam, option II applied to the real displacement gives controls far larger than
    any gradient, which is why local_train does not use the displacement.
    """
    field = make_global()
    server, client = random_state(field, 7, 1e-3), random_state(field, 8, 1e-3)
    start = federated_state(field)
    raw: dict[str, list[Tensor]] = {name: [] for name in start}
    for name, parameter in field.named_parameters():
        parameter.register_hook(lambda grad, name=name: raw[name].append(grad.detach().clone()))
    steps, lr = 12, 1e-2
    config = small_config(steps=steps, learning_rate=lr)
    result = local_train(field, scene, config, RENDER, None, hooks=[ScaffoldHook(server, client)])
    client_control = result.hook_results[0].kept[CLIENT_CONTROL]
    # y under SGD with the corrected gradients, then option II's closed form.
    sgd_end = {k: start[k] - lr * sum(g - client[k] + server[k] for g in raw[k]) for k in start}
    expected, expected_delta = scaffold_client_control_update(
        client, server, start, sgd_end, steps, lr
    )
    for name in start:
        assert len(raw[name]) == steps
        torch.testing.assert_close(
            client_control[name], torch.stack(raw[name]).mean(0), rtol=1e-5, atol=1e-8
        )
        torch.testing.assert_close(client_control[name], expected[name], rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(
            client_control[name] - client[name], expected_delta[name], rtol=1e-3, atol=1e-6
        )
    adam_control, _ = scaffold_client_control_update(
        client, server, start, federated_state(field), steps, lr
    )
    table = "encoding.table"
    assert adam_control[table].norm() > 1000 * client_control[table].norm()


# ------------------------------------------------------------------ DecentNeRF's G_k


def test_loss_gradient_is_the_gradient_of_the_scene_loss(scene: Scene) -> None:
    """With all pixels drawn, G_k matches autograd of the full-scene NeRF-W loss by hand, and
    a central finite difference of the global-only MSE along G_k."""
    shared, personal = make_global(), make_personal()
    with torch.no_grad():
        personal.appearance.weight.normal_()
    local_train(shared, scene, small_config(steps=20), RENDER, None, personal_field=personal)
    before = parameters_of(shared), parameters_of(personal)
    num_pixels = VIEWS * 25 * 25
    gradient = loss_gradient(shared, scene, RENDER, None, personal, num_rays=num_pixels)
    for module, state in zip((shared, personal), before, strict=True):
        for name, parameter in module.named_parameters():
            assert torch.equal(parameter, state[name]) and parameter.grad is None
    assert gradient.keys() == federated_state(shared).keys()

    rays, colours, image_index = all_pixel_rays(scene)
    rendered, _ = render_rays(
        GlobalPersonalField(shared, personal), rays, RENDER, image_index=image_index
    )
    beta = BETA_MIN + rendered.uncertainty
    loss = ((rendered.rgb - colours).square().sum(-1) / (2 * beta.square()) + beta.log()).mean()
    by_hand = torch.autograd.grad(loss, list(shared.parameters()))
    for (name, _), expected in zip(shared.named_parameters(), by_hand, strict=True):
        torch.testing.assert_close(gradient[name], expected, rtol=1e-3, atol=1e-7)

    # Central difference along G of the global-only loss (no personal field).
    shared_only = loss_gradient(shared, scene, RENDER, None, num_rays=num_pixels)
    norm = sum(float(g.square().sum()) for g in shared_only.values()) ** 0.5
    epsilon = 1e-3

    def scene_mse(sign: float) -> float:
        shifted = copy.deepcopy(shared)
        with torch.no_grad():
            for name, parameter in shifted.named_parameters():
                parameter += sign * epsilon * shared_only[name] / norm
        views = [render_image(shifted, scene.cameras, v, RENDER).rgb for v in range(VIEWS)]
        return float(
            torch.nn.functional.mse_loss(torch.stack(views).double(), scene.images.double())
        )

    directional = (scene_mse(1.0) - scene_mse(-1.0)) / (2 * epsilon)
    assert directional == pytest.approx(norm, rel=1e-3)


def test_loss_gradient_draws_a_fixed_pixel_subset_per_seed(scene: Scene) -> None:
    field = make_global()
    first = loss_gradient(field, scene, RENDER, None, num_rays=200, seed=3)
    again = loss_gradient(field, scene, RENDER, None, num_rays=200, seed=3)
    other = loss_gradient(field, scene, RENDER, None, num_rays=200, seed=4)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["encoding.table"], other["encoding.table"])


# ------------------------------------------------------------------ errors


def test_non_finite_loss_raises_naming_the_step(scene: Scene) -> None:
    broken = replace(scene, images=torch.full_like(scene.images, float("nan")))
    with pytest.raises(FloatingPointError, match="at step 0"):
        local_train(make_global(), broken, small_config(), RENDER, None)


def test_local_train_rejects_mismatched_inputs(scene: Scene) -> None:
    with pytest.raises(ValueError, match="steps must be positive"):
        LocalTrainConfig(steps=0)
    with pytest.raises(ValueError, match="3 appearance embeddings but the scene has 4 images"):
        local_train(make_global(), scene, small_config(), RENDER, None, make_personal(num_images=3))
    field = make_global()
    control = federated_state(field)
    with pytest.raises(ValueError, match=re.escape("scaffold client control: missing keys")):
        local_train(
            field,
            scene,
            small_config(),
            RENDER,
            None,
            hooks=[ScaffoldHook(control, {"x": torch.zeros(1)})],
        )
