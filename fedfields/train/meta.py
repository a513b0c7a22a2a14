"""Federated meta-learning of neural-field initialisations: MAML, FOMAML, Reptile, FedMeNF.

A client's LocalUpdate (FedMeNF, Algorithm 1): from the global meta-learner w_0 = theta, for
E outer steps pick a task T_i = {S_i, Q_i} (cycling over the client's tasks), set
phi_0 = w_i, take K inner SGD steps on support minibatches (Eq. 8)

    phi_{k+1} = phi_k - lambda_i grad L(phi_k, B_k),

then update w_i with an outer gradient on a query minibatch B_K:

- "maml": grad_w L(phi_K, B_K), second order (differentiated through the inner loop, Eq. 9
  with gamma = 0);
- "fomaml": grad_phi L(phi_K, B_K), the same with the inner loop's Jacobian dropped;
- "reptile": w_i - phi_K, so SGD with outer_lr eps moves w to w + eps (phi_K - w) (Nichol et
  al.'s interpolation step; eps = 1 jumps to phi_K);
- "fedmenf": grad_w [L(phi_K, B_K) - gamma L(w_i, B_K)] (the privacy-preserving loss L_pp,
  Eq. 10), second order like MAML: Proposition 3's g_pp ~ (1 - gamma) g_K - lambda_i I_K keeps
  the inner-product term I_K (Eq. 5), which is second order. gamma is fixed, or adaptive from a
  privacy budget zeta (Eq. 13-14). L_pp is unbounded below in w: the -gamma L(w) term keeps
  pushing w's own outputs away from the data (w drifts until one inner step barely recovers
  it); `memorising_bound` clamps L(w) at that MSE, so the push stops once w is that far away
  (our addition, off by default).

Every inner gradient and the outer gradient (plus the gradient of the method's client hooks'
loss terms) are clipped to `max_grad_norm` (FedMeNF Appendix D: 5; its code clips both
loops), the hooks' corrections are added (a control variate), and SGD or AdamW (torch
defaults, lr = lambda_o) steps. The server averages
the uploaded w weighted by |D| (Eq. 2).

Evaluation: `test_time_optimise` adapts from theta on a task's support set and scores its
query set; `privacy_metrics` is PSNR_p (Eq. 6), SSIM_p and LPIPS_p of the uploaded w itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from fedfields.config.schema import LEARNERS, OUTER_OPTIMIZERS
from fedfields.devices import resolve_device
from fedfields.methods.base import ClientHook, HookResult, on_device
from fedfields.metrics import lpips, psnr, ssim
from fedfields.train.meta_tasks import MetaTask

SECOND_ORDER = ("maml", "fedmenf")


@dataclass(frozen=True)
class MetaConfig:
    """One client's local meta-optimisation (FedMeNF Algorithm 1; defaults from Table 7)."""

    learner: str  # "maml" | "fomaml" | "reptile" | "fedmenf"
    outer_steps: int  # E
    inner_steps: int  # K (0: no adaptation)
    inner_lr: float  # lambda_i
    outer_lr: float  # lambda_o
    outer_optimizer: str = "sgd"  # "sgd" | "adamw"
    gamma: float = 0.0  # FedMeNF's fixed gamma (Eq. 10)
    privacy_budget: float | None = None  # zeta: adaptive gamma (Eq. 13-14) when set
    memorising_bound: float | None = None  # FedMeNF: L(w) in Eq. 10 clamped at this; None: not
    num_clients: int = 1  # N
    rounds: int = 1  # R
    clients_per_round: int = 1  # M
    max_grad_norm: float = 5.0
    support_batch: int = 1024  # pixels or rays per inner-loop batch B_k
    query_batch: int = 1024  # pixels or rays per outer-loop batch B_K
    seed: int = 0
    device: str | torch.device = "auto"  # where w trains: CUDA when visible, "cpu", "cuda:N"

    def __post_init__(self) -> None:
        if self.learner not in LEARNERS:
            raise ValueError(f"learner must be one of {LEARNERS}, got {self.learner!r}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"outer_optimizer must be one of {OUTER_OPTIMIZERS}, got {self.outer_optimizer!r}"
            )
        for name in (
            "outer_steps",
            "num_clients",
            "rounds",
            "clients_per_round",
            "support_batch",
            "query_batch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.inner_steps < 0:
            raise ValueError(f"inner_steps must be >= 0, got {self.inner_steps}")
        if self.clients_per_round > self.num_clients:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) exceeds num_clients "
                f"({self.num_clients})"
            )
        for name in ("inner_lr", "outer_lr", "max_grad_norm"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}")
        if self.privacy_budget is not None and not (
            math.isfinite(self.privacy_budget) and self.privacy_budget >= 0
        ):
            raise ValueError(f"privacy_budget must be >= 0 and finite, got {self.privacy_budget}")
        if self.memorising_bound is not None and not (
            math.isfinite(self.memorising_bound) and self.memorising_bound > 0
        ):
            raise ValueError(f"memorising_bound must be > 0 and finite: {self.memorising_bound}")
        optional = (self.privacy_budget, self.memorising_bound)
        fedmenf_settings = self.gamma != 0.0 or any(x is not None for x in optional)
        if self.learner != "fedmenf" and fedmenf_settings:
            raise ValueError(
                "gamma, privacy_budget and memorising_bound apply to learner 'fedmenf' only, "
                f"not {self.learner!r}"
            )


