"""``simulated_staging_kernels``: inside a simulation, the four staging kernels on fake tensors cost what the
GPU kernels cost: one launch each, no allocation.

Fake tensors carry no data, so ``numba_kernels`` sends them to its plain-torch reference path, a readable loop
over parameters and ranks (several ops per parameter per rank, with float32 temporaries). In a simulation that
loop is most of the host time (tens of thousands of fake ops per step for an 8-B model) and its temporaries
are not what a GPU allocates: the CUDA kernels write their outputs in place and allocate nothing. While the
context is open, the reference functions return at once for fake tensors (their outputs are preallocated by
the caller; a fake tensor has no values to write), and compiling or loading the numba kernels is skipped (the
simulation never launches them). Tensors with data take the reference path unchanged, so the context changes
nothing outside the simulation; ``numba_kernels.ops`` still validates every call (shapes, dtypes, devices)
before it reaches the reference path.

Example::

    with simulated_world(8) as world, simulated_staging_kernels():
        fully_shard(model, mesh=mesh)      # the staging ops run as on a GPU: checked, no allocation
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch._subclasses.fake_tensor import is_fake

__all__ = ["simulated_staging_kernels"]

# reference function -> the position of its output argument (the tensor whose fakeness decides)
_OUTPUT_ARG = {"all_gather_copy_in": 2, "all_gather_copy_out": 2, "reduce_scatter_copy_in": 2, "post_reduce": 2}


@contextlib.contextmanager
def simulated_staging_kernels() -> Iterator[None]:
    """Make the staging kernels' reference path a no-op on fake tensors inside the block (see the module
    docstring)."""
    from numba_kernels import layout, reference

    originals = {name: getattr(reference, name) for name in _OUTPUT_ARG}
    warm = layout.warm_kernels

    def stand_in(name, fn):
        position = _OUTPUT_ARG[name]

        def kernel(*args, **kwargs):
            out = args[position]
            target = out if not isinstance(out, (list, tuple)) else (out[0] if out else None)
            if target is not None and is_fake(target):
                return None
            return fn(*args, **kwargs)

        return kernel

    for name, fn in originals.items():
        setattr(reference, name, stand_in(name, fn))
    layout.warm_kernels = lambda device: None
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(reference, name, fn)
        layout.warm_kernels = warm
