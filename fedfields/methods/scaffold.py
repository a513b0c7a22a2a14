"""Scaffold (Karimireddy et al. 2020, Algorithm 1 with option II control variates).

Client i runs K local steps y <- y - lr (g_i(y) - c_i + c) from the global model x, then
uploads (y_i - x, c_i+ - c_i); option II's c_i+ = c_i - c + (x - y_i) / (K lr) is written in
tests/paper_reference.py, while our clients, on Adam, take the mean uncorrected gradient
(`ScaffoldHook`): under SGD option II's c_i - c + (x - y_i) / (K lr) equals it, while under
Adam (x - y_i) / (K lr) is a normalised step of order 1 per coordinate whatever the
gradient's scale, so the mean keeps controls in gradient units
(tests/test_federated_training.py). The server applies x <- x + lr_g mean(delta y)
and c <- c + |S|/N mean(delta c) over the sampled set S, from the two sums alone, so it
composes with SecAgg+ and client-level DP (both records clipped jointly).

Train messages carry ARRAYS (x) and SERVER_CONTROL (c, zeros at first, the keys of x);
replies carry ARRAYS (y_i, summed as y_i - x) and CONTROL_DELTA (delta c_i). A plaintext
reply with ||delta c_i|| above max-control-norm is dropped ("control-norm"): honest controls
estimate a mean gradient, while a 1e30 delta would become the c every client adds to each
of its gradients. N is the number of nodes connected when the round is sampled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import Tensor

from fedfields.methods.accounting import CostModel
from fedfields.methods.base import (
    ARRAYS,
    ClientHook,
    HookResult,
    Kept,
    Method,
    RecordSpec,
    RoundContext,
    RoundSums,
    ServerStep,
    State,
    check_scalar,
    check_states,
    like,
    on_device,
    to_wire,
)
from fedfields.methods.settings import (
    MAX_STEP_SCALE,
    NON_NEGATIVE,
    StrategySettings,
    optional_cap,
    setting,
    within,
)

SERVER_CONTROL = "server-control"
"""Train-message record: the server control variate c, the keys of ARRAYS."""
CONTROL_DELTA = "control-delta"
"""Reply record: delta c_i = c_i+ - c_i."""
CLIENT_CONTROL = "scaffold-client-control"
"""Node-state name of a client's control variate c_i (not a record: never sent)."""
SCAFFOLD_COST = CostModel(2, 0, 2, 0, 2)
"""Two sums up (y_i - x and delta c_i), two states down (x and c)."""
DEFAULT_MAX_CONTROL_NORM = 1e6
"""Cap on ||delta c_i||: a control variate estimates a mean gradient (at most about
sqrt(d) for Adam-sized steps, under 1e4 for the fields here); 1e6 leaves room for any honest
client and none for one that would scale every later gradient."""


@overload
def scaffold_corrected_gradient(
    grad: Tensor, server_control: Tensor, client_control: Tensor
) -> Tensor: ...
@overload
def scaffold_corrected_gradient(
    grad: State, server_control: State, client_control: State
) -> dict[str, Tensor]: ...
def scaffold_corrected_gradient(
    grad: Tensor | State, server_control: Tensor | State, client_control: Tensor | State
) -> Tensor | dict[str, Tensor]:
    """g - c_i + c (Algorithm 1, local step), for one tensor or key-wise for dicts.

    Runs every local step, so it checks keys and shapes but not finiteness (no device sync).
    """
    if isinstance(grad, Tensor):
        if not (isinstance(server_control, Tensor) and isinstance(client_control, Tensor)):
            raise ValueError("grad is a tensor, so both controls must be tensors too")
        if not grad.shape == server_control.shape == client_control.shape:
            raise ValueError(
                f"shapes differ: grad {tuple(grad.shape)}, server control "
                f"{tuple(server_control.shape)}, client control {tuple(client_control.shape)}"
            )
        return grad - client_control.to(grad.dtype) + server_control.to(grad.dtype)
    for name, control in (("server_control", server_control), ("client_control", client_control)):
        if not isinstance(control, Mapping):
            raise ValueError(f"grad is a dict, so {name} must be a dict too")
        if control.keys() != grad.keys():
            raise ValueError(f"{name}: keys {list(control)} differ from grad's {list(grad)}")
    return {
        key: scaffold_corrected_gradient(g, server_control[key], client_control[key])
        for key, g in grad.items()
    }