@dataclass
class MetaUpdateResult:
    """A client's uploaded meta-learner w and what its local meta-optimisation did."""

    state: dict[str, Tensor]  # the new w: detached CPU copies of the model's parameters
    num_examples: int  # |D|, summed over the client's tasks (the aggregate's weight, Eq. 2)
    outer_losses: list[float]  # per outer step: L(phi_K, B_K), or L_pp for FedMeNF (Eq. 10)
    gammas: list[float]  # FedMeNF's gamma per outer step; empty for the baselines
    mean_outer_gradient: dict[str, Tensor]  # mean clipped gradient, before the hooks' correction
    hook_results: list[HookResult] = field(default_factory=list)  # per client hook, in order


def adaptive_gamma(
    privacy_budget: float,
    num_clients: int,
    rounds: int,
    outer_steps: int,
    clients_per_round: int,
    outer_lr: float,
    grad_norm_sq: float,
) -> float:
    """gamma = clip(1 - N zeta / (R E M lambda_o ||g_K||^2), 0, 1) (FedMeNF Eq. 14).

    g_K = grad_w L(w_i, B_K) is the memorising gradient; with ||g_K|| = 0 there is nothing to
    remove and gamma is 0.
    """
    if grad_norm_sq <= 0:
        return 0.0
    allowance = num_clients * privacy_budget
    leakage = rounds * outer_steps * clients_per_round * outer_lr * grad_norm_sq
    return min(max(1.0 - allowance / leakage, 0.0), 1.0)


def local_meta_update(
    model: nn.Module,
    tasks: Sequence[MetaTask],
    config: MetaConfig,
    hooks: Sequence[ClientHook] = (),
) -> MetaUpdateResult:
    """E outer steps of `config.learner` from the model's current w (Algorithm 1, LocalUpdate).

    The model moves to `config.device` (its tasks follow it) and its parameters end at the new
    w; what comes back is on the CPU. A method's client `hooks`, bound to w, act on each outer
    step: their loss terms' gradients join the outer gradient before clipping, and
    `after_backward` corrects the clipped gradient before the optimiser's step (a control
    variate); what they leave is `MetaUpdateResult.hook_results`, in their order.
    """
    if len(tasks) == 0:
        raise ValueError("local_meta_update needs at least one task")
    model.to(resolve_device(config.device))
    params = dict(model.named_parameters())
    for hook in hooks:
        hook.bind(params)
    if config.outer_optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(params.values(), lr=config.outer_lr)
    else:
        optimizer = torch.optim.AdamW(params.values(), lr=config.outer_lr)
    torch.manual_seed(config.seed)  # stratified jitter of ray tasks
    generator = torch.Generator().manual_seed(config.seed)
    gradient_sum = {name: torch.zeros_like(p) for name, p in params.items()}
    outer_losses, gammas = [], []
    for step in range(config.outer_steps):
        task = tasks[step % len(tasks)]
        gradient, loss, gamma = _outer_gradient(model, task, params, config, generator)
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"meta-learning diverged at outer step {step}: loss is {loss}; "
                "try lower learning rates"
            )
        terms = [term for hook in hooks if (term := hook.loss()) is not None]
        if terms:
            term_gradient = torch.autograd.grad(sum(terms), list(params.values()))
            gradient = {
                name: g + p for (name, g), p in zip(gradient.items(), term_gradient, strict=True)
            }
        scale = _clip_scale(gradient.values(), config.max_grad_norm)
        gradient = {name: g.detach() * scale for name, g in gradient.items()}
        for name, parameter in params.items():
            gradient_sum[name] += gradient[name]
            parameter.grad = gradient[name].detach().clone()
        for hook in hooks:
            hook.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        outer_losses.append(loss)
        if gamma is not None:
            gammas.append(gamma)
    return MetaUpdateResult(
        state={name: p.detach().to("cpu", copy=True) for name, p in params.items()},
        num_examples=sum(task.num_examples for task in tasks),
        outer_losses=outer_losses,
        gammas=gammas,
        mean_outer_gradient={
            name: (total / config.outer_steps).cpu() for name, total in gradient_sum.items()
        },
        hook_results=[hook.finish(config.outer_steps) for hook in hooks],
    )


