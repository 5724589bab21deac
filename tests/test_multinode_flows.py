"""Multi-node launches simulated on one machine: ``Trainer(num_nodes=2, devices=2)`` on 4 gloo ranks whose
environment says which node each runs on, as torchrun (``GROUP_RANK``, ``LOCAL_RANK``) or SLURM (``SLURM_NODEID``,
``SLURM_LOCALID``, ``SLURM_PROCID``) sets it, so Lightning picks ``TorchElasticEnvironment`` or
``SLURMEnvironment``. Each flow is compared with one process on the same global batches:

* the mesh: tensor-parallel groups and ``HYBRID_SHARD``'s shard groups hold the ranks of one node, data
  parallelism and the replicas run across nodes, also when SLURM numbers the ranks cyclically (rank 0 and 1 on
  different nodes; a mesh laid out by global rank put every TP group across the two nodes); the mesh is then laid
  over the ranks node by node, and a mesh line out of rank order (FSDP 4's ``[0, 2, 1, 3]``) must keep its order in
  its process group (``dist.new_group`` sorts by default; with a sorted group, ``reshard_after_forward=2`` on that
  line trains 4.3 away from one process, without an error);
* checkpoints: a sharded checkpoint written on 2 nodes (TP 2 x DP 2, HYBRID_SHARD with its 2 replicas) resumes on
  1 node x 2 ranks and on 1 process, equal to one process training on; a full checkpoint is written by global
  rank 0 alone;
* a launched world that is not ``devices x num_nodes`` (or node and local ranks that do not tile the nodes) raises
  a ``ValueError`` on every rank at ``Trainer(...)`` or setup, before any collective could wait for a missing rank;
* ``ModelCheckpoint`` on node-local disks (sharded): every rank raises, nothing is published (the engine's side and
  resuming from a path one rank cannot see are tests/test_faults_shared_fs.py's);
* SLURM's auto-requeue resumes from the last published ``hpc_ckpt_<n>.ckpt`` when a save the requeue interrupted
  left its temp dir (whose name Lightning reads as a larger version);
* ``slow``: two real torchrun agents (``--nnodes=2 --nproc-per-node=2``, c10d rendezvous) on localhost, and the
  checkpoints of FSDP 4 (its mesh line out of rank order in DCP) and of HYBRID_SHARD.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

import strategies
import strategies.strategy as strategy_module
from strategies import nodes
from tests.harness import distributed, run_distributed
from tests.lightning_models import LitGPT, reference_params
from tests.test_checkpoint_interop_fsdp import epochs
from tests.test_checkpoint_interop_fsdp_sharded import LR, AdamGPT, _optim_state, _params, reference
from tests.test_strategy import _trainer

# TP shards reduce in another order than one process. AdamW (lr 0.01) amplifies that rounding where gradients are
# near zero: one process's own float32 epoch lies up to 1.0e-4 from the same epoch in float64 on the Llama model
# (measured on an AMD EPYC; matmuls round differently from one CPU to another), while a wrong shard or reduction
# moves parameters by 1e-3 and more.
TP_TOL = 2e-4
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
_LAUNCH_VARS += ("TORCHELASTIC_RUN_ID",)


@contextmanager
def _environment(values: dict[str, object]) -> Iterator[None]:
    """This rank's launcher variables replaced by ``values``, restored afterwards (the worker runs other tests
    next; a monkeypatch fixture pickled into a worker is never undone)."""
    saved = dict(os.environ)
    for key in _LAUNCH_VARS:
        os.environ.pop(key, None)
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _torchrun(node: int, local: int, per_node: int = 2, nodes_: int = 2) -> dict[str, object]:
    """torchrun's variables: ranks numbered node by node (``RANK = GROUP_RANK * nproc + LOCAL_RANK``)."""
    return dict(RANK=dist.get_rank(), LOCAL_RANK=local, WORLD_SIZE=dist.get_world_size(),
                LOCAL_WORLD_SIZE=per_node, GROUP_RANK=node, TORCHELASTIC_RUN_ID="multinode",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["MASTER_PORT"])  # fmt: skip


