"""Checks at a unit's pre-forward for calls whose parameters are not the ones ``fully_shard`` would gather.

* ``torch.func.functional_call`` (and ``nn.utils.stateless``) registers the caller's tensors on the modules
  for one call. The unit's all-gather then registered its own unsharded parameters over them: the forward ran
  with the model's weights, not the caller's, and returned a wrong result with no error (2.3 off in a test).
  A parametrization registered after ``fully_shard`` moves the parameter away from its name: the same check.
* ``torch.export.export`` traces the forward with fake parameters registered over the unit's own (the same
  replaced-parameter error, naming neither export nor its fix); an exported program would also hold one rank's
  shards and the unit's collectives. It is refused by name.
* ``torch.func`` transforms that differentiate (``grad``, ``jacrev``, ..., and ``vmap`` with autograd on) wrap
  tensors in functorch wrappers that have no storage: the all-gather failed with "Cannot access storage of
  TensorWrapper". ``vmap`` alone under ``torch.no_grad()`` works and is let through.

Each raises a ``RuntimeError`` naming the unit and the fix, at the same point on every rank (before the unit's
all-gather). Cost: one identity test per parameter name at each unit's forward.

Example::

    check_forward_parameters(state.unit.unit, state.group)  # in FSDPState._pre_forward
"""

from __future__ import annotations

import torch
from torch._C._functorch import TransformType, get_interpreter_stack

from lightning_shard.fsdp.param_group import FSDPParamGroup

__all__ = ["check_forward_parameters"]

_FIX = (
    "Run it on an unsharded copy instead: a plain model given load_state_dict("
    "lightning_shard.checkpoint.get_model_state_dict(model, full_state_dict=True)) (every rank calls it); for "
    "per-sample gradients, one forward and backward per sample"
)


def check_forward_parameters(unit: str, group: FSDPParamGroup | None) -> None:
    """Raise if this forward runs under ``torch.export``, a ``torch.func`` transform or with parameters the unit
    did not register."""
    if torch.compiler.is_exporting():
        raise RuntimeError(
            f"fully_shard unit {unit}: torch.export.export of a fully_shard-ed module is not supported (each rank "
            "holds only shards of the parameters, and the forward runs collectives). Export an unsharded copy in "
            "one process: a plain model given load_state_dict(lightning_shard.checkpoint.get_model_state_dict("
            "model, full_state_dict=True)) (every rank calls it), or, with Lightning, "
            "MyModule.load_from_checkpoint(path) of a checkpoint the strategy saved"
        )
    transforms = [i.key() for i in get_interpreter_stack() or ()]
    if transforms and (torch.is_grad_enabled() or any(t != TransformType.Vmap for t in transforms)):
        raise RuntimeError(
            f"fully_shard unit {unit}: forward under a differentiating torch.func transform (grad, jacrev, ..., "
            "or vmap with autograd enabled) is not supported; the unit's all-gather cannot run on functorch's "
            f"wrapped tensors (vmap under torch.no_grad() works). {_FIX}"
        )
    if group is None:
        return
    for fp in group.params:
        for module, name in fp.refs:
            registered = module._parameters.get(name)
            if registered is None or (registered is not fp.sharded and registered is not fp.unsharded):
                raise RuntimeError(
                    f"fully_shard unit {unit}: parameter {fp.fqn!r} was replaced or removed on its module "
                    "(torch.func.functional_call, nn.utils.stateless, a parametrization registered after fully_shard, "
                    "torch.nn.utils.prune applied after fully_shard, or an assignment; found "
                    f"{_describe(registered)}). The unit would "
                    "all-gather and register its own values over it, so functional_call over a fully_shard-ed module "
                    f"is not supported, and parametrizations and pruning must be applied before fully_shard. {_FIX}"
                )


def _describe(registered) -> str:
    if registered is None:
        return "no parameter under that name"
    return f"a {type(registered).__name__} of shape {tuple(registered.shape)}"
