"""lightning_shard: our sharding engine (DeviceMesh, DTensor, FSDP, TP, checkpoints).

Example::

    from lightning_shard import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
"""

from lightning_shard.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