def _outer_gradient(
    model: nn.Module,
    task: MetaTask,
    params: dict[str, Tensor],
    config: MetaConfig,
    generator: torch.Generator,
) -> tuple[dict[str, Tensor], float, float | None]:
    """One outer step's gradient w.r.t. w, its loss and FedMeNF's gamma (Eq. 8-10, 14)."""
    second_order = config.learner in SECOND_ORDER
    weights = list(params.values())
    phi = params if second_order else {n: p.detach().requires_grad_() for n, p in params.items()}
    for _ in range(config.inner_steps):
        inner = task.loss(model, phi, task.support_batch(config.support_batch, generator))
        grads = _grad(inner, list(phi.values()), create_graph=second_order)
        step = config.inner_lr * _clip_scale(grads, config.max_grad_norm)
        phi = {name: p - step * g for (name, p), g in zip(phi.items(), grads, strict=True)}
        if not second_order:
            phi = {name: p.detach().requires_grad_() for name, p in phi.items()}
    query = task.query_batch(config.query_batch, generator)
    if config.learner == "reptile":
        with torch.no_grad():
            loss = task.loss(model, phi, query)
        gradient = {name: w.detach() - phi[name].detach() for name, w in params.items()}
        return gradient, loss.item(), None
    loss = task.loss(model, phi, query)
    if config.learner == "fomaml":
        grads = _grad(loss, list(phi.values()))
        return dict(zip(params, grads, strict=True)), loss.item(), None
    gamma = None
    if config.learner == "fedmenf":
        memorising = task.loss(model, params, query)
        if config.memorising_bound is not None:  # no push once w is this far from the data
            memorising = memorising.clamp(max=config.memorising_bound)
        gamma = config.gamma
        if config.privacy_budget is not None:
            g_k = _grad(memorising, weights, retain_graph=True)
            gamma = adaptive_gamma(
                config.privacy_budget,
                config.num_clients,
                config.rounds,
                config.outer_steps,
                config.clients_per_round,
                config.outer_lr,
                float(sum(g.double().pow(2).sum() for g in g_k)),
            )
        loss = loss - gamma * memorising
    grads = _grad(loss, weights)
    return dict(zip(params, grads, strict=True)), loss.item(), gamma


def _grad(
    loss: Tensor, inputs: list[Tensor], create_graph: bool = False, retain_graph: bool = False
) -> tuple[Tensor, ...]:
    """d loss / d inputs, zeros for inputs the loss does not reach."""
    return torch.autograd.grad(
        loss,
        inputs,
        create_graph=create_graph,
        retain_graph=retain_graph or create_graph,
        allow_unused=True,
        materialize_grads=True,
    )


def _clip_scale(gradient: Iterable[Tensor], max_norm: float) -> float:
    """min(1, max_norm / ||g||): scaling g to total L2 norm <= max_norm (clip_grad_norm_).

    A constant in the autograd graph: inner steps are clipped as FedMeNF's implementation does.
    """
    norm = torch.sqrt(sum(g.detach().double().pow(2).sum() for g in gradient))
    return min(1.0, max_norm / (float(norm) + 1e-6))


