"""Scaffold (Karimireddy et al. 2020, Algorithm 1 with option II control variates).

Client i runs K local steps y <- y - lr (g_i(y) - c_i + c) from the global model x, then
uploads (y_i - x, c_i+ - c_i); option II's c_i+ = c_i - c + (x - y_i) / (K lr) is written in
tests/paper_reference.py, while our clients, on Adam, take the mean uncorrected gradient
(`fedfields.train.federated.ScaffoldCorrector`). The server applies x <- x + lr_g mean(delta y)
and c <- c + |S|/N mean(delta c) over the sampled set S.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import overload

from torch import Tensor

from fedfields.methods.states import State, check_scalar, check_states, like


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
