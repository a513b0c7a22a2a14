"""Surrogate Model Attack on SplitNeRF: the loss's oracle, the ratio rule, the offline attack
with and without S2NeRF noise on a tiny lego run, the online attack (one step per exchange at
the 10/t rate, fresh dummies), and the scene-aided pose search and fine-tuning."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfields.data import load_scene
from fedfields.data.scene import Scene
from fedfields.fields import HashGridConfig, HashGridField, HashGridFieldConfig
from fedfields.geometry import Rays
from fedfields.privacy.attacks import surrogate
from fedfields.privacy.attacks.inference import (
    AttackConfig,
    AttackResult,
    attack_folds,
    class_weights,
    membership_pairs,
    pair_similarity,
    pooled,
    shadow_membership_pairs,
    similarity_pairs,
    threshold_attack,
    train_attack,
)
from fedfields.privacy.attacks.scene_aided import (
    SceneAidedConfig,
    pose_error,
    scene_aided_attack,
    search_pose,
    sphere_poses,
)
from fedfields.privacy.attacks.surrogate import (
    SurrogateAttackConfig,
    balanced_loss,
    make_surrogate_head,
    online_surrogate_attack,
    paper_online_config,
    render_depth_and_grey,
    score_attack,
    surrogate_losses,
    surrogate_model_attack,
)
from fedfields.privacy.defences import S2NeRFNoise
from fedfields.privacy.split import (
    ClientPart,
    ServerPart,
    SplitExchange,
    SplitTrainConfig,
    client_step,
    sample_rays,
    server_forward,
    split_field,
    train_split,
)
from fedfields.render import RenderConfig

LEGO = Path(__file__).resolve().parents[1] / "data" / "lego"
GRID = HashGridConfig(
    num_levels=8, log2_hashmap_size=12, base_resolution=4, max_resolution=64, implementation="torch"
)
SCORED_VIEWS = [0, 20, 40, 60]
ATTACK = SurrogateAttackConfig(color_hidden=32)
ONLINE = SurrogateAttackConfig(color_hidden=32, learning_rate=3e-3)
STEPS = (0, 4, 9, 14, 29)  # t = 1, 5, 10, 15, 30: the 10/t factor is 1, 1, 1, 2/3, 1/3
needs_lego = pytest.mark.skipif(not LEGO.is_dir(), reason="bundled lego scene not present")
pytestmark = pytest.mark.filterwarnings("ignore:LPIPS unavailable")


def _field(aabb: tuple[float, ...], seed: int = 0) -> HashGridField:
    """A small hash-grid field with the paper's cut (64-wide first density layer)."""
    torch.manual_seed(seed)
    return HashGridField(HashGridFieldConfig(encoding=GRID, aabb=aabb, color_hidden=32))


# ------------------------------------------------------------------ the loss


def test_gradient_matching_loss_is_zero_for_the_true_head_and_targets() -> None:
    field = _field((-1.5, -1.5, -1.5, 1.5, 1.5, 1.5))
    with torch.no_grad():
        field.encoding.table.uniform_(-1.0, 1.0)
    server, client = split_field(field)
    generator = torch.Generator().manual_seed(0)
    origins = torch.nn.functional.normalize(torch.randn(32, 3, generator=generator), dim=-1) * 4
    jitter = 0.3 * torch.randn(32, 3, generator=generator)
    directions = torch.nn.functional.normalize(jitter - origins, dim=-1)
    samples = sample_rays(Rays(origins, directions), RenderConfig(num_samples=16), perturb=True)
    embeddings = server_forward(server, samples.points())
    targets, background = torch.rand(32, 3, generator=generator), torch.ones(3)
    reply = client_step(client, embeddings, samples, targets, background)
    exchange = SplitExchange(0, samples, embeddings, reply.embedding_gradient)
    scale = reply.embedding_gradient.norm().item()
    assert scale > 0

    for distance, tolerance in (("l2", 1e-5 * scale), ("cosine", 1e-5)):
        gradient_loss, dummy_loss = surrogate_losses(
            client, exchange, targets, background, distance
        )
        assert gradient_loss.item() < tolerance, distance
        assert dummy_loss.item() == pytest.approx(reply.loss, rel=1e-6)
    surrogate = make_surrogate_head(server.embedding_dim, ATTACK)
    for head, dummy in ((client, targets.flip(0)), (surrogate, targets)):
        gradient_loss, _ = surrogate_losses(head, exchange, dummy, background)
        assert gradient_loss.item() > 0.1 * scale


