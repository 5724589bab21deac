"""Trainer(strategy="shard_fsdp_tp") on real gloo ranks, compared with a single-device run."""

import contextlib
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist

import strategies
from lightning_shard.tensor import DTensor
from tests.harness import distributed
from tests.lightning_models import LitGPT, reference_params


def _trainer(**kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"]),
        strategy="shard_fsdp_tp",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def _max_diff(module, ref):
    ours = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    assert ours.keys() == ref.keys()
    return max((ours[k] - ref[k]).abs().max().item() for k in ours)


@distributed(world_size=2)
def test_fsdp_only_parity_with_single_device():
    module = LitGPT()
    trainer = _trainer()
    trainer.fit(module)
    assert isinstance(trainer.strategy, strategies.ShardFSDPTPStrategy)
    assert all(isinstance(p, DTensor) for p in module.parameters())
    assert module.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
    assert _max_diff(module, reference_params(5)) < 1e-5


@pytest.mark.slow
@distributed(world_size=2, fresh=True)
def test_engine_loaded_before_configure_model():
    # A new process: the engine's one-time loads (numba kernels ~46 MB, DTensor op rules ~10 MB; docs/strategy.md)
    # must happen at process setup, before the user's model is built, not inside configure_model or step 1.
    from lightning_shard.tensor import ops
    from numba_kernels import cpu

    class Recording(LitGPT):
        def configure_model(self):
            self.kernels_loaded = bool(cpu._kernel_parallel.signatures and cpu._kernel_serial.signatures)
            self.rules_loaded = ops._LOADED
            super().configure_model()

    module = Recording()
    assert not cpu._kernel_parallel.signatures and not ops._LOADED  # nothing loaded them yet in this process
    _trainer(max_steps=1).fit(module)  # the strategy creates the process group
    assert module.kernels_loaded and module.rules_loaded


@distributed(world_size=2)
def test_meta_init_in_configure_model():
    torch.manual_seed(0)
    module = LitGPT(meta_init=True)
    trainer = _trainer(max_steps=2)
    trainer.fit(module)
    assert all(isinstance(p, DTensor) and not p.is_meta for p in module.parameters())
    # identical on every rank: replicated nothing drifted, loss finite
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


@distributed(world_size=2)
def test_gradient_accumulation_and_clipping():
    module = LitGPT()
    trainer = _trainer(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    trainer.fit(module)
    assert _max_diff(module, reference_params(3, accumulate=2, clip=0.5)) < 1e-5


@distributed(world_size=2)
def test_loops_and_sync_dist_logging():
    module = LitGPT()
    trainer = _trainer(max_steps=2, limit_val_batches=2)
    trainer.fit(module)
    val = trainer.validate(module, verbose=False)[0]["val_loss"]
    test = trainer.test(module, verbose=False)[0]["test_loss"]
    preds = trainer.predict(module)
    assert val == pytest.approx(test)  # same data
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, val)
    assert len(set(losses)) == 1  # sync_dist made every rank log the same mean
    assert preds[0].shape == (4, 6)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-true", "32-true"])
@distributed(world_size=2)
def test_precision_strings(precision):
    module = LitGPT()
    trainer = _trainer(max_steps=3, precision=precision)
    trainer.fit(module)
    loss = trainer.callback_metrics["train_loss"]
    assert torch.isfinite(loss)
    expected_master = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)
    assert all(p.dtype == expected_master for p in module.parameters())


@distributed(world_size=2)
def test_tensor_parallel_only_auto_plan():
    module = LitGPT(arch="llama")
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2), max_steps=3)
    trainer.fit(module)
    assert module.device_mesh.shape == (1, 2)
    assert trainer.strategy.parallel_summary["tp_plan"]  # the auto plan sharded something
    assert any(len(p.placements) == 2 and p.placements[1].is_shard() for p in module.parameters())
    # one data-parallel rank: every TP rank sees the same batches
    assert _max_diff(module, reference_params(3, world=1, arch="llama")) < 1e-5


@distributed(world_size=2)
def test_bad_configuration_errors():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 2 devices"):
        _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=3)).fit(LitGPT())
    with pytest.raises(ValueError, match="sharding_strategy='HALF_SHARD'"):
        strategies.ShardFSDPTPStrategy(sharding_strategy="HALF_SHARD")
    with pytest.raises(ValueError, match="precision='transformer-engine' is not supported"):
        # every other Lightning precision string is mapped; this one needs a package Lightning checks for first
        strategies.precision.ShardPrecision("transformer-engine")
    with pytest.raises(ValueError, match="data_parallel_size=2 x tensor_parallel_size=2 = 4"):
        _trainer(strategy=strategies.ShardFSDPTPStrategy(data_parallel_size=2, tensor_parallel_size=2)).fit(LitGPT())


@distributed(world_size=4)
def test_fsdp_times_tp_on_four_ranks():
    module = LitGPT(arch="llama")
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(tensor_parallel_size=2), max_steps=3)
    trainer.fit(module)
    assert module.device_mesh.shape == (2, 2)
    assert trainer.strategy.distributed_sampler_kwargs["num_replicas"] == 2
    assert _max_diff(module, reference_params(3, world=2, arch="llama")) < 1e-5


