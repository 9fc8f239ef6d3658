"""Moving step inputs (tensors nested in lists, tuples and dataclasses) between devices."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch


def to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """A copy with every tensor (also inside dataclasses, lists and tuples) on `device`; the original
    is left as it was. Tensors already there are shared, not copied. `non_blocking` only for copies
    to a GPU (a non-blocking copy to the host may be read before it lands)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, non_blocking) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(
            value, **{f.name: to_device(getattr(value, f.name), device, non_blocking) for f in fields(value)}
        )
    return value