def scaffold_server_update_from_sums(
    global_state: State,
    model_delta_sum: State,
    control_delta_sum: State,
    num_sampled: int,
    server_control: State,
    num_clients_total: int,
    global_lr: float = 1.0,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """x <- x + lr_g sum_i (y_i - x) / |S|, c <- c + (|S|/N) sum_i delta c_i / |S|
    (Algorithm 1) from the two sums over the |S| sampled clients.

    What a server behind secure aggregation sees: the sums and how many clients are in them.
    """
    if int(num_sampled) != num_sampled or num_sampled < 1:
        raise ValueError(f"num_sampled must be a positive integer, got {num_sampled}")
    if int(num_clients_total) != num_clients_total or num_clients_total < num_sampled:
        raise ValueError(
            f"num_clients_total must be an integer >= the {num_sampled} sampled clients, "
            f"got {num_clients_total}"
        )
    check_states([global_state, model_delta_sum], names=["global_state", "model_delta_sum"])
    check_states([server_control, control_delta_sum], names=["server_control", "control_sum"])
    global_lr = check_scalar(global_lr, "global_lr")
    new_global = {
        key: like(x.detach().double() + global_lr * model_delta_sum[key].double() / num_sampled, x)
        for key, x in global_state.items()
    }
    fraction = num_sampled / num_clients_total
    new_control = {
        key: like(c.detach().double() + fraction * control_delta_sum[key].double() / num_sampled, c)
        for key, c in server_control.items()
    }
    return new_global, new_control


@dataclass(frozen=True)
class ScaffoldSettings(StrategySettings):
    """Scaffold's run-config keys."""

    global_lr: float = setting(
        1.0,
        "scaffold-global-lr",
        "Scaffold's server step size, in (0, 1000]",
        within(0.0, MAX_STEP_SCALE, low_open=True),
    )
    max_control_norm: float = setting(
        DEFAULT_MAX_CONTROL_NORM,
        "max-control-norm",
        "Scaffold: a reply with ||delta c_i|| above it is dropped (0: no cap)",
        NON_NEGATIVE,
    )


class Scaffold(Method):
    """Scaffold's server half: x <- x + lr_g mean(y_i - x), c <- c + |S|/N mean(delta c_i)
    (Algorithm 1, lines 16-17), from the round's two sums.

    Args:
        global_lr: server step size lr_g.
        max_control_norm: the cap on ||delta c_i|| (0 or None: no cap).

    Attributes:
        server_control: c as a state dict, carried across rounds (empty before round 1; set
            it to {} to restart with zeros).
    """

    name = "scaffold"
    settings_class = ScaffoldSettings
    cost_model = SCAFFOLD_COST
    weight_metric = ""  # Algorithm 1's plain mean over the sampled clients
    from_mean = False

    def __init__(
        self, *, global_lr: float = 1.0, max_control_norm: float | None = DEFAULT_MAX_CONTROL_NORM
    ) -> None:
        self.global_lr = check_scalar(global_lr, "global_lr")
        self.max_control_norm = optional_cap(max_control_norm, "max_control_norm")
        self.server_control: dict[str, Tensor] = {}

    def reply_records(self) -> tuple[RecordSpec, ...]:
        """y_i summed as y_i - x; delta c_i as it is, its norm capped."""
        control = RecordSpec(
            CONTROL_DELTA,
            norm_check="control-norm",
            norm_cap=self.max_control_norm,
            drop_reason="Scaffold replies' ||delta c_i|| exceeded max-control-norm",
        )
        return RecordSpec(ARRAYS, delta=True), control

    @classmethod
    def client_hooks(
        cls, config: Mapping[str, Any], received: Mapping[str, State], kept: Kept
    ) -> list[ClientHook]:
        """[`ScaffoldHook`] from the message's c and the node's c_i (zeros at first)."""
        if SERVER_CONTROL not in received:
            raise ValueError(f"a Scaffold train message carries {SERVER_CONTROL!r}; this one not")
        server = received[SERVER_CONTROL]
        client = kept(CLIENT_CONTROL) or {k: torch.zeros_like(v) for k, v in server.items()}
        if client.keys() != server.keys():
            raise ValueError(
                "the node's Scaffold control c_i has other keys than the server's c: "
                "was its state directory used by another model?"
            )
        return [ScaffoldHook(dict(server), dict(client))]

    def sent(self, global_state: State, server_round: int) -> dict[str, State]:
        """x and c (zeros in the first round); ValueError if c no longer fits x."""
        if not self.server_control:
            self.server_control = {key: torch.zeros_like(x) for key, x in global_state.items()}
        elif {k: c.shape for k, c in self.server_control.items()} != {
            k: x.shape for k, x in global_state.items()
        }:
            raise ValueError(
                "server_control's keys or shapes differ from the global state's; "
                "set server_control = {} to restart from zeros"
            )
        return {ARRAYS: global_state, SERVER_CONTROL: self.server_control}

    def step_from_sums(self, context: RoundContext, sums: RoundSums) -> ServerStep:
        """x and c from the sums of y_i - x and delta c_i over the summed replies."""
        new_global, self.server_control = scaffold_server_update_from_sums(
            context.global_state,
            sums.records[ARRAYS],
            sums.records[CONTROL_DELTA],
            sums.count,
            self.server_control,
            num_clients_total=context.num_nodes_total,
            global_lr=self.global_lr,
        )
        return ServerStep(new_global)

    def state(self) -> dict[str, Any]:
        """The server control c."""
        return {"server-control": dict(self.server_control)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back c."""
        self.server_control = dict(state["server-control"])

    def describe(self) -> str:
        """The name and lr_g."""
        return f"scaffold (global_lr {self.global_lr:g})"


class ScaffoldHook(ClientHook):
    """Scaffold's client step (Algorithm 1, line 10): c - c_i added to the gradients after
    backward, the uncorrected ones summed for c_i+, their mean over the steps; the reply
    carries delta c_i = c_i+ - c_i and the node keeps c_i+. In place on the device, no host
    read, so a captured static step runs it too."""

    def __init__(self, server: dict[str, Tensor], client: dict[str, Tensor]) -> None:
        self.server, self.client = server, client
        self.parameters: Mapping[str, Tensor] = {}
        self.correction: dict[str, Tensor] = {}
        self.gradient_sum: dict[str, Tensor] = {}

    def bind(self, parameters: Mapping[str, Tensor]) -> None:
        """c - c_i on the parameters' device (formed once: equal controls then leave every
        gradient bit for bit unchanged) and a zero sum of gradients."""
        server = on_device(self.server, parameters, "scaffold server control")
        client = on_device(self.client, parameters, "scaffold client control")
        self.parameters = parameters
        self.correction = {name: server[name] - client[name] for name in parameters}
        self.gradient_sum = {name: torch.zeros_like(p) for name, p in parameters.items()}

    def after_backward(self) -> None:
        """Sum each gradient, then add c - c_i to it (a parameter no sample reached gets 0)."""
        for name, parameter in self.parameters.items():
            if parameter.grad is None:  # no sample reached it this step
                parameter.grad = torch.zeros_like(parameter)
            self.gradient_sum[name] += parameter.grad
            parameter.grad += self.correction[name]

    def refill(self, other: ClientHook) -> None:
        """`other`'s controls into this hook's buffers, its sum zeroed."""
        assert isinstance(other, ScaffoldHook)
        self.server, self.client = other.server, other.client
        server = on_device(other.server, self.parameters, "scaffold server control")
        client = on_device(other.client, self.parameters, "scaffold client control")
        for name, correction in self.correction.items():
            correction.copy_(server[name] - client[name])
            self.gradient_sum[name].zero_()

    def control(self, steps: int) -> dict[str, Tensor]:
        """c_i+: the mean uncorrected gradient over `steps` steps, in wire form."""
        return {name: to_wire(total / steps) for name, total in self.gradient_sum.items()}

    def finish(self, steps: int) -> HookResult:
        """delta c_i for the reply, c_i+ for the node."""
        control = self.control(steps)
        delta = {key: value - self.client[key] for key, value in control.items()}
        return HookResult(records={CONTROL_DELTA: delta}, kept={CLIENT_CONTROL: control})