@distributed(world_size=4)
def test_reshard_after_forward_to_two_of_four_ranks():
    module = LitGPT()
    trainer = _trainer(strategy=strategies.ShardFSDPTPStrategy(reshard_after_forward=2), max_steps=3)
    trainer.fit(module)
    blocks = [m for m in module.modules() if getattr(m, "_fsdp_state", None) is not None and m is not module]
    assert blocks and all(b._fsdp_state.group.post_forward.layout.world_size == 2 for b in blocks)
    assert _max_diff(module, reference_params(3, world=4)) < 1e-5


@distributed(world_size=2)
def test_auto_tensor_parallel_size_uses_the_planner():
    module = LitGPT(arch="llama")
    strategy = strategies.ShardFSDPTPStrategy(tensor_parallel_size="auto", planner_batch=4, planner_seq_len=6)
    trainer = _trainer(strategy=strategy, max_steps=1)
    trainer.fit(module)
    # plenty of memory on this machine: the smallest TP that fits is 1, and the planner said why
    assert module.device_mesh.shape == (2, 1)
    assert trainer.strategy.planner_table and "fits" in trainer.strategy.planner_table.lower()


@distributed(world_size=2, timeout=90, fresh=True)  # before the fix, rank 1 waited in a barrier until the timeout
def test_full_save_failing_on_rank_0_raises_on_every_rank():
    lit = LitGPT()
    trainer = _trainer(max_steps=1, strategy=strategies.ShardFSDPTPStrategy(state_dict_type="full"))
    trainer.fit(lit)
    path = os.path.join(_broadcast_tmpdir(), "full.ckpt")
    trainer.save_checkpoint(path)
    previous = _read(path)
    with failing_write_on_rank_0(), pytest.raises(Exception, match="full.ckpt") as info:
        trainer.save_checkpoint(path)
    assert_failed_save_left_no_trace(path, previous, info.value)


@contextlib.contextmanager
def failing_write_on_rank_0():
    """On rank 0, ``torch.save`` writes a few bytes and fails like a full disk; other ranks are unaffected."""

    def boom(obj, f, *args, **kwargs):
        if hasattr(f, "write"):
            f.write(b"partial")
        raise OSError(28, "No space left on device (injected)")

    save = torch.save
    if dist.get_rank() == 0:
        torch.save = boom
    try:
        yield
    finally:
        torch.save = save


def assert_failed_save_left_no_trace(path: str, previous: bytes, error: BaseException) -> None:
    """Every rank's error names rank 0's cause; the previous file is intact and no temporary file remains."""
    assert "No space left on device (injected)" in str(error)
    dist.barrier()  # rank 0 has cleaned up
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]
    assert _read(path) == previous


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _broadcast_tmpdir() -> str:
    import tempfile

    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _auto_strategy():
    from strategies.precision import ShardPrecision

    strategy = strategies.ShardFSDPTPStrategy(
        tensor_parallel_size="auto", planner_batch=4, planner_seq_len=6, parallel_devices=[torch.device("cpu")] * 2
    )
    strategy._lightning_module = LitGPT(arch="llama")
    strategy.precision_plugin = ShardPrecision("32-true", "cpu")
    return strategy


def _auto_request(strategy):
    from strategies import auto

    return auto.Request(tensor_parallel_size=strategy._tensor_parallel_size, **strategy._auto_request)


@distributed(world_size=2)
def test_auto_tensor_parallel_size_is_rank_zeros_choice_on_every_rank():
    from unittest import mock

    import lightning_shard.planner as planner

    # Rank 1's planner sees something else (another node's memory, another first batch): it must not matter.
    other = mock.patch.object(
        planner, "choose_configuration", return_value=planner.Configuration(2, None, True, False, "rank 1's table")
    )
    failing = mock.patch.object(planner, "choose_configuration", side_effect=RuntimeError("meta failed"))
    for patch in (other, failing):
        strategy = _auto_strategy()
        with patch if dist.get_rank() == 1 else contextlib.nullcontext():
            tp = strategy._apply_auto(_auto_request(strategy), 2)
        seen = [None, None]
        dist.all_gather_object(seen, (tp, strategy.planner_table))
        assert seen[0] == seen[1], seen
        assert seen[0][1] and "rank 1" not in seen[0][1]


@distributed(world_size=2)
def test_auto_tensor_parallel_size_error_on_rank_zero_raises_on_every_rank():
    from unittest import mock

    import lightning_shard.planner as planner

    no_fit = planner.NoFitError("nothing fits in 1 byte")
    patch = mock.patch.object(planner, "choose_configuration", side_effect=no_fit)
    rank0_patch = patch if dist.get_rank() == 0 else contextlib.nullcontext()
    with rank0_patch, pytest.raises(planner.NoFitError, match="nothing fits in 1 byte"):
        strategy = _auto_strategy()
        strategy._plan_configuration(_auto_request(strategy), 2)
