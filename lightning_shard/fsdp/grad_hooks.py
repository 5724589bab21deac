"""User gradient hooks on FSDP-managed parameters: ``register_hook`` and ``register_post_accumulate_grad_hook``.

Autograd never sees a sharded parameter: the forward uses the unsharded one, whose gradient the group
reduce-scatters into the sharded ``.grad`` itself. So autograd would never call hooks registered on the
sharded parameter (the one ``model.parameters()`` gives outside forward), and a recipe built on them (one
optimizer per parameter stepped in a post-accumulate-grad hook, "optimizer in backward") would train nothing,
silently. The group calls them instead, on the reduced gradient, as torch's FSDP2 calls the post-accumulate
ones after its reduce-scatter:

* ``register_hook(fn)``: ``fn(grad)`` gets this backward's reduced sharded gradient (a DTensor placed like the
  parameter) before it is added to ``.grad``, and may return a replacement, as a leaf's hook gets the
  gradient before accumulation on one device (``FSDPParamGroup.finish_reduce``).
* ``register_post_accumulate_grad_hook(fn)``: ``fn(param)`` with the sharded parameter once its ``.grad``
  holds the reduced gradient, at the end of the backward (``FSDPParamGroup.wait_for_gradients``).

Both run only for parameters some rank computed a gradient for in this backward, as on one device, and only in
a backward that reduces (after ``set_requires_gradient_sync(False)`` micro-batches, in the one that syncs).
Hooks registered on a parameter before ``fully_shard`` move to its sharded parameter
(``lightning_shard.tensor.grad_hooks``).

Example::

    fully_shard(model)
    opts = {p: torch.optim.AdamW([p]) for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: (opts[p].step(), opts[p].zero_grad()))
    model(x).sum().backward()            # every parameter stepped once, on its reduced gradient
"""

from __future__ import annotations

import torch


def has_tensor_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` has ``register_hook`` hooks."""
    return bool(getattr(param, "_backward_hooks", None))


def run_tensor_hooks(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` after ``param``'s ``register_hook`` hooks, in registration order (a hook returning None keeps
    the gradient it got), under ``no_grad`` as autograd runs them."""
    with torch.no_grad():
        for hook in list(param._backward_hooks.values()):
            out = hook(grad)
            if out is not None:
                grad = out
    return grad


def as_local_gradient(out: torch.Tensor, param: torch.Tensor, fqn: str) -> torch.Tensor:
    """This rank's shard of the gradient a ``register_hook`` hook returned for the sharded ``param``.

    A DTensor is redistributed to the parameter's placements. A plain tensor cannot be told apart from a full
    gradient or a shard, so it is refused (as a DTensor ``.grad`` refuses one).
    """
    from lightning_shard.tensor import DTensor

    if not isinstance(out, DTensor):
        raise TypeError(
            f"a register_hook hook of the FSDP parameter {fqn!r} returned a {type(out).__name__} of shape "
            f"{tuple(out.shape)}; it gets the sharded gradient as a DTensor and must return a DTensor (e.g. "
            "grad * s, grad.clamp(-c, c), grad + torch.randn_like(grad)) or None"
        )
    if out.placements != param.placements:
        out = out.redistribute(param.device_mesh, param.placements)
    return out._local_tensor


def run_post_accumulate_hooks(param: torch.Tensor) -> None:
    """Call ``param``'s post-accumulate-grad hooks with ``param``, under ``no_grad`` as autograd runs them."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if not hooks:
        return
    with torch.no_grad():
        for hook in list(hooks.values()):
            hook(param)
