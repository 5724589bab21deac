"""Bad arguments fail where they are given, naming the argument: ``fully_shard``'s keywords, the planner
CLI's sizes, and the strategy's settings at ``Trainer(...)`` construction (before any process starts)."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

import strategies
from lightning_shard.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- fully_shard
@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"mp_policy": torch.bfloat16}, r"mp_policy.*MixedPrecisionPolicy\(param_dtype=torch.bfloat16\)"),
        ({"mp_policy": {"param_dtype": torch.bfloat16}}, r"mp_policy.*dict"),
        ({"offload_policy": "cpu"}, r"offload_policy.*'cpu'.*CPUOffloadPolicy\(\)"),
        ({"offload_policy": True}, r"offload_policy.*True"),
        ({"reshard_after_forward": "True"}, r"reshard_after_forward.*'True'.*str"),
        ({"reshard_after_forward": None}, r"reshard_after_forward.*None"),
        ({"mesh": "cpu"}, r"mesh must be a lightning_shard DeviceMesh, got str"),
    ],
)
def test_fully_shard_names_the_bad_keyword(kwargs, pattern):
    model = nn.Linear(4, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match=pattern):
        fully_shard(model, **kwargs)
    # refused before anything was touched
    assert type(model) is nn.Linear and not hasattr(model, "_fsdp_state")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_torch_policies_are_refused_naming_ours():
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    with pytest.raises(TypeError, match=r"mp_policy must be a lightning_shard.*torch\.distributed"):
        fully_shard(nn.Linear(2, 2), mp_policy=TorchMP(param_dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"offload_policy must be a lightning_shard.*torch\.distributed"):
        fully_shard(nn.Linear(2, 2), offload_policy=TorchOffload())
    # ours pass the check (no process group needed to get past it: the mesh is what fails next)
    with pytest.raises(TypeError, match="mesh must be"):
        fully_shard(nn.Linear(2, 2), mesh=object(), mp_policy=MixedPrecisionPolicy(), offload_policy=CPUOffloadPolicy())


# ----------------------------------------------------------------------------- planner CLI
_PLANNER = ["tests.test_planner:small_llama", "--memory", "1GB"]
_GOOD = {"--devices": "4", "--batch": "4", "--seq-len": "16", "--devices-per-node": "4"}


@pytest.mark.parametrize("flag", ["--batch", "--seq-len", "--devices-per-node", "--devices"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_planner_cli_refuses_non_positive_sizes(flag, value, capsys):
    # In-process: argparse exits with its usage error before the model is built (tests/test_planner.py runs
    # the CLI as a subprocess end to end).
    from lightning_shard.planner.__main__ import main

    args = dict(_GOOD, **{flag: value})
    with pytest.raises(SystemExit) as exit_info:
        main([*_PLANNER, *(x for kv in args.items() for x in kv)])
    out = capsys.readouterr()
    assert exit_info.value.code == 2, out.out
    assert f"argument {flag}: must be a positive integer (>= 1), got {int(value)}" in out.err
    assert "choice:" not in out.out


# ----------------------------------------------------------------------------- strategy at construction
@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            {"sharding_strategy": "HYBRID_SHARD", "tensor_parallel_size": 2},
            ValueError,
            "HYBRID_SHARD.*tensor_parallel_size=2",
        ),
        ({"sharding_strategy": "NO_SHARD", "tensor_parallel_size": 2}, ValueError, "NO_SHARD.*not supported"),
        ({"fsdp_unit": nn.Linear}, TypeError, r"fsdp_unit=.*pass \{Linear\}"),
        ({"fsdp_unit": 3}, TypeError, "fsdp_unit=3"),
        ({"tp_plan": "colwise"}, TypeError, "tp_plan='colwise'"),
        ({"tp_plan": False}, TypeError, "tp_plan=False.*or None"),
        ({"reshard_after_forward": 0}, ValueError, "reshard_after_forward=0"),
        ({"reshard_after_forward": "yes"}, ValueError, "reshard_after_forward='yes'"),
        ({"cpu_offload": "true"}, TypeError, "cpu_offload='true'"),
        (
            {"activation_checkpointing_policy": nn.Linear},
            TypeError,
            r"activation_checkpointing_policy=.*pass \{Linear\}",
        ),
        ({"activation_checkpointing_policy": {"Linear"}}, TypeError, "activation_checkpointing_policy"),
        ({"process_group_backend": 1}, TypeError, "process_group_backend=1"),
        ({"timeout": 30}, TypeError, "timeout=30.*timedelta"),
        ({"planner_batch": 0}, ValueError, "planner_batch=0"),
        ({"planner_seq_len": -1}, ValueError, "planner_seq_len=-1"),
        # the "auto" knobs: exactly "auto", nothing that merely looks like it
        ({"cpu_offload": 3}, TypeError, "cpu_offload=3 must be True, False or 'auto'"),
        ({"cpu_offload": "Auto"}, TypeError, "cpu_offload='Auto' must be True, False or 'auto'"),
        ({"reshard_after_forward": "Auto"}, ValueError, "reshard_after_forward='Auto'.*or 'auto'"),
        ({"activation_checkpointing_policy": "Auto"}, TypeError, "activation_checkpointing_policy='Auto'.*'auto'"),
        ({"planner_device_memory": "lots"}, ValueError, "planner_device_memory='lots'.*'24GiB'"),
        ({"planner_device_memory": 0}, ValueError, "planner_device_memory=0"),
        ({"planner_device_memory": True}, ValueError, "planner_device_memory=True"),
    ],
)
def test_strategy_constructor_names_the_bad_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        strategies.ShardFSDPTPStrategy(**kwargs)


def test_strategy_accepts_good_arguments():
    s = strategies.ShardFSDPTPStrategy(
        fsdp_unit={nn.Linear},
        tp_plan=None,
        reshard_after_forward=2,
        cpu_offload=True,
        activation_checkpointing_policy={nn.Linear},
        process_group_backend="gloo",
        timeout=timedelta(minutes=5),
        sharding_strategy="HYBRID_SHARD",
    )
    assert s.reshard_after_forward == 2 and s.cpu_offload
    strategies.ShardFSDPTPStrategy(fsdp_unit=lambda m: isinstance(m, nn.Linear), tensor_parallel_size="auto")


def test_strategy_accepts_auto_for_each_knob_alone_and_together():
    knobs = {"activation_checkpointing_policy": "auto", "reshard_after_forward": "auto", "cpu_offload": "auto"}
    for name, value in knobs.items():
        s = strategies.ShardFSDPTPStrategy(**{name: value})
        assert getattr(s, name) == "auto"  # decided at setup, by the planner
    s = strategies.ShardFSDPTPStrategy(tensor_parallel_size="auto", planner_device_memory="24GiB", **knobs)
    assert s.planner_device_memory == "24GiB"
    # a sharding strategy that never reshards decides reshard_after_forward itself, "auto" or not
    assert (
        strategies.ShardFSDPTPStrategy(
            reshard_after_forward="auto", sharding_strategy="SHARD_GRAD_OP"
        ).reshard_after_forward
        is False
    )


@pytest.mark.parametrize(
    "kwargs, devices, pattern",
    [
        ({"tensor_parallel_size": 3}, 2, "tensor_parallel_size=3 does not divide the 2 devices"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, 2, "data_parallel_size=2 x tensor_parallel_size=2 = 4"),
        ({"data_parallel_size": 3, "tensor_parallel_size": "auto"}, 2, "data_parallel_size=3 does not divide the 2"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 1}, 4, "= 2 but there are 4 devices"),
    ],
)
def test_sizes_are_checked_when_the_trainer_is_built(kwargs, devices, pattern):
    """In the user's process at Trainer(...): no launcher, no process started, no ranks' tracebacks."""
    with pytest.raises(ValueError, match=pattern):
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategies.ShardFSDPTPStrategy(**kwargs), logger=False)


def test_valid_sizes_build_a_trainer():
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2), logger=False
    )
    assert trainer.strategy.num_processes == 4


# ----------------------------------------------------------------------------- sizes given as strings
def test_sizes_accept_digit_strings_as_command_lines_pass_them():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size="2", data_parallel_size="1"),
        logger=False,
    )
    assert trainer.strategy.num_processes == 2
    # read as the number it spells: 3 does not divide 2 devices
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 2 devices"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=" 3 "))
    strategies.ShardFSDPTPStrategy(tensor_parallel_size="auto", data_parallel_size="auto")
    for bad in ("two", "0", "2.0", "-1", ""):
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={bad!r} must be 'auto' or a positive int"):
            strategies.ShardFSDPTPStrategy(tensor_parallel_size=bad)


def test_parity_helper_reads_string_sizes_like_the_strategy():
    from strategies.testing import _dp_size

    assert _dp_size(4, {"tensor_parallel_size": "2"}) == 2
    assert _dp_size(4, {"data_parallel_size": "4", "tensor_parallel_size": "1"}) == 4


# ----------------------------------------------------------------------------- Python version claims
def test_python_version_claims_agree():
    import re
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    minimum = re.fullmatch(r">=(\d+)\.(\d+)", project["project"]["requires-python"])
    assert minimum, project["project"]["requires-python"]
    major, minor = int(minimum[1]), int(minimum[2])
    assert project["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert f"Python {major}.{minor} or newer" in (ROOT / "README.md").read_text()
    assert sys.version_info[:2] >= (major, minor), "the tests must run on a Python the package claims"
