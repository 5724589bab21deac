"""DTensor arguments of one op on a mesh and on a sub-mesh of it (both sliced from one root mesh).

FSDP over TP puts the parameters TP shards on the 2-D ``(data_parallel, tensor_parallel)`` mesh and the ones
it leaves alone (norms, a module outside the TP plan) on the 1-D ``data_parallel`` sub-mesh. User code that
combines them -- ``torch.nn.utils.clip_grad_norm_(self.parameters())``, ``get_total_norm``, a sum of gradient
norms, ``parameters_to_vector`` -- met "DTensor arguments live on different meshes". Such arguments are
aligned onto one mesh, the in-place target's mesh or else the one with the most dims:

* a DTensor on a sub-mesh is **lifted** onto the larger mesh with ``Replicate()`` on the dims it lacks: SPMD
  code keeps such a tensor equal across those ranks (the ranks of one TP group hold the same FSDP-only
  parameters and gradients; the strategy checks the parameters at setup); never onto ``data_parallel``
  (``NEVER_LIFTED_ONTO``: an activation meeting a parameter still sharded by fully_shard raises, naming that);
* a DTensor of the larger mesh that is ``Replicate()`` on every dim the target lacks is **viewed** on the
  target sub-mesh (exact: each rank's local tensor is already the sub-mesh's shard). One sharded or partial
  on such a dim cannot be, and the op raises as before.

The local tensors are not touched, only their specs, so no collective runs here.

Example::

    root = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    a = distribute_tensor(torch.ones(4), root["data_parallel"], [Shard(0)])
    b = distribute_tensor(torch.ones(4), root, [Shard(0), Shard(0)])
    (a + b).device_mesh is root      # a lifted to (Shard(0), Replicate())
"""

from __future__ import annotations

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor.dtensor import DTensor
from lightning_shard.tensor.placements import Placement, Replicate
from lightning_shard.tensor.spec import DTensorSpec

#: A tensor without this dim (an activation on the tensor-parallel mesh) is never lifted onto it: meeting a tensor
#: sharded over it (a parameter still sharded by fully_shard, its module run outside its unit's forward) is the
#: error dispatch's fully_shard hint explains, not a value that is the same on every data-parallel rank.
NEVER_LIFTED_ONTO = "data_parallel"


def align_meshes(flat: list, positions: list[int], target: DeviceMesh) -> bool:
    """Rewrap, in ``flat``, every DTensor at ``positions`` that is not on ``target`` onto it; False (``flat``
    unchanged) when one of them is on a mesh that neither contains ``target`` nor is contained in it."""
    moved = {}
    for i in positions:
        spec = flat[i]._spec
        if spec.mesh == target:
            continue
        placements = _on_target(spec.mesh, spec.placements, target)
        if placements is None:
            return False
        new = DTensorSpec(target, placements, spec.shape, spec.stride, spec.dtype)
        moved[i] = DTensor(flat[i]._local_tensor, new, requires_grad=False)
    for i, t in moved.items():
        flat[i] = t
    return True


def on_mesh(t: DTensor, mesh: DeviceMesh) -> DTensor | None:
    """``t`` on ``mesh`` (lifted or viewed as above, sharing its local tensor), or None if it cannot be."""
    if t._spec.mesh == mesh:
        return t
    flat = [t]
    return flat[0] if align_meshes(flat, [0], mesh) else None


def target_mesh(meshes: list[DeviceMesh], inplace: bool) -> DeviceMesh:
    """The mesh an op's outputs live on: an in-place op's first argument's (its output is that tensor), else the
    one with the most dims (the others may be its sub-meshes)."""
    return meshes[0] if inplace else max(meshes, key=lambda m: m.ndim)


def _on_target(mesh: DeviceMesh, placements: tuple, target: DeviceMesh) -> tuple[Placement, ...] | None:
    names, target_names = mesh.mesh_dim_names, target.mesh_dim_names
    if names is None or target_names is None or mesh.root_mesh is not target.root_mesh:
        return None
    by_name = dict(zip(names, placements))
    if set(names) < set(target_names) and _in_order(names, target_names) and target[names] == mesh:
        if NEVER_LIFTED_ONTO in set(target_names) - set(names):
            return None
        return tuple(by_name.get(n, Replicate()) for n in target_names)  # lift: Replicate on the missing dims
    if set(target_names) < set(names) and _in_order(target_names, names) and mesh[target_names] == target:
        dropped = [by_name[n] for n in names if n not in target_names]
        if all(p.is_replicate() for p in dropped):
            return tuple(by_name[n] for n in target_names)  # view on the sub-mesh: exact
    return None


def _in_order(sub: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """``sub``'s dims appear in ``names`` in the same order (two shardings of one tensor dim keep their order)."""
    where = [names.index(n) for n in sub]
    return where == sorted(where)