def test_time_optimise(
    model: nn.Module,
    state: Mapping[str, Tensor],
    task: MetaTask,
    steps: Sequence[int] = (0, 1, 2, 4, 8, 16),
    *,
    learning_rate: float,
    optimizer: str = "adam",
    batch_size: int = 1024,
    max_grad_norm: float = 5.0,
    with_lpips: bool = True,
    seed: int = 0,
) -> dict[int, dict[str, float | None]]:
    """Test-time optimisation (FedMeNF Sec. 6.1): from `state` fit the task's support set and
    score `render_query` against its query set after each step count in `steps`.

    One run of Adam or SGD on support minibatches, gradients clipped to `max_grad_norm`, with
    snapshots at the listed counts: {step: {"psnr", "ssim", "lpips"}} (LPIPS None when
    unavailable or not asked for). The model's own parameters are left untouched.
    """
    if not steps or min(steps) < 0:
        raise ValueError(f"steps must be non-negative step counts, got {tuple(steps)}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be positive and finite, got {learning_rate}")
    if batch_size < 1 or not max_grad_norm > 0:
        raise ValueError(
            f"need batch_size >= 1 and max_grad_norm > 0: {batch_size}, {max_grad_norm}"
        )
    params = {
        name: tensor.detach().clone().requires_grad_()
        for name, tensor in on_device(state, dict(model.named_parameters()), "state").items()
    }
    optimiser_class = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    optimiser = optimiser_class(params.values(), lr=learning_rate)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    snapshots: dict[int, dict[str, float | None]] = {}
    for step in range(max(steps) + 1):
        if step in steps:
            snapshots[step] = _quality(task, task.render_query(model, params), with_lpips)
        if step == max(steps):
            break
        loss = task.loss(model, params, task.support_batch(batch_size, generator))
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), max_grad_norm)
        optimiser.step()
    return {step: snapshots[step] for step in steps}


test_time_optimise.__test__ = False  # type: ignore[attr-defined]  # a library call, not a test


def privacy_metrics(
    model: nn.Module, state: Mapping[str, Tensor], task: MetaTask, with_lpips: bool = True
) -> dict[str, float | None]:
    """PSNR_p (FedMeNF Eq. 6), SSIM_p and LPIPS_p: the uploaded w rendered at the task's own
    query coordinates against its private query targets, with no optimisation."""
    params = on_device(state, dict(model.named_parameters()), "state")
    quality = _quality(task, task.render_query(model, params), with_lpips)
    return {f"{name}_p": value for name, value in quality.items()}


def rescaled_privacy_psnr(
    model: nn.Module, state: Mapping[str, Tensor], task: MetaTask
) -> dict[str, float]:
    """PSNR_p of an attacker who rescales the upload's outputs before clamping (FedMeNF's
    PSNR_p clamps raw outputs to [0, 1], which an output scaled down hides).

    "psnr_p_rescaled": blind, min-max from the render's own statistics (what a server can do);
    "psnr_p_oracle": the least-squares affine fit against the private targets (an upper bound:
    the attacker would need the answer).
    """
    params = on_device(state, dict(model.named_parameters()), "state")
    render = task.render_query(model, params).double()
    target = task.query_targets.double()
    spread = render.max() - render.min()
    blind = (render - render.min()) / spread if spread > 0 else torch.zeros_like(render)
    design = torch.stack([render.flatten(), torch.ones_like(render.flatten())], dim=1)
    fit = torch.linalg.lstsq(design, target.flatten()[:, None]).solution[:, 0]
    oracle = fit[0] * render + fit[1]
    targets = task.query_images(task.query_targets)

    def score(values: Tensor) -> float:
        return psnr(task.query_images(values.float().clamp(0.0, 1.0)), targets)

    return {"psnr_p_rescaled": score(blind), "psnr_p_oracle": score(oracle)}


def _quality(task: MetaTask, prediction: Tensor, with_lpips: bool) -> dict[str, float | None]:
    """PSNR, SSIM and LPIPS of a prediction clamped to [0, 1] against the query targets."""
    images = task.query_images(prediction.clamp(0.0, 1.0))
    targets = task.query_images(task.query_targets)
    perceptual = None
    if with_lpips:
        grey = images.shape[-1] == 1  # LPIPS networks take RGB
        perceptual = lpips(
            images.expand(*images.shape[:-1], 3) if grey else images,
            targets.expand(*targets.shape[:-1], 3) if grey else targets,
        )
    return {"psnr": psnr(images, targets), "ssim": ssim(images, targets), "lpips": perceptual}
