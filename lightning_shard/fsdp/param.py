"""FSDPParam: one managed parameter, the places it is registered, and its sharded and unsharded forms.

A parameter may be registered on several modules (tied weights); every ``(module, name)`` is swapped
together between the sharded DTensor (outside forward/backward: what optimizers, clipping and state dicts
see) and the unsharded tensor used for compute (a view into the group's unsharded flat buffer).

Example::

    fp = FSDPParam("lm_head.weight", param, [(lm_head, "weight"), (embed, "weight")])
    fp.set_on_modules(fp.sharded)
"""

from __future__ import annotations

import torch
from torch import nn


class FSDPParam:
    """Book-keeping for one parameter of an FSDP group (see module docstring)."""

    def __init__(self, fqn: str, param: nn.Parameter, refs: list[tuple[nn.Module, str]]) -> None:
        if not param.is_floating_point():
            raise ValueError(
                f"fully_shard: parameter {fqn!r} has dtype {param.dtype}; only floating-point parameters can be "
                "sharded. Register it as a buffer, or pass it in ignored_params to keep it replicated."
            )
        if param.ndim == 0:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is 0-dim (a scalar); it cannot be sharded on dim 0. Give it shape "
                "(1,), or pass it in ignored_params to keep it replicated (you then keep it in sync)."
            )
        self.fqn = fqn
        self.refs = refs
        self.shape = param.shape
        self.dtype = param.dtype
        self.requires_grad = param.requires_grad
        self.sharded: nn.Parameter | None = None  # our DTensor, Shard(0) on the data-parallel mesh
        self.unsharded: nn.Parameter | None = None  # plain view into the unsharded flat buffer

    def set_on_modules(self, tensor: nn.Parameter) -> None:
        """Register ``tensor`` under every name this parameter has (bypasses nn.Module's type checks)."""
        for module, name in self.refs:
            module._parameters[name] = tensor

    def unsharded_grad(self) -> torch.Tensor | None:
        return None if self.unsharded is None else self.unsharded.grad