def _slurm(node: int, local: int, per_node: int = 2, nodes_: int = 2) -> dict[str, object]:
    """srun's variables (no torchrun variables: SLURM sets none of them)."""
    return dict(SLURM_NTASKS=dist.get_world_size(), SLURM_PROCID=dist.get_rank(), SLURM_LOCALID=local,
                SLURM_NODEID=node, SLURM_NNODES=nodes_, SLURM_NTASKS_PER_NODE=per_node, SLURM_JOB_NAME="train",
                SLURM_JOB_ID=4242, SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=os.environ["MASTER_PORT"])  # fmt: skip


# global rank -> (node, local rank): torchrun and Lightning number node by node; srun --distribution=cyclic deals
# the ranks round-robin over the nodes
LAYOUTS = {
    "torchrun": (_torchrun, lambda r: (r // 2, r % 2), TorchElasticEnvironment),
    "slurm_block": (_slurm, lambda r: (r // 2, r % 2), SLURMEnvironment),
    "slurm_cyclic": (_slurm, lambda r: (r % 2, r // 2), SLURMEnvironment),
}


def _launched(layout: str):
    make, place, _ = LAYOUTS[layout]
    return _environment(make(*place(dist.get_rank())))


def _nodes_of(group: dist.ProcessGroup, node: int) -> set[int]:
    """The node of every rank of ``group``."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, node)
    return {everyone[r] for r in dist.get_process_group_ranks(group)}


def _two_nodes(strategy, **kwargs) -> L.Trainer:
    return _trainer(devices=2, num_nodes=2, strategy=strategy, **kwargs)


# ------------------------------------------------------------------ mesh layout
@pytest.mark.parametrize("layout", ["torchrun", "slurm_cyclic"])
@distributed(world_size=4)
def test_tp_groups_stay_within_a_node_and_train_like_one_process(layout):
    """TP 2 over the 2 local ranks of each node, data parallel across the nodes."""
    node, _ = LAYOUTS[layout][1](dist.get_rank())
    with _launched(layout):
        module = LitGPT(arch="llama")
        trainer = _two_nodes(strategies.ShardFSDPTPStrategy(tensor_parallel_size=2), max_steps=3)
        trainer.fit(module)
        assert isinstance(trainer.strategy.cluster_environment, LAYOUTS[layout][2])
    mesh = trainer.strategy.device_mesh
    assert _nodes_of(mesh.get_group("tensor_parallel"), node) == {node}
    assert _nodes_of(mesh.get_group("data_parallel"), node) == {0, 1}
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    ref = reference_params(3, world=2, arch="llama")  # 2 data-parallel ranks of 4 samples each
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < TP_TOL


@distributed(world_size=4)
def test_fabric_tp_groups_stay_within_a_node():
    node, _ = LAYOUTS["slurm_cyclic"][1](dist.get_rank())
    with _launched("slurm_cyclic"):
        strategy = strategies.ShardFSDPTPFabricStrategy(tensor_parallel_size=2)
        fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy)
        fabric.launch()
    mesh = fabric.strategy.engine.device_mesh
    assert _nodes_of(mesh.get_group("tensor_parallel"), node) == {node}
    assert _nodes_of(mesh.get_group("data_parallel"), node) == {0, 1}


@pytest.mark.parametrize("layout", ["slurm_block", "slurm_cyclic"])
@distributed(world_size=4)
def test_hybrid_shard_shards_within_a_node_and_replicates_across_nodes(layout):
    node, _ = LAYOUTS[layout][1](dist.get_rank())
    with _launched(layout):
        module = LitGPT()
        trainer = _two_nodes(strategies.ShardFSDPTPStrategy(sharding_strategy="HYBRID_SHARD"), max_steps=3)
        trainer.fit(module)
    mesh = trainer.strategy.device_mesh
    assert mesh.shape == (2, 2, 1)
    assert _nodes_of(mesh.get_group("data_parallel"), node) == {node}  # the shard group
    assert _nodes_of(mesh.get_group("replicate"), node) == {0, 1}
    local = module.model.blocks[0].up.weight.to_local()  # half the rows: sharded over the node's 2 ranks ...
    assert local.shape[0] * 2 == module.model.blocks[0].up.weight.shape[0]
    replicas = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(replicas, local, group=mesh.get_group("replicate"))
    assert torch.equal(replicas[0], replicas[1])  # ... and the same half on the other node after training
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    ref = reference_params(3, world=4)  # 4 data-parallel ranks of 4 samples each
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


@distributed(world_size=4)
def test_reshard_to_a_node_keeps_the_backward_gather_within_the_node():
    """``reshard_after_forward=2`` (a 2-way shard kept for backward, "the GPUs of one node") under SLURM's cyclic
    numbering: the backward all-gather's group is the node's 2 ranks."""
    node, _ = LAYOUTS["slurm_cyclic"][1](dist.get_rank())
    with _launched("slurm_cyclic"):
        module = LitGPT()
        trainer = _two_nodes(strategies.ShardFSDPTPStrategy(reshard_after_forward=2), max_steps=3)
        trainer.fit(module)
    mesh = trainer.strategy.device_mesh
    assert _nodes_of(mesh.split_group("data_parallel", 2), node) == {node}  # the group FSDP's cache holds
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    ref = reference_params(3, world=4)
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


@distributed(world_size=4)
def test_tp_groups_that_must_span_nodes_warn():
    """TP 4 on nodes of 2 devices: allowed (the model may need it), but every TP collective crosses nodes."""
    with _launched("torchrun"):
        trainer = _two_nodes(strategies.ShardFSDPTPStrategy(tensor_parallel_size=4))
        warns = pytest.warns(UserWarning, match=r"tensor_parallel_size=4 does not divide the 2 devices of a node")
        with warns if dist.get_rank() == 0 else contextlib.nullcontext():  # rank_zero_warn
            mesh = trainer.strategy._build_mesh()
    assert mesh.shape == (1, 4)


def test_tp_size_that_splits_a_node_is_reported():
    assert not nodes.tp_crosses_nodes(2, devices=2, num_nodes=2)
    assert not nodes.tp_crosses_nodes(2, devices=4, num_nodes=2)
    assert nodes.tp_crosses_nodes(4, devices=2, num_nodes=2)  # TP 4 over nodes of 2
    assert nodes.tp_crosses_nodes(2, devices=3, num_nodes=2)  # a TP pair straddles the nodes
    assert not nodes.tp_crosses_nodes(4, devices=2, num_nodes=1)


# ------------------------------------------------------------------ checkpoints
def _write_on_two_nodes(sharded: str, full: str, tp: int, sharding: str) -> None:
    """One epoch over 2 cyclically numbered SLURM nodes (TP 2 x DP 2, FSDP 4 on the mesh line [0, 2, 1, 3], or
    HYBRID_SHARD: 2 replicas of a 2-way shard); a sharded and a full checkpoint."""
    written = []
    original = strategy_module._write_atomically
    strategy_module._write_atomically = lambda *a: written.append(a[1]) or original(*a)
    try:
        with _launched("slurm_cyclic"):
            strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size=tp, sharding_strategy=sharding)
            trainer = _two_nodes(strategy, max_epochs=1, max_steps=-1)
            trainer.fit(AdamGPT(lr=LR, arch="llama", per_rank_batch=2 * tp))  # global batch 8, as one process's
            trainer.save_checkpoint(sharded)
            trainer.strategy.state_dict_type = "full"
            trainer.save_checkpoint(full)
    finally:
        strategy_module._write_atomically = original
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [str(p) for p in written])
    assert everyone == [[full], [], [], []]  # global rank 0 (SLURM_PROCID 0) alone writes the full file


def _resume(path: str, layout: str | None = None) -> None:
    """One more epoch from the 2-node checkpoint on this world (FSDP only; on 2 nodes of 2 ranks numbered as
    ``layout`` says, or on one node); equal to one process's AdamW."""
    module = AdamGPT(lr=0.5, arch="llama", per_rank_batch=8 // dist.get_world_size())
    loops = dict(max_epochs=2, max_steps=-1)
    with _launched(layout) if layout else contextlib.nullcontext():
        trainer = _two_nodes("shard_fsdp_tp", **loops) if layout else _trainer(**loops)
        trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 16
    params, state = reference(epochs(2), arch="llama")
    mine = _optim_state(module, trainer.optimizers[0])
    assert mine.keys() == state.keys()
    ours = _params(module)
    worst = max((ours[k] - params[k]).abs().max().item() for k in params)
    worst_state = max((mine[k][s] - state[k][s]).abs().max().item() for k in state for s in state[k])
    assert worst < TP_TOL and worst_state < TP_TOL, (worst, worst_state)


CHECKPOINT_CASES = [
    (2, "FULL_SHARD"),
    pytest.param(1, "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param(1, "HYBRID_SHARD", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("tp", "sharding"), CHECKPOINT_CASES)
def test_two_node_checkpoints_resume_on_one_node_and_on_one_process(tmp_path, tp, sharding):
    """Saved on 2 cyclically numbered nodes; resumed on 1 node x 2 ranks, on 1 process (and, for HYBRID_SHARD, on
    the 2 nodes again under FSDP 4, whose data-parallel line is out of rank order)."""
    sharded, full = str(tmp_path / "sharded"), str(tmp_path / "full.ckpt")
    run_distributed(_write_on_two_nodes, 4, sharded, full, tp, sharding)
    params, _ = reference(epochs(1), arch="llama")
    saved = torch.load(full, weights_only=True)["state_dict"]  # the full file: one process's epoch
    assert max((saved[k] - params[k]).abs().max().item() for k in params) < TP_TOL
    run_distributed(_resume, 2, sharded)
    run_distributed(_resume, 1, sharded)
    if sharding == "HYBRID_SHARD":  # and back onto 2 nodes: FSDP 4 on the line [0, 2, 1, 3]
        run_distributed(_resume, 4, sharded, "slurm_cyclic")


@distributed(world_size=4)
def test_model_checkpoint_on_node_local_disks_raises_on_every_rank(tmp_path):
    """``ModelCheckpoint(dirpath=<a per-node local disk>)`` with sharded checkpoints: Lightning gives every rank
    global rank 0's ``dirpath``; node 1's ranks write their shards under that path on their own disk (simulated by
    moving their files elsewhere). Every rank raises, and no checkpoint lacking node 1's shards is published."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_shard.checkpoint import CheckpointError

    node, _ = LAYOUTS["torchrun"][1](dist.get_rank())
    root = [str(tmp_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    local_disk = os.path.join(root[0], f"node{node}")
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):  # node 1's files land on node 1's disk, which node 0 never sees
        if node == 1:
            self.path = type(self.path)(os.path.join(root[0], "node1-disk", os.path.relpath(self.path, root[0])))
            os.makedirs(self.path, exist_ok=True)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data
    try:
        with _launched("torchrun"):
            callback = ModelCheckpoint(dirpath=local_disk, every_n_train_steps=1, save_top_k=-1)
            trainer = _two_nodes("shard_fsdp_tp", max_steps=1, enable_checkpointing=True, callbacks=[callback])
            with pytest.raises(CheckpointError, match="every rank"):
                trainer.fit(LitGPT())
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()
    assert callback.dirpath == os.path.join(root[0], "node0")  # rank 0's, on every rank
    published = [n for n in os.listdir(callback.dirpath) if not n.startswith(".")]
    assert published == [], published


# ------------------------------------------------------------------ launched world vs devices x num_nodes
@distributed(world_size=2)
def test_world_size_other_than_devices_times_num_nodes_raises_on_every_rank():
    rank = dist.get_rank()
    with _environment(_torchrun(node=0, local=rank)):  # torchrun --nnodes=1 --nproc-per-node=2
        with pytest.raises(ValueError, match=r"devices=2 x num_nodes=2 = 4 processes, but TorchElasticEnvironment "
                           r"reports a world size of 2.*--nproc-per-node"):  # fmt: skip
            _two_nodes("shard_fsdp_tp")
        with pytest.raises(ValueError, match=r"devices=1 x num_nodes=1 = 1 processes.*world size of 2"):
            _trainer(devices=1, strategy=strategies.ShardFSDPTPStrategy())
        with pytest.raises(ValueError, match=r"devices=2 x num_nodes=2 = 4 processes, but TorchElasticEnvironment"):
            L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy="shard_fsdp_tp")
    slurm = _environment(_slurm(node=0, local=rank, per_node=2, nodes_=1))
    with slurm, pytest.raises(ValueError, match=r"SLURMEnvironment reports a world size of 2"):
        _two_nodes("shard_fsdp_tp")
    dist.barrier()  # every rank raised; none is left in a collective


@distributed(world_size=2)
def test_node_and_local_ranks_that_do_not_tile_the_nodes_raise_on_every_rank():
    """Both ranks claim node 0, local rank 0 (a launcher script that exports the same NODE_RANK on every node)."""
    with _environment(_slurm(node=0, local=0, per_node=1, nodes_=2)):
        trainer = _trainer(devices=1, num_nodes=2, max_steps=1)
        with pytest.raises(ValueError, match=r"not 1 per node on 2 nodes.*rank 1: node 0 local 0"):
            trainer.fit(LitGPT())
    dist.barrier()


# ------------------------------------------------------------------ real torchrun agents
_SCRIPT = """
import sys, torch, torch.distributed as dist
import strategies
from tests.lightning_models import LitGPT
from tests.test_strategy import _trainer

module = LitGPT(arch="llama")
trainer = _trainer(devices=2, num_nodes=2, strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2),
                   max_steps=3)
trainer.fit(module)
env = trainer.strategy.cluster_environment
tp = dist.get_process_group_ranks(trainer.strategy.device_mesh.get_group("tensor_parallel"))
places = [None] * 4
dist.all_gather_object(places, (env.node_rank(), type(env).__name__))
full = {n: p.full_tensor() for n, p in module.model.named_parameters()}
if dist.get_rank() == 0:
    torch.save({"params": full, "places": places}, sys.argv[1])
print("TP", dist.get_rank(), tp, places, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_train_like_one_process(tmp_path):
    """``torchrun --nnodes=2 --nproc-per-node=2`` twice on localhost (c10d rendezvous): 2-3 minutes on 2 cores."""
    script, out = tmp_path / "job.py", tmp_path / "result.pt"
    script.write_text(textwrap.dedent(_SCRIPT))
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=multinode", str(script), str(out)]  # fmt: skip
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]  # fmt: skip
    logs = [a.communicate(timeout=900)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    result = torch.load(out, weights_only=True)
    assert [p[1] for p in result["places"]] == ["TorchElasticEnvironment"] * 4
    for line in "\n".join(logs).splitlines():
        if line.startswith("TP "):  # each TP group: the ranks of one node (torchrun's GROUP_RANK)
            _, _, ranks = line.partition("[")
            group = [int(r) for r in ranks.partition("]")[0].split(",")]
            assert len({result["places"][r][0] for r in group}) == 1, line
    ref = reference_params(3, world=2, arch="llama")
    assert max((result["params"][k] - ref[k]).abs().max().item() for k in ref) < TP_TOL


@distributed(world_size=4)
def test_init_device_mesh_lays_the_mesh_over_a_rank_order():
    from lightning_shard import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), rank_order=[0, 2, 1, 3])
    assert mesh.mesh.tolist() == [[0, 2], [1, 3]]
    assert dist.get_process_group_ranks(mesh.get_group("tp")) == [[0, 2], [1, 3]][dist.get_rank() % 2]
    with pytest.raises(ValueError, match=r"rank_order \[0, 0, 1, 3\] must list every rank 0..3 exactly once"):
        init_device_mesh("cpu", (2, 2), rank_order=[0, 0, 1, 3])


@distributed(world_size=4)
def test_a_mesh_line_out_of_rank_order_shards_and_gathers_by_coordinate():
    """The data-parallel line of FSDP 4 over 2 cyclically numbered nodes is [0, 2, 1, 3]: rank 2 holds shard 1.
    A group sorted as ``dist.new_group`` does by default makes group rank 2 != coordinate 1, and all-gathers put
    the shards in the wrong place."""
    from lightning_shard import init_device_mesh
    from lightning_shard.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,), rank_order=[0, 2, 1, 3])
    coordinate = mesh.get_local_rank()
    assert coordinate == [0, 2, 1, 3].index(dist.get_rank())
    assert dist.get_group_rank(mesh.get_group(), dist.get_rank()) == coordinate
    full = torch.arange(8.0)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(sharded.to_local(), full[2 * coordinate : 2 * coordinate + 2])
    assert torch.equal(sharded.full_tensor(), full)
    assert torch.equal((sharded * 2).sum().full_tensor(), full.sum() * 2)


class _Accelerator:
    """A device handle with 4 devices that records the device a process picks."""

    def __init__(self) -> None:
        self.chosen: list[int] = []

    def device_is_set(self) -> bool:
        return False

    def device_count(self) -> int:
        return 4

    def set_device(self, index: int) -> None:
        self.chosen.append(index)


def test_engine_picks_the_device_by_slurm_localid_under_srun(monkeypatch):
    """A plain engine script under srun (no LOCAL_RANK): the device is SLURM_LOCALID, not the global rank modulo
    the device count. On 2 nodes of 4 GPUs numbered cyclically, node 1 runs ranks 1, 3, 5 and 7 (SLURM_LOCALID 0-3),
    and rank % 4 would put ranks 1 and 5 on GPU 1 and ranks 3 and 7 on GPU 3."""
    import lightning_shard.mesh as mesh_module

    handle = _Accelerator()
    monkeypatch.setattr(mesh_module, "handle_for", lambda device_type: handle)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "0")
    mesh_module._set_device_if_unset("cuda")
    monkeypatch.setenv("LOCAL_RANK", "2")  # torchrun's variable wins where both are set
    mesh_module._set_device_if_unset("cuda")
    assert handle.chosen == [0, 2]


# ------------------------------------------------------------------ SLURM auto-requeue
@distributed(world_size=2)
def test_auto_requeue_resumes_past_a_save_the_requeue_interrupted(tmp_path):
    """SLURM's requeue: ``hpc_ckpt_1.ckpt`` published, the save of ``hpc_ckpt_2.ckpt`` killed (its temp dir left).
    Lightning reads the temp dir's name as version 20123456...; the requeued job resumes from ``hpc_ckpt_1.ckpt``
    and trains as if it had never stopped (it stopped with FileNotFoundError)."""
    root = [str(tmp_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    run = dict(devices=2, default_root_dir=root[0], max_steps=-1, max_epochs=2)
    with _environment(_slurm(node=0, local=dist.get_rank(), per_node=2, nodes_=1)):
        first = _trainer(**{**run, "max_epochs": 1})  # the signal arrives at the end of epoch 0
        first.fit(AdamGPT(lr=LR))
        first.save_checkpoint(first._checkpoint_connector.hpc_save_path(root[0]))  # what SIGUSR1's handler does
        leftover = os.path.join(root[0], "hpc_ckpt_2.ckpt.tmp-0a1b2c3d4e5f60")
        if dist.get_rank() == 0:
            os.makedirs(leftover)
        dist.barrier()
        module = AdamGPT(lr=LR)
        requeued = _trainer(**run)
        warns = pytest.warns(UserWarning, match=r"auto-requeue asked for .*hpc_ckpt_201234560\.ckpt.*hpc_ckpt_1\.ckpt")
        with warns if dist.get_rank() == 0 else contextlib.nullcontext():
            requeued.fit(module)  # no ckpt_path: Lightning picks "hpc" under SLURM
    assert requeued.global_step == 16 and not os.path.exists(leftover)
    ours, (ref, _) = _params(module), reference(epochs(2))  # 2 uninterrupted epochs
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


def test_only_a_name_read_from_an_interrupted_save_is_mapped(tmp_path):
    from strategies.requeue import published_hpc_path

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"")
    missing = str(tmp_path / "hpc_ckpt_7.ckpt")
    assert published_hpc_path(missing) == missing  # no leftover: the caller's FileNotFoundError stands
    (tmp_path / ".hpc_ckpt_2.ckpt.tmp-4242").write_bytes(b"")  # a full save's temp file
    assert published_hpc_path(missing) == missing  # Lightning read 24242 from it, not 7
    with pytest.warns(UserWarning, match="resuming from the latest complete one"):
        assert published_hpc_path(str(tmp_path / "hpc_ckpt_24242.ckpt")) == str(tmp_path / "hpc_ckpt_1.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt"]
    assert published_hpc_path(str(tmp_path / "other.ckpt")) == str(tmp_path / "other.ckpt")
