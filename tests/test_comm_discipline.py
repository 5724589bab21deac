"""Device discipline: every collective of the engine and the strategy goes through lightning_shard.comm, which
checks each tensor's device against the devices its group serves."""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_shard import comm

ROOT = Path(__file__).resolve().parents[1]

# torch.distributed calls that move data between ranks (creating groups or asking for ranks does not).
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list",
    "all_to_all", "all_to_all_single", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "send", "recv", "isend", "irecv", "barrier", "monitored_barrier", "batch_isend_irecv",
}  # fmt: skip

# Files that still call torch.distributed collectives directly, each with the reason. Keep this list short.
ALLOWED = {
    "lightning_shard/comm.py": "the one place that calls them",
    # DTensor.from_local(run_check=True) compares shapes with an object all-gather (tensor package).
    "lightning_shard/tensor/dtensor.py": "from_local run_check object all-gather",
}


def _direct_collectives(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = {"torch.distributed"}
    names = set()  # collectives imported by name: from torch.distributed import broadcast
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":  # from torch import distributed as d
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "torch.distributed",
            "torch.distributed.distributed_c10d",
        ):
            names |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and ast.unparse(f.value) in aliases:
            hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(f)}")
        elif isinstance(f, ast.Name) and f.id in names:
            hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {f.id}")
    return hits


def test_no_module_calls_torch_distributed_collectives_directly():
    files = sorted([*ROOT.glob("lightning_shard/**/*.py"), *ROOT.glob("strategies/**/*.py")])
    assert len(files) > 20
    hits = [h for f in files if str(f.relative_to(ROOT)) not in ALLOWED for h in _direct_collectives(f)]
    assert hits == [], "call these through lightning_shard.comm (it checks devices):\n" + "\n".join(hits)


def test_the_scan_finds_direct_calls(tmp_path):
    # the scanner itself must be able to fail
    source = tmp_path / "x.py"
    source.write_text(
        "import torch.distributed as d\nfrom torch.distributed import broadcast as bc\nfrom torch import distributed\n"
        "d.all_reduce(t)\nbc(t, 0)\nd.get_rank()\ndistributed.all_gather(ts, t)\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = [h.split(" ")[1] for h in _direct_collectives(source)]
        assert found == ["d.all_reduce", "bc", "distributed.all_gather"]
    finally:
        ROOT = saved


@pytest.mark.parametrize(
    ("config", "served"),
    [("cuda:nccl", {"cuda"}), ("nccl", {"cuda"}), ("gloo", {"cpu"}), ("cpu:gloo,cuda:nccl", {"cpu", "cuda"})],
)
def test_served_device_types_parses_backend_configs(monkeypatch, config, served):
    group = object()
    monkeypatch.setattr(dist, "get_backend_config", lambda g=None: config)
    assert comm.served_device_types(group) == served
    comm._SERVED.pop(id(group), None)


def test_check_devices_names_the_call_site(monkeypatch):
    group = object()
    monkeypatch.setattr(dist, "get_backend_config", lambda g=None: "cuda:nccl")
    try:
        with pytest.raises(RuntimeError, match=r"all_reduce at .*test_comm_discipline.py:\d+ .*cpu"):
            comm.check_devices("all_reduce", group, torch.zeros(2))
    finally:
        comm._SERVED.pop(id(group), None)


def test_meta_tensors_pass_the_device_check(monkeypatch):
    # a meta-initialised model distributed by TP broadcasts meta tensors: no data, nothing to check
    group = object()
    monkeypatch.setattr(dist, "get_backend_config", lambda g=None: "cuda:nccl")
    try:
        comm.check_devices("broadcast", group, torch.empty(2, device="meta"))
    finally:
        comm._SERVED.pop(id(group), None)


def test_an_accelerator_tensor_on_another_device_than_the_process_s_raises():
    # NCCL binds a process's communicator to its GPU: shards on cuda:2 while this rank's device is cuda:5 (the
    # Trainer(devices=[...]) class of bug) fail inside NCCL or hang. The check compared device types only.
    from lightning_shard import init_device_mesh
    from lightning_shard.simulate import simulated_world

    with simulated_world(8, rank=5) as world:
        mesh = init_device_mesh(world.device_type, (8,), mesh_dim_names=("data_parallel",))
        assert world.device == torch.device(world.device_type, 5)
        comm.all_reduce(torch.zeros(3, device=world.device), mesh.get_group())  # its own device: fine
        elsewhere = torch.zeros(3, device=torch.device(world.device_type, 2))
        with pytest.raises(RuntimeError, match=r"tensor on lazy:2 .* this process's device is lazy:5"):
            comm.all_reduce(elsewhere, mesh.get_group())
