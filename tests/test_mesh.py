"""DeviceMesh on real gloo process groups (1, 2 and 4 ranks), compared with torch's own DeviceMesh."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_shard import DeviceMesh, init_device_mesh
from tests.harness import distributed

DIMS2 = ("data_parallel", "tensor_parallel")


def _all_gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _group_ranks(group):
    return dist.get_process_group_ranks(group)


@distributed(world_size=1)
def test_1d_mesh_one_rank():
    mesh = init_device_mesh("cpu", (1,))
    assert mesh.ndim == 1 and mesh.shape == (1,) and mesh.size() == 1 and mesh.size(0) == 1
    assert mesh.get_local_rank() == 0 and mesh.get_coordinate() == [0] and mesh.get_rank() == 0
    assert _group_ranks(mesh.get_group()) == [0]
    assert mesh.mesh_dim_names is None


@distributed(world_size=2)
def test_1d_mesh_two_ranks_matches_torch():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    ref = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    assert mesh.shape == tuple(ref.shape) == (2,)
    assert mesh.get_local_rank() == ref.get_local_rank() == rank
    assert mesh.get_coordinate() == list(ref.get_coordinate())
    assert mesh.size("data_parallel") == 2
    assert mesh["data_parallel"] is mesh
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=mesh.get_group("data_parallel"))
    assert t.item() == 3.0


@distributed(world_size=4)
def test_2d_mesh_groups_coordinates_and_slices_match_torch():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS2)
    ref = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS2)
    assert mesh.shape == (2, 2) and mesh.ndim == 2 and mesh.size() == 4
    assert mesh.get_coordinate() == list(ref.get_coordinate()) == [rank // 2, rank % 2]
    for name in DIMS2:
        assert mesh.get_local_rank(name) == ref.get_local_rank(name)
        assert _group_ranks(mesh.get_group(name)) == _group_ranks(ref.get_group(name))
        sub, ref_sub = mesh[name], ref[name]
        assert sub.ndim == 1 and sub.mesh.tolist() == ref_sub.mesh.tolist()
        assert sub.get_local_rank() == ref_sub.get_local_rank()
        assert sub.mesh_dim_names == (name,)
    assert mesh.get_local_rank(0) == rank // 2 and mesh.get_local_rank(1) == rank % 2
    assert len(mesh.get_all_groups()) == 2
    # The groups really communicate along their dimension only.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("tensor_parallel"))
    assert t.item() == (rank // 2) * 4 + 1
    # Reordered slice: dims swapped.
    swapped = mesh["tensor_parallel", "data_parallel"]
    assert swapped.mesh.tolist() == mesh.mesh.t().tolist()
    assert swapped.get_coordinate() == [rank % 2, rank // 2]


@distributed(world_size=4)
def test_3d_mesh_and_2d_submesh():
    rank = dist.get_rank()
    names = ("replicate", "data_parallel", "tensor_parallel")
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=names)
    ref = torch.distributed.device_mesh.init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=names)
    assert mesh.get_coordinate() == list(ref.get_coordinate())
    for name in names:
        assert _group_ranks(mesh.get_group(name)) == _group_ranks(ref.get_group(name))
    sub = mesh["replicate", "data_parallel"]
    ref_sub = ref["replicate", "data_parallel"]
    assert sub.shape == (1, 2) and sub.mesh.tolist() == ref_sub.mesh.tolist()
    assert sub.get_coordinate() == list(ref_sub.get_coordinate())
    assert mesh.size(2) == 2 and mesh.get_local_rank("tensor_parallel") == rank % 2


@distributed(world_size=2)
def test_group_cache_reuses_groups():
    a = init_device_mesh("cpu", (2,))
    b = init_device_mesh("cpu", (2,))
    assert a.get_group() is b.get_group()
    assert a == b and hash(a) == hash(b)


@distributed(world_size=4)
def test_to_torch_and_back_share_groups():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS2)
    tm = mesh.to_torch()
    assert tm.mesh_dim_names == DIMS2 and tm.mesh.tolist() == mesh.mesh.tolist()
    for name in DIMS2:
        assert tm.get_group(name) is mesh.get_group(name)
        assert tm[name].get_local_rank() == mesh[name].get_local_rank()
    back = DeviceMesh.from_torch(tm)
    assert back == mesh and back.get_group("tensor_parallel") is mesh.get_group("tensor_parallel")
    one_d = mesh["data_parallel"].to_torch()
    assert one_d.get_group() is mesh.get_group("data_parallel")
    # torch's DTensor runs over the converted mesh.
    from torch.distributed.tensor import Shard, distribute_tensor

    x = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(distribute_tensor(x, one_d, [Shard(0)]).full_tensor(), x)


@distributed(world_size=2, fresh=True)
def test_init_from_environment_when_no_group_exists():
    assert not dist.is_initialized()
    mesh = init_device_mesh("cpu", (2,))
    assert dist.is_initialized() and dist.get_world_size() == 2
    ranks = _all_gather_objects(mesh.get_local_rank())
    assert ranks == [0, 1]
    dist.destroy_process_group()


@distributed(world_size=2, fresh=True)
def test_mesh_groups_get_the_default_groups_timeout():
    """Every group a mesh creates gets the default group's timeout: with gloo's 30-minute default a rank waiting
    in a sub-group (tensor parallel) for a failed peer waits that long (tests/test_faults_exceptions.py, slow,
    waits it out on 4 ranks). Fresh processes of its own: initialising the default group a second time in one
    process, on the same store address, timed out connecting under load."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=15))
    try:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        group = mesh.get_group("tensor_parallel")  # one rank per group: a group of its own, not the world's
        assert group is not dist.group.WORLD
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=15)
    finally:
        dist.destroy_process_group()