@pytest.mark.parametrize("ratio", [0.0, 0.01, 1.0, 100.0])
def test_ratio_rule_holds_lambda_l_g_over_l_dummy_at_the_ratio(ratio: float) -> None:
    for gradient_value, dummy_value in [(3e-4, 0.2), (5.0, 1e-3), (1.0, 1.0)]:
        gradient_loss = torch.tensor(gradient_value, requires_grad=True)
        dummy_loss = torch.tensor(dummy_value, requires_grad=True)
        loss, lam = balanced_loss(gradient_loss, dummy_loss, ratio)
        assert lam * gradient_value / dummy_value == pytest.approx(ratio, rel=1e-6)
        assert loss.item() == pytest.approx((1.0 + ratio) * dummy_value, rel=1e-6)
        loss.backward()  # lambda is a constant of the step: d/dL_g = lambda, d/dL_dummy = 1
        assert gradient_loss.grad.item() == pytest.approx(lam, rel=1e-6)
        assert dummy_loss.grad.item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"epochs": 0}, "epochs"),
        ({"ratio": -1.0}, "ratio"),
        ({"ratio": math.inf}, "ratio"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"distance": "l1"}, "distance"),
        ({"head_init": "zeros"}, "head_init"),
    ],
)
def test_bad_attack_settings_raise_naming_them(options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name} must"):
        SurrogateAttackConfig(**options)


# ------------------------------------------------------------------ the attack on lego


@dataclass
class SplitRun:
    """A trained split run: the scene, the field's two parts and the server's transcript."""

    scene: Scene
    render_config: RenderConfig
    server: ServerPart
    client: ClientPart
    transcript: list[SplitExchange]


def _split_run(defended: bool, steps: int = 200, record_every: int = 20) -> SplitRun:
    """Split steps of 128 rays on lego 25x25 (200, every 20th exchange recorded)."""
    scene = load_scene(LEGO, downscale=8)
    aabb = tuple(scene.aabb.reshape(-1).tolist())
    render_config = RenderConfig(near=scene.near, far=scene.far, aabb=aabb, num_samples=16)
    field = _field(aabb)
    config = SplitTrainConfig(
        steps=steps,
        batch_rays=128,
        random_background=False,
        record_every=record_every,
        device="cpu",
    )
    defence = S2NeRFNoise(c=2.4, r=1.0, total_steps=config.steps) if defended else None
    result = train_split(field, scene, config, render_config, defence)
    server, client = split_field(field)
    return SplitRun(scene, render_config, server, client, result.transcript)


@pytest.fixture(scope="module")
def undefended() -> SplitRun:
    return _split_run(defended=False)


@pytest.fixture(scope="module")
def defended() -> SplitRun:
    return _split_run(defended=True)


@pytest.fixture(scope="module")
def undefended_attack(undefended: SplitRun) -> ClientPart:
    return surrogate_model_attack(
        undefended.server, undefended.transcript, torch.ones(3), ATTACK
    ).head


def _candidate_poses(run: SplitRun) -> torch.Tensor:
    """15-degree azimuth x 4 elevation grid at the radius of the ray origins the server saw."""
    origins = torch.cat([exchange.samples.origins for exchange in run.transcript])
    radius = origins.norm(dim=-1).mean().item()
    return sphere_poses(radius, range(-180, 180, 15), [15.0, 35.0, 55.0, 75.0])


