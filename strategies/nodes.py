"""Which node each rank runs on: the checks of ``Trainer(devices=..., num_nodes=...)`` against the world the
launcher started, and the rank order the device mesh is built in.

The mesh puts consecutive entries of its rank order into one tensor-parallel group (and, under
``HYBRID_SHARD``, into one shard group), so that order must list the ranks node by node. torchrun and Lightning's
own launcher number ranks that way; SLURM need not (``srun --distribution=cyclic`` gives ``SLURM_PROCID`` 0 and 1
to different nodes), and a mesh laid out by global rank would then put every TP group across nodes (correct, but
each TP collective crosses the network). The order therefore comes from the cluster environment's node and local
ranks, gathered once at setup.

Example::

    check_world(num_nodes=2, devices=2, world=4, node_rank=1, local_rank=0, environment="SLURMEnvironment")
    order = node_major_ranks(node_rank=1, local_rank=0, num_nodes=2, devices=2)  # e.g. [0, 2, 1, 3]
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_shard import comm

__all__ = ["check_launched_world", "check_world", "node_major_ranks", "tp_crosses_nodes"]


def check_world(*, num_nodes: int, devices: int, world: int, node_rank: int, local_rank: int, environment: str) -> None:
    """Raise ``ValueError`` when the launched world does not match ``devices x num_nodes``.

    Local values only (no collective), so every rank raises before the process group or the mesh could wait for a
    peer that was never started.
    """
    fix = (
        "pass Trainer(devices=<processes per node>, num_nodes=<nodes>) as launched (torchrun --nproc-per-node and "
        "--nnodes, srun --ntasks-per-node and --nodes)"
    )
    if world != num_nodes * devices:
        raise ValueError(
            f"shard_fsdp_tp: devices={devices} x num_nodes={num_nodes} = {num_nodes * devices} processes, but "
            f"{environment} reports a world size of {world}; {fix}"
        )
    if not 0 <= local_rank < devices:
        raise ValueError(
            f"shard_fsdp_tp: {environment} reports local rank {local_rank}, but devices={devices} allows local ranks "
            f"0..{devices - 1}; {fix}"
        )
    if not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"shard_fsdp_tp: {environment} reports node rank {node_rank}, but num_nodes={num_nodes} allows node "
            f"ranks 0..{num_nodes - 1}; {fix}"
        )


def check_launched_world(strategy) -> None:
    """``check_world`` for a Lightning strategy (Trainer or Fabric) whose processes an external launcher (torchrun,
    SLURM) started: its ``devices`` x ``num_nodes`` against the process group's size when it exists, else the
    cluster environment's, with the environment's node and local ranks."""
    env = strategy.cluster_environment
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else env.world_size()
    check_world(
        num_nodes=strategy.num_nodes, devices=strategy.num_processes, world=world, node_rank=env.node_rank(),
        local_rank=env.local_rank(), environment=type(env).__name__,
    )  # fmt: skip


def node_major_ranks(*, node_rank: int, local_rank: int, num_nodes: int, devices: int) -> list[int]:
    """The global ranks ordered by (node rank, local rank): the order the mesh lays its dimensions over.

    One all-gather of two integers on the default group. Every rank checks the same gathered list, so a layout that
    is not ``devices`` ranks with distinct local ranks on each of ``num_nodes`` nodes raises the same
    ``ValueError`` everywhere. On one rank, or on the simulator's fake process group (no data), the global rank
    order.
    """
    world = dist.get_world_size()
    if world == 1 or not comm.carries_data():
        return list(range(world))
    places = [tuple(p) for p in comm.all_gather_objects((node_rank, local_rank))]
    expected = sorted((n, r) for n in range(num_nodes) for r in range(devices))
    if sorted(places) != expected:
        by_rank = ", ".join(f"rank {g}: node {n} local {r}" for g, (n, r) in enumerate(places))
        raise ValueError(
            f"shard_fsdp_tp: the launched ranks are not {devices} per node on {num_nodes} nodes with distinct local "
            f"ranks ({by_rank}); check the launcher's node and local ranks (NODE_RANK/GROUP_RANK/SLURM_NODEID, "
            "LOCAL_RANK/SLURM_LOCALID) and Trainer(devices=..., num_nodes=...)"
        )
    return sorted(range(world), key=places.__getitem__)


def tp_crosses_nodes(tensor_parallel_size: int, devices: int, num_nodes: int) -> bool:
    """True when some tensor-parallel group must span two nodes: more TP ranks than a node holds, or a TP size
    that does not divide the devices of a node."""
    return num_nodes > 1 and tensor_parallel_size > 1 and devices % tensor_parallel_size != 0
