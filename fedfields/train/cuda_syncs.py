"""The aten operators a CUDA-graph step must not run: each makes the host wait for the GPU
(or copies host data onto it) inside its CUDA implementation, and raises "operation not
permitted when stream is capturing" inside a capture. On the CPU they run without a sign, so
tests record a step's operators with a dispatch mode and check them against this one list
(tests/test_host_syncs.py), where an operator-level sync counter would miss them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CUDA_SYNCING_OPERATORS: dict[str, str] = {
    "aten.bincount": "reads the input's min and max back to size its output (a host read "
    "per call, more with weights); use index_add_ into a preallocated buffer",
    "aten.histc": "reads min and max back when its range is left at 0",
    "aten.nonzero": "its output's length is the data's: the host reads the count",
    "aten.masked_select": "its output's length is the mask's count: a host read",
    "aten.unique": "its output's length is the data's: a host read",
    "aten._unique": "its output's length is the data's: a host read",
    "aten._unique2": "its output's length is the data's: a host read",
    "aten.unique_consecutive": "its output's length is the data's: a host read",
    "aten.unique_dim": "its output's length is the data's: a host read",
    "aten.repeat_interleave": "sums its repeats on the host unless given output_size",
    "aten._local_scalar_dense": ".item(), float(), int() or bool() of a tensor: a host read",
    "aten.is_nonzero": "bool() of a one-element tensor: a host read",
    "aten.equal": "torch.equal answers a Python bool: a host read",
    "aten.lift_fresh": "torch.tensor() from Python values: a copy from the host each call",
}
"""Operator (overload packet) -> why it syncs on CUDA or cannot be captured."""


def syncing_reason(operator: str, kwargs: Mapping[str, Any] | None = None) -> str | None:
    """Why `operator` ("aten.bincount.default", as a dispatch mode names it) syncs on CUDA, or
    None; repeat_interleave given its output_size does not."""
    packet = operator.rsplit(".", 1)[0] if operator.count(".") >= 2 else operator
    reason = CUDA_SYNCING_OPERATORS.get(packet)
    if packet == "aten.repeat_interleave" and (kwargs or {}).get("output_size") is not None:
        return None
    return reason