def _ssim_depth_gain(run: SplitRun, surrogate: ClientPart) -> float:
    """SSIM-depth of the attacked surrogate minus that of an untrained one (same server)."""
    torch.manual_seed(0)
    untrained = make_surrogate_head(run.server.embedding_dim, ATTACK)
    scores = [
        score_attack(
            run.server, head, run.client, run.scene.cameras, SCORED_VIEWS, run.render_config
        )
        for head in (surrogate, untrained)
    ]
    return scores[0]["ssim_depth"] - scores[1]["ssim_depth"]


@needs_lego
def test_attack_recovers_the_depth_of_an_undefended_run(
    undefended: SplitRun, undefended_attack: ClientPart
) -> None:
    # attacked 0.98-0.997 against untrained 0.07-0.28 (seeds 0-3)
    assert _ssim_depth_gain(undefended, undefended_attack) > 0.4
    scores = score_attack(
        undefended.server,
        undefended_attack,
        undefended.client,
        undefended.scene.cameras,
        SCORED_VIEWS,
        undefended.render_config,
    )
    assert set(scores) == {"ssim_depth", "ssim_grey", "lpips_depth", "lpips_grey", "psnr"}
    depth, grey = render_depth_and_grey(
        undefended.server, undefended_attack, undefended.scene.cameras, 0, undefended.render_config
    )
    assert depth.shape == grey.shape == (25, 25)
    assert 0.0 <= depth.min() and depth.max() <= 1.0 and 0.0 <= grey.min() and grey.max() <= 1.0


@needs_lego
def test_strong_s2nerf_noise_stops_the_attack(defended: SplitRun) -> None:
    result = surrogate_model_attack(defended.server, defended.transcript, torch.ones(3), ATTACK)
    # attacked minus untrained -0.11 to -0.23 (seeds 0-3): no better than no attack at all
    assert _ssim_depth_gain(defended, result.head) < 0.05
    assert result.history[-1]["relative_gradient_loss"] > 0.9  # the noise cannot be matched


# ------------------------------------------------------------------ the online attack


@pytest.fixture(scope="module")
def exchanges() -> tuple[ServerPart, list[SplitExchange]]:
    """A random field's server part and one real exchange of 16 rays per step in STEPS."""
    field = _field((-1.5, -1.5, -1.5, 1.5, 1.5, 1.5))
    with torch.no_grad():
        field.encoding.table.uniform_(-1.0, 1.0)
    server, client = split_field(field)
    generator = torch.Generator().manual_seed(0)
    transcript = []
    for step in STEPS:
        origins = torch.nn.functional.normalize(torch.randn(16, 3, generator=generator), dim=-1)
        directions = torch.nn.functional.normalize(-origins, dim=-1)
        rays = Rays(4 * origins, directions)
        samples = sample_rays(rays, RenderConfig(num_samples=8), perturb=True)
        embeddings = server_forward(server, samples.points())
        targets = torch.rand(16, 3, generator=generator)
        reply = client_step(client, embeddings, samples, targets, torch.ones(3))
        transcript.append(SplitExchange(step, samples, embeddings, reply.embedding_gradient))
    return server, transcript


