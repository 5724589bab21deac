"""Name the torch API behind a DTensor op that failed, when the op's own error cannot.

Some torch functions meant for plain tensors run a sequence of aten ops on a sharded parameter that the
engine must refuse (an in-place ``index_put_`` that would need the whole tensor, a write through a gathered
``select``). The op's error then names ``aten.index_put_`` and a redistribution, not the function the user
called. When a refused op was called from one of the functions below, the error is raised again as a
``RuntimeError`` naming that function and the supported order (the op's error stays chained as its cause):

* ``torch.nn.utils.prune`` (``l1_unstructured``, ``random_unstructured``, ``ln_structured``, custom methods):
  prune before sharding (the strategy then shards ``<name>_orig`` and prune's hook applies the mask).
* ``torch.nn.init.sparse_`` and ``torch.nn.init.dirac_``: they index single rows and columns with plain
  tensors, which a parameter sharded along dim 0 cannot take in place. Initialise before sharding, or on the
  full value and copy it back.

Only the failure path walks the stack; a dispatch that succeeds costs nothing more.

Example::

    prune.l1_unstructured(sharded_linear, "weight", amount=0.5)
    # RuntimeError: torch.nn.utils.prune.l1_unstructured on a sharded (DTensor) parameter ... prune before sharding
"""

from __future__ import annotations

import os
import sys

_PRUNE = os.path.join("torch", "nn", "utils", "prune.py")
_INIT = os.path.join("torch", "nn", "init.py")
_INDEXING_INITS = frozenset(["sparse_", "dirac_"])
# torch.nn.utils.prune's public functions, outermost first: the one the user called is named.
_PRUNE_FUNCTIONS = frozenset(
    ["l1_unstructured", "random_unstructured", "ln_structured", "random_structured", "global_unstructured",
     "custom_from_mask", "identity", "remove", "apply"]
)  # fmt: skip


def _caller(frame) -> tuple[str, str] | None:
    """``("prune", name)`` or ``("init", name)`` for the outermost such frame above ``frame``, else ``None``."""
    found = None
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if path.endswith(_PRUNE) and name in _PRUNE_FUNCTIONS:
            found = ("prune", name)
        elif path.endswith(_INIT) and name in _INDEXING_INITS:
            found = ("init", name)
        frame = frame.f_back
    return found


def raise_for_caller(error: Exception) -> None:
    """Raise a ``RuntimeError`` naming the torch function behind ``error`` (module docstring); return if the
    failing op came from none of them."""
    caller = _caller(sys._getframe(1))
    if caller is None:
        return
    kind, name = caller
    if kind == "prune":
        raise RuntimeError(
            f"torch.nn.utils.prune.{name} on a sharded (DTensor) parameter is not supported: pruning builds its "
            "mask with in-place indexing over the whole tensor and renames the parameter to '<name>_orig', which "
            "sharding has already placed. Prune before sharding: in the LightningModule's __init__ or "
            "configure_model (the strategy then shards '<name>_orig' and prune's hook applies '<name>_mask' in "
            "every forward), or before fully_shard / parallelize_module; Lightning's ModelPruning callback prunes "
            "after sharding and is refused for the same reason"
        ) from error
    raise RuntimeError(
        f"torch.nn.init.{name} on a sharded (DTensor) parameter is not supported: it writes single rows and "
        "columns of the whole tensor by plain-tensor indexing, which a parameter sharded along dim 0 cannot take "
        f"in place. Initialise before sharding (in __init__ or configure_model), or on the full value: "
        f"full = p.full_tensor(); nn.init.{name}(full, ...); p.copy_(distribute_tensor(full, p.device_mesh, "
        "[Replicate()] * p.device_mesh.ndim)) (every rank draws the same values from the same seed)"
    ) from error
