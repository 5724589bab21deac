"""DeviceMesh: an n-dimensional grid of ranks with one process group per mesh dimension.

Mirrors ``torch.distributed.device_mesh`` (same names, arguments and defaults) but is our own, so the
engine owns its process groups and can hand them to torch (``to_torch()``) only at the boundaries that
need torch's type (DCP checkpoints, interop).

Example::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tp = mesh["tensor_parallel"]          # 1-D sub-mesh, reuses the parent's groups
    tp.get_local_rank(), tp.size()        # e.g. (1, 2)

Process groups are created collectively: every rank calls ``dist.new_group`` for every group of every
mesh dimension in the same order (torch requires this). Groups are cached by their rank lists, so
building the same mesh twice (common in tests and in Lightning re-setup) creates no new groups.

The groups of an accelerator mesh carry CPU tensors too (backend ``"cpu:gloo,cuda:nccl"``, torch's default
for ``init_process_group()``): gradient clipping and full state dicts of CPU-offloaded shards reduce CPU
tensors over the mesh's groups. The device type is ``"cpu"``, ``"cuda"``, or the simulator's stand-in
accelerator (``lightning_shard.device``).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from lightning_shard import comm
from lightning_shard.device import handle_for

__all__ = ["DeviceMesh", "init_device_mesh", "group_backend", "world_timeout"]


def _real_tensors(fn):
    """Run ``fn`` outside any dispatch mode: the rank grid is metadata, a real CPU tensor even when a
    ``FakeTensorMode`` is active (the simulator; torch's DeviceMesh does the same)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return wrapper


# (default-group identity, ranks of every group of one mesh dim) -> the group this rank belongs to.
_GROUP_CACHE: dict[tuple, dist.ProcessGroup | None] = {}


class DeviceMesh:
    """A grid of global ranks with named dimensions and one process group per dimension.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (no index).
        mesh: integer tensor or nested list of global ranks; its shape is the mesh shape.
        mesh_dim_names: one unique name per mesh dimension, e.g. ``("data_parallel", "tensor_parallel")``.

    Example::

        mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        mesh.shape, mesh["tp"].get_group()

    On one rank:

    >>> mesh = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "tp"))
    >>> mesh.shape, mesh["tp"].shape, mesh["tp"].get_group().size(), mesh.get_local_rank("tp")
    ((1, 1), (1,), 1, 0)
    """

    @_real_tensors
    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
        _groups: list[dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.device_type = _check_device_type(device_type)
        self.mesh = torch.as_tensor(mesh, dtype=torch.int64, device="cpu").detach().clone()
        if self.mesh.ndim == 0:
            raise ValueError(f"DeviceMesh: mesh must have at least one dimension, got a scalar {self.mesh}")
        self.mesh_dim_names = _check_dim_names(mesh_dim_names, self.mesh.ndim)
        flat = self.mesh.flatten().tolist()
        if len(set(flat)) != len(flat):
            raise ValueError(f"DeviceMesh: mesh {self.mesh.tolist()} lists a rank twice")
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._coordinate = _coordinate_of(self.mesh, self._rank)
        self._groups = _groups if _groups is not None else [self._new_group(d) for d in range(self.ndim)]
        self._root: DeviceMesh | None = None  # the mesh this one was sliced from (see root_mesh)

    # ------------------------------------------------------------------ shape
    @property
    def ndim(self) -> int:
        """Number of mesh dimensions."""
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape, e.g. ``(2, 2)``."""
        return tuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the whole mesh, or along ``mesh_dim`` (index or name)."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self._dim_index(mesh_dim)]

    # ------------------------------------------------------------------ ranks
    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate in the mesh, or ``None`` if the rank is not part of it."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (optional on a 1-D mesh)."""
        dim = self._dim_or_only(mesh_dim, "get_local_rank")
        if self._coordinate is None:
            raise RuntimeError(f"DeviceMesh.get_local_rank: rank {self._rank} is not in mesh {self.mesh.tolist()}")
        return self._coordinate[dim]

    # ------------------------------------------------------------------ groups
    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """The process group of ``mesh_dim`` that contains this rank (optional on a 1-D mesh)."""
        group = self._groups[self._dim_or_only(mesh_dim, "get_group")]
        if group is None:
            raise RuntimeError(f"DeviceMesh.get_group: rank {self._rank} is not in mesh {self.mesh.tolist()}")
        return group

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        """One process group per mesh dimension, in dimension order."""
        return [self.get_group(d) for d in range(self.ndim)]

    # ------------------------------------------------------------------ slicing
    @_real_tensors
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """Sub-mesh over the named dimensions, containing this rank; reuses the parent's groups.

        Example: ``mesh["tensor_parallel"]`` or ``mesh["replicate", "data_parallel"]``.
        """
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names:
            raise ValueError("DeviceMesh[...]: name at least one mesh dimension")
        dims = [self._dim_index(n) for n in names]
        if len(set(dims)) != len(dims):
            raise ValueError(f"DeviceMesh[...]: dimension names {names} repeat a dimension")
        if dims == list(range(self.ndim)):
            return self
        if self._coordinate is None:
            raise RuntimeError(f"DeviceMesh[{names}]: rank {self._rank} is not in mesh {self.mesh.tolist()}")
        # Fix the coordinates of the dims not selected to this rank's, keep the selected ones whole.
        kept = sorted(dims)
        index = tuple(slice(None) if d in kept else self._coordinate[d] for d in range(self.ndim))
        sub = self.mesh[index].permute([kept.index(d) for d in dims])
        child = DeviceMesh(self.device_type, sub, mesh_dim_names=names, _groups=[self._groups[d] for d in dims])
        child._root = self._root or self
        return child

    @_real_tensors
    def split_group(self, mesh_dim: int | str | None, size: int) -> dist.ProcessGroup:
        """The group of this rank's ``size`` consecutive neighbours along ``mesh_dim``.

        ``mesh_dim`` is cut into blocks of ``size`` ranks (FSDP resharding to the ranks of one node after
        forward). Every such group of the root mesh is created, in the same order on every rank, and cached.

        Example: on ``init_device_mesh("cpu", (4,))``, ``split_group(0, 2)`` is ranks {0, 1} or {2, 3}.
        """
        dim = self._dim_or_only(mesh_dim, "split_group")
        n = self.mesh.shape[dim]
        if size < 1 or n % size:
            raise ValueError(f"DeviceMesh.split_group: size {size} does not divide mesh dimension {dim} of size {n}")
        root = self.root_mesh
        root_dim = root._dim_index(self.mesh_dim_names[dim]) if root is not self else dim
        blocks = root.mesh.movedim(root_dim, -1).reshape(-1, size).tolist()
        backend = group_backend(self.device_type)
        key = ("split", id(dist.group.WORLD), dist.get_world_size(), backend, tuple(map(tuple, blocks)))
        if key not in _GROUP_CACHE:
            mine = None
            for ranks in blocks:
                group = _new_group(ranks, backend)
                if self._rank in ranks:
                    mine = group
            _GROUP_CACHE[key] = mine
        return _GROUP_CACHE[key]

    @property
    def root_mesh(self) -> DeviceMesh:
        """The mesh this one was sliced from (itself if it was not sliced), e.g. to combine the
        data-parallel and tensor-parallel sub-meshes of FSDP over TP back into one 2-D mesh."""
        return self._root or self

    # ------------------------------------------------------------------ interop
    @_real_tensors
    def to_torch(self) -> torch.distributed.device_mesh.DeviceMesh:
        """The same mesh as torch's ``DeviceMesh``, over the same process groups (no new groups).

        Example: ``torch_dtensor = DTensor.from_local(t, mesh.to_torch(), [Shard(0)])`` (torch's DTensor).
        """
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        groups = self.get_all_groups()
        names = self.mesh_dim_names or tuple(f"dim_{d}" for d in range(self.ndim))
        if self.ndim == 1:
            return TorchDeviceMesh.from_group(groups[0], self.device_type, mesh=self.mesh, mesh_dim_names=names)
        return TorchDeviceMesh.from_group(groups, self.device_type, mesh=self.mesh, mesh_dim_names=names)

    @classmethod
    def from_torch(cls, torch_mesh: torch.distributed.device_mesh.DeviceMesh) -> DeviceMesh:
        """Our mesh over the process groups of torch's ``DeviceMesh`` ``torch_mesh`` (no new groups)."""
        groups = [torch_mesh.get_group(d) for d in range(torch_mesh.ndim)]
        return cls(torch_mesh.device_type, torch_mesh.mesh, mesh_dim_names=torch_mesh.mesh_dim_names, _groups=groups)

    # ------------------------------------------------------------------ misc
    def __deepcopy__(self, memo: dict) -> DeviceMesh:
        """A mesh names process groups, which exist once per process: a deep copy of a model (an EMA or
        teacher copy, Lightning's ``StochasticWeightAveraging``) shares its mesh, as it shares its devices."""
        return self

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    @_real_tensors
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True  # the common case (every DTensor of a model shares its mesh): skip the tensor compare
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (
            self.device_type == other.device_type
            and self.mesh_dim_names == other.mesh_dim_names
            and torch.equal(self.mesh, other.mesh)
        )

    @_real_tensors
    def __hash__(self) -> int:
        return hash((self.device_type, self.mesh_dim_names, tuple(self.mesh.flatten().tolist()), self.shape))

    def _dim_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise ValueError(
                    f"DeviceMesh: no dimension named {mesh_dim!r}; this mesh's dimensions are {self.mesh_dim_names}"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"DeviceMesh: mesh_dim {mesh_dim} is out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def _dim_or_only(self, mesh_dim: int | str | None, what: str) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"DeviceMesh.{what}: pass mesh_dim on a {self.ndim}-D mesh {self.shape}")
            return 0
        return self._dim_index(mesh_dim)

    def _new_group(self, dim: int) -> dist.ProcessGroup | None:
        """Create (collectively, in the same order on every rank) the groups along ``dim``."""
        if not dist.is_initialized():
            raise RuntimeError("DeviceMesh: torch.distributed is not initialized; use init_device_mesh()")
        lines = self.mesh.movedim(dim, -1).reshape(-1, self.mesh.shape[dim]).tolist()
        backend = group_backend(self.device_type)
        key = (id(dist.group.WORLD), dist.get_world_size(), backend, tuple(map(tuple, lines)))
        if key not in _GROUP_CACHE:
            mine = None
            for ranks in lines:
                if ranks == list(range(dist.get_world_size())) and backend is None:
                    group = dist.group.WORLD  # a dim spanning the world in order: no new group needed
                else:
                    group = _new_group(ranks, backend)
                if self._rank in ranks:
                    mine = group
            _GROUP_CACHE[key] = mine
        return _GROUP_CACHE[key]


@_real_tensors
def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    rank_order: Sequence[int] | None = None,
) -> DeviceMesh:
    """Build a mesh of shape ``mesh_shape`` over all ranks (row-major), initialising the default process
    group from the environment (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, as torchrun and
    SLURM launchers set) when it does not exist yet, or as a single process when those are unset.

    ``rank_order`` (not in torch's signature) lays the mesh over the global ranks in that order instead of
    ``0..world-1``: the ranks listed node by node when the launcher did not number them so (SLURM's cyclic
    distribution), so that the innermost dimension (tensor parallel) stays within a node.

    Every check runs locally before any collective, so bad input raises the same ``ValueError`` on every
    rank instead of hanging.

    Example::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))

    On one rank (a single process needs no launcher):

    >>> init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    DeviceMesh('cpu', [[0]], mesh_dim_names=('data_parallel', 'tensor_parallel'))
    """
    device_type = _check_device_type(device_type)
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or not all(isinstance(s, int) and s > 0 for s in mesh_shape):
        raise ValueError(f"init_device_mesh: mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape}")
    _check_dim_names(mesh_dim_names, len(mesh_shape))
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if math.prod(mesh_shape) != world_size:
        raise ValueError(
            f"init_device_mesh: mesh_shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but the world size "
            f"is {world_size}; choose a shape whose product is {world_size}"
        )
    if dist.is_initialized():
        _check_backend_supports(device_type)
    else:
        _init_default_group(device_type)
    _set_device_if_unset(device_type)
    mesh = _rank_grid(world_size, rank_order).reshape(mesh_shape)
    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names)


def _rank_grid(world_size: int, rank_order: Sequence[int] | None) -> torch.Tensor:
    """``rank_order`` (default ``0..world_size-1``) as a tensor, checked to hold every rank exactly once."""
    if rank_order is None:
        return torch.arange(world_size, dtype=torch.int64)
    order = [int(r) for r in rank_order]
    if sorted(order) != list(range(world_size)):
        raise ValueError(f"init_device_mesh: rank_order {order} must list every rank 0..{world_size - 1} exactly once")
    return torch.tensor(order, dtype=torch.int64)


def _new_group(ranks: list[int], backend: str | None) -> dist.ProcessGroup | None:
    """The group of ``ranks`` whose group rank is the position in ``ranks``, i.e. the mesh coordinate.

    ``dist.new_group`` sorts the ranks by default: on a mesh line such as ``[0, 2, 1, 3]`` (the ranks listed node
    by node, see ``init_device_mesh(rank_order=...)``) rank 2 would be group rank 2 but mesh coordinate 1, and every
    all-gather would assemble the shards in another order than the DTensor's placements say (a wrong result, no
    error). ``sort_ranks=False`` only where it changes something: torch's TorchComms path refuses it.
    """
    keep_order = {} if ranks == sorted(ranks) else {"sort_ranks": False}
    return dist.new_group(ranks, backend=backend, timeout=world_timeout(), **keep_order)


def group_backend(device_type: str) -> str | None:
    """The backend for new groups of a ``device_type`` mesh: None (inherit the default group's) when the
    default group already serves both the device and CPU, else the device's CPU-capable backend.

    >>> group_backend("cpu"), group_backend("cuda")   # a gloo default group serves both
    (None, None)
    >>> group_backend("cpu"), group_backend("cuda")   # Lightning's NCCL-only default group  # doctest: +SKIP
    (None, 'cpu:gloo,cuda:nccl')
    """
    if device_type == "cpu" or {device_type, "cpu"} <= comm.served_device_types(dist.group.WORLD):
        return None
    return handle_for(device_type).cpu_capable_backend


def world_timeout() -> timedelta | None:
    """The default group's timeout, given to every group a mesh creates.

    ``dist.new_group`` without a timeout gives a group its backend's default (30 minutes on gloo and NCCL),
    whatever the default group was created with; torch's own DeviceMesh does that. A rank left waiting in a
    collective of a sub-group (tensor parallel, a data-parallel dim that is not the whole world) for a peer
    that failed would then wait 30 minutes, not the ``timeout`` the user gave ``init_process_group`` (the
    Lightning strategy's ``timeout=``). None (the backend's default) when the default group does not say.

    >>> dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # at a process's start  # doctest: +SKIP
    >>> world_timeout()  # doctest: +SKIP
    datetime.timedelta(seconds=60)
    """
    world = dist.group.WORLD
    timeouts = []
    for device_type in sorted(comm.served_device_types(world)):
        try:
            timeouts.append(world._get_backend(torch.device(device_type)).options._timeout)
        except Exception:  # noqa: BLE001 - a fake or custom backend without options: the backend's default
            continue
    return min(timeouts) if timeouts else None


def _set_device_if_unset(device_type: str) -> None:
    """As torch's DeviceMesh: choose this process's accelerator only if it has not chosen one yet
    (Lightning's ``set_device(parallel_devices[local_rank])`` and a user's ``torch.cuda.set_device`` win)."""
    handle = handle_for(device_type)
    if device_type == "cpu" or handle.device_is_set():
        return
    # srun sets no LOCAL_RANK; its SLURM_LOCALID is the same index. The global rank modulo the device count (torch's
    # fallback) gives two ranks of a node the same device when srun deals the ranks round-robin over the nodes.
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID"))
    if local is not None:
        handle.set_device(int(local))
    else:
        handle.set_device(dist.get_rank() % max(1, handle.device_count()))


def _init_default_group(device_type: str) -> None:
    backend = handle_for(device_type).cpu_capable_backend
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    else:  # a plain single-process script: a group of one over an in-memory store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _check_device_type(device_type: str) -> str:
    try:
        handle = handle_for(device_type) if isinstance(device_type, str) and ":" not in device_type else None
    except (ValueError, RuntimeError):
        handle = None
    if handle is None or device_type == "meta":
        raise ValueError(
            f"DeviceMesh: device_type {device_type!r} is not supported; use 'cpu' or 'cuda' (without an index)"
        )
    if not handle.is_available():
        raise ValueError(
            f"DeviceMesh: device_type {device_type!r} was asked for but {device_type.upper()} is not available; "
            "use 'cpu'"
        )
    return device_type


def _check_backend_supports(device_type: str) -> None:
    served = comm.served_device_types(dist.group.WORLD)
    if device_type not in served:
        backend = dist.get_backend_config()
        wanted = handle_for(device_type).backend
        raise ValueError(
            f"init_device_mesh: device_type {device_type!r} does not match the process group backend "
            f"{backend!r}, which serves {sorted(served)}; use one of those device types or init the process "
            f"group with backend {wanted!r}"
        )


def _check_dim_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(f"DeviceMesh: mesh_dim_names {names} has {len(names)} names for a {ndim}-D mesh")
    if len(set(names)) != len(names):
        raise ValueError(f"DeviceMesh: mesh_dim_names {names} repeats a name; each dimension needs its own")
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"DeviceMesh: mesh_dim_names {names} must be non-empty strings")
    return names


@_real_tensors
def _coordinate_of(mesh: torch.Tensor, rank: int) -> tuple[int, ...] | None:
    hits = (mesh == rank).nonzero()
    return tuple(hits[0].tolist()) if len(hits) else None