def test_one_adam_step_per_exchange_in_step_order_at_the_10_over_t_rate(
    exchanges: tuple[ServerPart, list[SplitExchange]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, transcript = exchanges
    shuffled = list(transcript)
    random.Random(1).shuffle(shuffled)
    assert [e.step for e in shuffled] != list(STEPS)
    used_rates = []
    adam_step = torch.optim.Adam.step

    def counting_step(self: torch.optim.Adam, *args: object, **kwargs: object) -> object:
        used_rates.append([group["lr"] for group in self.param_groups])
        return adam_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", counting_step)
    result = online_surrogate_attack(server, shuffled, torch.ones(3), ONLINE)

    expected = [ONLINE.learning_rate * min(1.0, 10.0 / (step + 1)) for step in STEPS]
    assert len(used_rates) == len(STEPS)  # one optimiser step per exchange
    assert used_rates == [[pytest.approx(lr)] for lr in expected]
    assert [record["step"] for record in result.history] == list(STEPS)
    assert [record["t"] for record in result.history] == [step + 1 for step in STEPS]
    assert [record["lr"] for record in result.history] == pytest.approx(expected)
    # visiting in training order: the transcript's order does not matter
    in_order = online_surrogate_attack(server, transcript, torch.ones(3), ONLINE)
    for mine, theirs in zip(result.head.parameters(), in_order.head.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("dummy_init", ["normal", "uniform"])
def test_every_exchange_gets_fresh_dummy_colours(
    exchanges: tuple[ServerPart, list[SplitExchange]],
    monkeypatch: pytest.MonkeyPatch,
    dummy_init: str,
) -> None:
    server, transcript = exchanges
    seen = []
    losses = surrogate.surrogate_losses

    def recording_losses(
        head: ClientPart, exchange: SplitExchange, dummy_colors: torch.Tensor, *args: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((exchange.step, dummy_colors.detach().clone()))
        return losses(head, exchange, dummy_colors, *args)

    monkeypatch.setattr(surrogate, "surrogate_losses", recording_losses)
    config = dataclasses.replace(ONLINE, dummy_init=dummy_init)
    online_surrogate_attack(server, transcript, torch.ones(3), config)

    assert [step for step, _ in seen] == list(STEPS)
    for (_, dummies), exchange in zip(seen, transcript, strict=True):
        assert dummies.shape == (len(exchange.samples), 3)
    for i, (_, first) in enumerate(seen):
        for _, second in seen[i + 1 :]:
            assert not torch.equal(first, second)
    every = torch.cat([dummies for _, dummies in seen])
    if dummy_init == "uniform":
        assert every.min() >= 0.0 and every.max() < 1.0
    else:  # N(0, 1): 240 draws
        assert every.min() < 0.0 and abs(every.mean()) < 0.2 and 0.8 < every.std() < 1.2


def test_paper_config_and_bad_transcripts(
    exchanges: tuple[ServerPart, list[SplitExchange]],
) -> None:
    config = paper_online_config(seed=3)
    assert (config.distance, config.ratio, config.dummy_init) == ("l2", 0.01, "normal")
    assert (config.decay_after, config.seed) == (10.0, 3)
    server, transcript = exchanges
    with pytest.raises(ValueError, match="empty"):
        online_surrogate_attack(server, [], torch.ones(3), config)
    with pytest.raises(ValueError, match="repeats"):
        online_surrogate_attack(server, transcript + transcript[:1], torch.ones(3), config)


@needs_lego
def test_on_a_tiny_lego_run_the_paper_attacker_empties_its_scene() -> None:
    """150 split steps of 128 rays on lego 25x25, every exchange seen by the online attacker.

    l2 at ratio 0.01: the head learns to render nothing, so its cut-layer gradient vanishes
    (||g - 0|| / ||g|| = 1) and its depth is no better than an untrained head's: SSIM-depth
    -0.02 to -0.06 against 0.15-0.30 (seeds 0-3). The same single pass with fedfields'
    offline settings (cosine, ratio 100, spectral init from the first exchange) is erratic:
    0.79, 0.00, 0.79, 0.05, so nothing is asserted of it.
    """
    run = _split_run(defended=False, steps=150, record_every=1)
    attack = dataclasses.replace(paper_online_config(), color_hidden=32)
    result = online_surrogate_attack(run.server, run.transcript, torch.ones(3), attack)

    assert len(result.history) == 150
    assert result.history[0]["relative_gradient_loss"] > 2.0
    assert all(abs(r["relative_gradient_loss"] - 1.0) < 0.01 for r in result.history[-10:])
    assert _ssim_depth_gain(run, result.head) < 0.05


# ------------------------------------------------------------------ scene-aided variant


def test_sphere_poses_look_at_the_centre_without_roll() -> None:
    poses = sphere_poses(4.0, azimuths=[0.0, 90.0], elevations=[30.0])
    assert poses.shape == (2, 4, 4)
    for pose in poses:
        assert torch.linalg.vector_norm(pose[:3, 3]).item() == pytest.approx(4.0)
        forward = -pose[:3, 2]
        torch.testing.assert_close(forward, -pose[:3, 3] / 4.0)
        assert pose[2, 0].abs() < 1e-6  # the camera's x axis stays horizontal
        torch.testing.assert_close(pose[:3, :3] @ pose[:3, :3].T, torch.eye(3))
    assert pose_error(poses[0], poses[0]) == pytest.approx((0.0, 0.0), abs=1e-3)
    distance, angle = pose_error(poses[0], poses[1])  # a quarter turn about the world's z
    assert angle == pytest.approx(90.0, abs=1e-3)
    assert distance == pytest.approx(4.0 * math.cos(math.radians(30.0)) * math.sqrt(2.0))


@needs_lego
def test_pose_search_with_the_true_head_finds_the_nearest_candidate(undefended: SplitRun) -> None:
    scene, view = undefended.scene, 20
    candidates = _candidate_poses(undefended)
    search = search_pose(
        undefended.server,
        undefended.client,
        scene.images[view],
        scene.cameras.subset([view]),
        candidates,
        undefended.render_config,
    )
    truth = scene.cameras.camera_to_world[view]
    nearest = min(pose_error(candidate, truth)[1] for candidate in candidates)  # 5.7 degrees
    assert pose_error(search.pose, truth)[1] <= nearest + 1.0
    assert search.scores.shape == (len(candidates),)
    assert search.scores[search.index] == search.scores.max()


@needs_lego
def test_scene_aided_attack_poses_the_leaked_image_and_fits_it(
    undefended: SplitRun, undefended_attack: ClientPart
) -> None:
    scene, view = undefended.scene, 5
    candidates = _candidate_poses(undefended)
    result = scene_aided_attack(
        undefended.server,
        undefended_attack,
        scene.images[view],
        scene.cameras.subset([view]),
        candidates,
        undefended.render_config,
        SceneAidedConfig(steps=60),
    )
    truth = scene.cameras.camera_to_world[view]
    assert pose_error(result.search.pose, truth)[1] < 15.0  # nearest candidate 8.7; 12.9 once
    assert result.losses[-1] < 0.5 * result.losses[0]  # 0.05-0.07 -> 0.01 (seeds 0-3)
    scores = score_attack(
        undefended.server,
        result.head,
        undefended.client,
        scene.cameras,
        SCORED_VIEWS,
        undefended.render_config,
    )
    assert scores["ssim_depth"] > 0.9 and scores["psnr"] > 17.0  # 0.97-0.995, 19.7-22.3 dB


# ------------------------------------------------------------------ FedMeNF App. C attacks


def _blobs(count: int, seed: int) -> list[torch.Tensor]:
    """Distinct smooth 12x12 colour images (random low-frequency patterns)."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, 3, 3, generator=gen)
    images = torch.nn.functional.interpolate(coarse, size=(12, 12), mode="bilinear")
    return list(images.permute(0, 2, 3, 1))


@pytest.mark.parametrize("memorised", [True, False])
def test_membership_attack_finds_memorised_uploads_and_only_those(memorised: bool) -> None:
    gen = torch.Generator().manual_seed(5)

    def renders(images: list[torch.Tensor]) -> tuple[list, list]:
        """A memorising upload renders its image (plus noise); a private one, noise."""
        own = [
            (image if memorised else torch.rand(image.shape, generator=gen))
            + 0.05 * torch.randn(image.shape, generator=gen)
            for image in images
        ]
        other = [own[(i + 1) % len(own)] for i in range(len(own))]
        return own, other

    shadow, target = _blobs(60, 1), _blobs(20, 2)
    train = membership_pairs(shadow, *renders(shadow))
    test = membership_pairs(target, *renders(target))
    result = train_attack(*train, *test, AttackConfig(epochs=150))
    assert result.chance == 0.5 and result.auc is not None
    if memorised:
        assert result.accuracy >= 0.85 and result.auc >= 0.9
    else:
        assert 0.3 <= result.accuracy <= 0.7 and result.train_accuracy > result.accuracy


def test_shadow_pairs_pair_every_image_with_every_upload() -> None:
    images = [torch.full((2, 2, 1), float(i)) for i in range(3)]  # image i: value i
    owners = [0, 0, 1]  # images 0 and 1 from upload 0's client, image 2 from upload 1's
    renders = [[torch.full((2, 2, 1), 10.0 * u + i) for i in range(3)] for u in range(2)]
    inputs, labels = shadow_membership_pairs(images, owners, renders)
    assert inputs.shape == (6, 2, 2, 2) and labels.tolist() == [1, 1, 0, 0, 0, 1]
    pairs = {(int(x[0, 0, 0]), int(x[1, 0, 0])) for x in inputs}
    assert pairs == {(i, 10 * u + i) for i in range(3) for u in range(2)}
    with pytest.raises(ValueError, match="must index 2 >= 2 uploads"):
        shadow_membership_pairs(images, [0, 0, 2], renders)
    with pytest.raises(ValueError, match="renders per upload \\[3, 2\\]"):
        shadow_membership_pairs(images, owners, [renders[0], renders[1][:2]])


def test_class_weights_by_hand() -> None:
    weights = class_weights(torch.tensor([0, 0, 0, 1]), 3)
    torch.testing.assert_close(weights, torch.tensor([4 / 6, 4 / 2, 0.0]))  # n / (2 * count)
    torch.testing.assert_close(class_weights(torch.tensor([1, 0, 1, 0]), 2), torch.ones(2))


def test_attacker_trained_on_every_outsider_finds_memorising_uploads() -> None:
    """Shadow pairs with every other upload (1 member to 5 outsiders), classes balanced:
    the attacker still calls members on the balanced target pairs, as with one outsider."""
    gen = torch.Generator().manual_seed(7)
    shadow, target = _blobs(36, 3), _blobs(20, 4)
    noisy = [image + 0.05 * torch.randn(image.shape, generator=gen) for image in shadow]
    owners = [i % 6 for i in range(36)]  # six shadow uploads, each memorising its images
    renders = [
        [noisy[i] if owners[i] == u else shadow[(i + 1 + u) % 36] for i in range(36)]
        for u in range(6)
    ]
    train = shadow_membership_pairs(shadow, owners, renders)
    own = [image + 0.05 * torch.randn(image.shape, generator=gen) for image in target]
    test = membership_pairs(target, own, [own[(i + 1) % 20] for i in range(20)])
    result = train_attack(*train, *test, AttackConfig(epochs=150, balance_classes=True))
    assert result.accuracy >= 0.85 and result.auc is not None and result.auc >= 0.9


def test_property_attack_reads_a_property_that_renders_show() -> None:
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 3, (90,), generator=gen)
    tint = torch.eye(3)[labels]  # the property colours the render
    images = 0.5 * torch.rand(90, 12, 12, 3, generator=gen) + 0.5 * tint[:, None, None, :]
    inputs = images.permute(0, 3, 1, 2)
    result = train_attack(inputs[:60], labels[:60], inputs[60:], labels[60:], AttackConfig())
    assert result.auc is None and result.accuracy >= 0.9 > result.chance


def test_pair_similarity_against_numpy_and_blind_to_rescaling() -> None:
    gen = torch.Generator().manual_seed(11)
    image, render = torch.rand(2, 6, 7, 3, generator=gen)
    expected_mse = float(np.mean((image.numpy() - render.numpy()) ** 2))
    assert pair_similarity(image, render, "mse") == pytest.approx(-expected_mse)
    expected_r = np.corrcoef(image.numpy().ravel(), render.numpy().ravel())[0, 1]
    assert pair_similarity(image, render, "correlation") == pytest.approx(expected_r)
    rescaled = 0.2 * render - 3.0
    assert pair_similarity(image, rescaled, "correlation") == pytest.approx(expected_r)
    assert pair_similarity(image, torch.zeros_like(image), "correlation") == 0.0
    with pytest.raises(ValueError, match="similarity must be one of"):
        pair_similarity(image, render, "ssim")


def test_threshold_attack_by_hand() -> None:
    train = torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])
    test = torch.tensor([0.4, 0.6, 0.7, 0.3]), torch.tensor([1, 0, 1, 0])
    result = threshold_attack(*train, *test)
    # threshold 0.5: predictions 0, 1, 1, 0; AUC: 3 of the 4 (member, non-member) pairs ordered
    assert result.accuracy == 0.5 and result.train_accuracy == 1.0
    assert result.auc == pytest.approx(0.75) and result.chance == 0.5


def test_threshold_attack_learns_the_side_on_the_shadow_scores() -> None:
    """Members scoring lower (an upload pushed away from its own data) are found too."""
    train = torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])
    test = torch.tensor([0.3, 0.6, 0.7, 0.35]), torch.tensor([1, 0, 0, 1])
    result = threshold_attack(*train, *test)
    # member below 0.5: predictions 1, 0, 0, 1, all right; AUC of the negated scores
    assert result.accuracy == 1.0 and result.train_accuracy == 1.0 and result.auc == 1.0
    # a tie between the two sides keeps "at or above": 0.5 between 2 and 3 of the 4 shadows
    tied = threshold_attack(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 1, 0, 1]), *test)
    assert tied.train_accuracy == 0.75
    assert tied.accuracy == float(((test[0] >= 1.5) == test[1].bool()).float().mean())


def test_attack_folds_make_every_client_a_target_once() -> None:
    clients = [7, 3, 9, 1, 4, 8, 2]
    splits = attack_folds(clients, 3)
    assert [target for _, target in splits] == [[7, 3], [9, 1, 4], [8, 2]]
    for shadow, target in splits:
        assert sorted(shadow + target) == sorted(clients) and not set(shadow) & set(target)
    with pytest.raises(ValueError, match="folds"):
        attack_folds(clients, 1)


def test_pooled_accuracy_counts_every_target_once() -> None:
    results = [AttackResult(0.5, 0.6, 0.5, 1.0), AttackResult(1.0, None, 0.5, 0.8)]
    result = pooled(results, [4, 12])
    assert result.accuracy == pytest.approx((0.5 * 4 + 1.0 * 12) / 16)
    assert result.auc == pytest.approx(0.6) and result.chance == 0.5
    assert result.train_accuracy == pytest.approx(0.9)
    with pytest.raises(ValueError, match="2 results for 1 target sets"):
        pooled(results, [4])


def test_correlation_attack_sees_through_an_output_offset_that_clamping_hides() -> None:
    gen = torch.Generator().manual_seed(4)

    def triples(images: list[torch.Tensor]) -> tuple[list, list, list]:
        """Uploads that memorise their images behind a scale and an offset below 0."""
        own = [
            0.3 * image - 0.5 + 0.01 * torch.randn(image.shape, generator=gen) for image in images
        ]
        return images, own, [own[(i + 1) % len(own)] for i in range(len(own))]

    shadow, target = triples(_blobs(40, 1)), triples(_blobs(20, 2))
    raw = [similarity_pairs(*group, "correlation") for group in (shadow, target)]
    seen = threshold_attack(*raw[0], *raw[1])
    assert seen.accuracy >= 0.9 and seen.auc >= 0.95
    clamped = [
        (images, [r.clamp(0, 1) for r in own], [r.clamp(0, 1) for r in other])
        for images, own, other in (shadow, target)
    ]
    hidden = [similarity_pairs(*group, "mse") for group in clamped]
    blind = threshold_attack(*hidden[0], *hidden[1])
    assert blind.accuracy <= 0.6  # every clamped render is black: nothing to threshold