@distributed(world_size=4)
def test_bad_input_raises_same_error_on_every_rank():
    errors = []
    for call, expected in [
        (lambda: init_device_mesh("cpu", (3,)), "product is 4"),
        (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a")), "repeats a name"),
        (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",)), "1 names for a 2-D mesh"),
        (lambda: init_device_mesh("cpu", (0, 4)), "positive ints"),
        (lambda: init_device_mesh("tpu", (4,)), "'tpu' is not supported"),
        (lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS2)["x"], "no dimension named 'x'"),
        (lambda: init_device_mesh("cpu", (2, 2)).get_group(), "pass mesh_dim on a 2-D mesh"),
        (lambda: init_device_mesh("cpu", (2, 2)).size(2), "out of range"),
    ]:
        with pytest.raises(ValueError, match=expected) as info:
            call()
        errors.append(str(info.value))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            init_device_mesh("cuda", (4,))
    # Same messages everywhere, and the group still works afterwards (nobody hung in a collective).
    assert len(set(map(tuple, _all_gather_objects(errors)))) == 1


@distributed(world_size=2)
def test_backend_mismatch_is_reported():
    import lightning_shard.mesh as mesh_mod
    from lightning_shard import comm

    original = dist.get_backend_config
    mesh_mod.dist.get_backend_config = lambda *a: "cuda:nccl"
    comm._SERVED.clear()
    try:
        with pytest.raises(ValueError, match="does not match the process group backend 'cuda:nccl'"):
            init_device_mesh("cpu", (2,))
    finally:
        mesh_mod.dist.get_backend_config = original
        comm._SERVED.clear()


@distributed(world_size=4)
def test_submesh_remembers_its_root():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS2)
    assert mesh.root_mesh is mesh
    assert mesh["data_parallel"].root_mesh is mesh and mesh["tensor_parallel"].root_mesh is mesh
    assert mesh["tensor_parallel", "data_parallel"].root_mesh is mesh


@distributed(world_size=4)
def test_split_group_blocks_of_neighbours_on_a_full_and_a_sliced_mesh():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("data_parallel",))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.split_group("data_parallel", 2))
    assert t.item() == (1.0 if rank < 2 else 5.0)  # {0, 1} or {2, 3}
    # On a slice, the blocks follow the slice's line of the root mesh: dp lines of (dp=2, tp=2) are [0,2], [1,3].
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh2["data_parallel"].split_group(0, 2))
    assert t.item() == (2.0 if rank in (0, 2) else 4.0)
    with pytest.raises(ValueError, match="size 3 does not divide"):
        mesh.split_group(0, 3)
