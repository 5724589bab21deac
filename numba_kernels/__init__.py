"""Fused staging kernels for the FSDP collectives.

Four steps, each ONE pass over memory per parameter group, over a static
:class:`GroupLayout` built once per group:

* :func:`all_gather_copy_in` - this rank's shard (cast to the compute dtype) into the all-gather input
* :func:`all_gather_copy_out` - all-gather output into the unsharded parameters (unpadding)
* :func:`reduce_scatter_copy_in` - gradients chunked, padded, pre-divided and cast into the reduce-scatter input
* :func:`post_reduce` - reduce-scatter output post-divided, upcast and accumulated into the fp32 grad shard

``impl="auto"`` runs the ``numba.cuda`` kernel for CUDA tensors and the
``numba.njit(parallel=True)`` kernel for CPU tensors; ``"reference"`` is plain torch.

Example::

    >>> import torch
    >>> from numba_kernels import GroupLayout, all_gather_copy_in, all_gather_copy_out
    >>> layout = GroupLayout([(5, 3), (4,)], world_size=2)
    >>> layout.warm("cpu", torch.bfloat16, torch.float32)
    >>> shard = torch.randn(layout.shard_numel)
    >>> ag = torch.empty(2, layout.shard_numel, dtype=torch.bfloat16)
    >>> all_gather_copy_in(layout, shard, ag, rank=0)
"""

from .layout import GroupLayout, warm_kernels
from .ops import all_gather_copy_in, all_gather_copy_out, post_reduce, reduce_scatter_copy_in

__all__ = [
    "GroupLayout",
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "post_reduce",
    "warm_kernels",
]
