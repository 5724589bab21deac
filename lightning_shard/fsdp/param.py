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

from lightning_shard.tensor import DTensor

BUILT_ON_META = "_built_on_meta"


def built_on_meta(param: torch.Tensor) -> bool:
    """Whether ``fully_shard`` gave this parameter, built on the meta device, real storage without a value: its
    group also held parameters with values (one flat shard holds a group; it cannot be part meta), so it is not
    ``is_meta`` and still needs initialising (``to_empty`` leaves it alone). All-meta groups stay on meta.

    Example: ``[n for n, p in model.named_parameters() if p.is_meta or built_on_meta(p)]``.
    """
    return getattr(param, BUILT_ON_META, False)


# torch's optimizers step a complex parameter as its real view, so the real-view parameter trains the same.
_COMPLEX_HINT = (
    " For a complex parameter, store its real view instead, nn.Parameter(torch.view_as_real(w)) (a trailing "
    "dimension of 2), and use torch.view_as_complex(self.weight) in forward: the same values, gradients and "
    "optimizer steps, sharded as a float tensor."
)


class FSDPParam:
    """Book-keeping for one parameter of an FSDP group (see module docstring)."""

    def __init__(self, fqn: str, param: nn.Parameter, refs: list[tuple[nn.Module, str]]) -> None:
        if not param.is_floating_point():
            raise ValueError(
                f"fully_shard: parameter {fqn!r} has dtype {param.dtype}; only floating-point parameters can be "
                "sharded. Register it as a buffer, or pass it in ignored_params to keep it replicated."
                + (_COMPLEX_HINT if param.is_complex() else "")
            )
        self.fqn = fqn
        self.refs = refs
        # FSDP over TP: the parameter is already our DTensor on a tensor-parallel mesh. FSDP then shards its
        # TP-local tensor, and the unsharded parameter used in forward is that DTensor again.
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        self.shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape  # what FSDP shards
        self.global_shape = param.shape
        self.dtype = param.dtype
        self._agreed_requires_grad = param.requires_grad
        self.sharded: nn.Parameter | None = None  # our DTensor, Shard(0) on the data-parallel mesh (or replicated)
        self.unsharded: nn.Parameter | None = None  # plain view into the unsharded flat buffer

    @property
    def replicated(self) -> bool:
        """A 0-dim (scalar) parameter, e.g. CLIP's ``logit_scale``: no dim 0 to shard, so every rank keeps the
        whole value (its DTensor is ``Replicate``, as torch's DDP keeps every parameter).

        In the group's flat buffers it is laid out as one row per rank (``layout_shape``): each rank's shard holds
        its copy, the all-gather brings them all and the unsharded parameter is the first, and its gradient is
        staged into every row, so the reduce-scatter hands every rank the whole reduced gradient. No other
        collective, and the ranks' copies stay equal as their optimizers apply equal gradients.
        """
        return len(self.shape) == 0

    def layout_shape(self, shard_size: int) -> torch.Size:
        """The shape this parameter has in the group's flat buffers: its own, or one row per rank if
        ``replicated``.

        Example: ``FSDPParam("scale", nn.Parameter(torch.tensor(2.0)), refs).layout_shape(4)`` -> ``(4,)``.
        """
        return torch.Size([shard_size]) if self.replicated else self.shape

    def staged_grad(self, grad: torch.Tensor | None, shard_size: int) -> torch.Tensor | None:
        """``grad`` as the reduce-scatter stages it (``layout_shape``): a replicated parameter's in every row."""
        if grad is None or not self.replicated:
            return grad
        return grad.reshape(1).expand(shard_size).contiguous()

    @property
    def requires_grad(self) -> bool:
        """Whether this parameter trains: the flag users and callbacks last set (``model.requires_grad_(False)``,
        Lightning's ``BaseFinetuning.make_trainable`` or ``toggle_optimizer``) at any time, on either tensor."""
        if self.sharded is None:
            return self._agreed_requires_grad
        self.sync_requires_grad()
        return self.sharded.requires_grad

    def sync_requires_grad(self) -> None:
        """Make the sharded and the unsharded parameter agree on ``requires_grad``: the one changed since they
        last agreed wins.

        Both are reachable: an optimizer (and Lightning's ``toggle_optimizer``, through its param groups) holds
        the sharded one, while ``module.requires_grad_()`` reaches whichever the module holds at that moment,
        the unsharded one inside the unit's forward (under Lightning, all of ``training_step`` for the root). A
        one-way copy at each unshard undid a change made to the unsharded parameter (the next step trained a
        model frozen by ``requires_grad_(False)``) and reached the unsharded one only at the next unshard.
        """
        if self.unsharded is None or self.sharded is None:
            return
        sharded, unsharded = self.sharded.requires_grad, self.unsharded.requires_grad
        if sharded != unsharded:
            if unsharded != self._agreed_requires_grad:  # the unsharded one changed since they agreed
                self.sharded.requires_grad_(unsharded)
            else:
                self.unsharded.requires_grad_(sharded)
        self._agreed_requires_grad = self.sharded.requires_grad  # the value they last agreed on

    def set_on_modules(self, tensor: nn.Parameter) -> None:
        """Register ``tensor`` under every name this parameter has (bypasses nn.Module's type checks)."""
        for module, name in self.refs:
            module._parameters[name] = tensor

    def unsharded_grad(self) -> torch.Tensor | None:
        """This rank's gradient of the unsharded parameter (TP-local, laid out like the parameter)."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if isinstance(grad, DTensor):
            # e.g. a TP-replicated norm weight fed sequence-parallel inputs gets a Partial gradient
            grad = grad.redistribute(self.tp_spec.mesh, self.tp_spec.placements).to_local()
        return grad

    def wrap_unsharded(self, local: torch.Tensor) -> torch.Tensor:
        """The tensor modules see in forward: ``local`` itself, or the TP DTensor around it."""
        if self.tp_spec is None:
            return local
        return DTensor(local, self.tp_spec, requires_grad=False)
