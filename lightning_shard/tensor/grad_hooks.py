"""Gradient hooks a user registered on a parameter that distributing replaces.

``distribute_module``, the tensor-parallel styles and ``fully_shard`` register a new parameter (a DTensor) in
place of the module's own. Tensor hooks live on the tensor object, so ``p.register_hook(fn)`` and
``p.register_post_accumulate_grad_hook(fn)`` called on the old parameter would be silently lost with it (torch's
``parallelize_module`` and ``fully_shard`` lose them too): a gradient clip or an optimizer stepped in backward
would stop working with no error. ``carry_over_grad_hooks`` moves them to the new parameter.

Example::

    new = nn.Parameter(distribute_tensor(old.detach(), mesh, placements))
    carry_over_grad_hooks(old, new)
    module.register_parameter("weight", new)
"""

from __future__ import annotations

import torch


def carry_over_grad_hooks(original: torch.Tensor, new: torch.Tensor) -> None:
    """Give ``new`` the gradient hooks registered on ``original`` (the same dicts, so the handles
    ``register_*hook`` returned still remove them). The hooks then get ``new`` (and its DTensor gradient)."""
    post = getattr(original, "_post_accumulate_grad_hooks", None)
    if post:
        new._post_accumulate_grad_hooks = post
    pre = getattr(original, "_backward_hooks", None)
    if pre:
        new._backward_hooks = pre
