"""Resuming ``shard_fsdp_tp`` from a checkpoint written by Lightning's ``FSDPStrategy`` with
``state_dict_type="full"`` (torch's FSDP1): one file, the model's full state dict and the optimizer state as
FSDP's full optimizer state dict re-keyed by parameter index (``FSDP.rekey_optim_state_dict(..., PARAM_ID)``).
The resumed run is compared with single-process SGD on the same global batches."""

import torch
import torch.distributed as dist

import strategies  # noqa: F401  (registers "shard_fsdp_tp")
from tests.fsdp_models import Block, loss_fn
from tests.harness import distributed
from tests.lightning_models import LitGPT, _seeded_model, dataset, sampler_batches
from tests.test_strategy import _trainer
from tests.test_strategy_checkpoint import _full_params, _shared_path


def _two_groups(model: torch.nn.Module, lr: float) -> torch.optim.SGD:
    """The blocks first (lr), then the other parameters (lr / 2): not the model's parameter order, so an
    optimizer state keyed by model-order index differs from torch's ``optimizer.state_dict()`` numbering."""
    blocks = list(model.blocks.parameters())
    rest = [p for p in model.parameters() if all(p is not b for b in blocks)]
    return torch.optim.SGD([{"params": blocks}, {"params": rest, "lr": lr / 2}], lr=lr, momentum=0.9)


class TwoGroupGPT(LitGPT):
    def configure_optimizers(self):
        return _two_groups(self.model, self.lr)


def reference(schedule: list[torch.Tensor], lr: float = 0.1, optimizer=_two_groups) -> dict[str, torch.Tensor]:
    """Single-process SGD (momentum 0.9, ``optimizer(model, lr)``) from LitGPT's initial weights, one step per
    global batch of ``schedule`` (dataset indices), parameters named as in the LightningModule."""
    model = _seeded_model()
    opt = optimizer(model, lr)
    data = dataset()
    for idx in schedule:
        x, y = data[idx]
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def epochs(n: int, world: int = 2, per_rank_batch: int = 4) -> list[torch.Tensor]:
    """The global batches of ``n`` epochs under Lightning's DistributedSampler (reshuffled with seed = epoch)."""
    return [b for e in range(n) for b in sampler_batches(world, per_rank_batch, seed=e)]


def max_diff(ours: dict, ref: dict) -> float:
    assert ours.keys() == ref.keys()
    return max((ours[k] - ref[k]).abs().max().item() for k in ours)


class _FullStateDictOnCPU:
    """Lightning's FSDPStrategy asks FSDP1 for full state dicts with ``offload_to_cpu=True``; on a CPU-only
    process group FSDP1 then frees the storage its CPU "copies" share, and cloning them segfaults (torch 2.9).
    Within this context Lightning's own code runs with ``offload_to_cpu=False`` (on CPU the same tensors)."""

    def __enter__(self):
        import lightning.pytorch.strategies.fsdp as pl_fsdp
        from lightning.fabric.strategies.fsdp import _get_full_state_dict_context

        def on_cpu(module, world_size, rank0_only=True):
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.api import FullOptimStateDictConfig

            return FSDP.state_dict_type(
                module=module,
                state_dict_type=StateDictType.FULL_STATE_DICT,
                state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
                optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            )

        self._module, self._original = pl_fsdp, _get_full_state_dict_context
        pl_fsdp._get_full_state_dict_context = on_cpu
        return self

    def __exit__(self, *exc):
        self._module._get_full_state_dict_context = self._original


def _lightning_fsdp_on_cpu(state_dict_type: str = "full", unit: type[torch.nn.Module] = Block):
    """Lightning's FSDPStrategy (one FSDP unit per ``unit`` module) on the CPU: Lightning refuses a CPU
    accelerator for the class itself (a subclass passes) and passes ``device_id=None``, with which FSDP1 looks
    for an accelerator; wrapping with ``device_id=cpu`` first makes Lightning keep our wrapper."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model):
            policy = ModuleWrapPolicy({unit})
            wrapped = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy, use_orig_params=True)
            return super()._setup_model(wrapped)

    return CPUFSDPStrategy(state_dict_type=state_dict_type)


@distributed(world_size=2)
def test_resume_from_a_lightning_fsdp_full_checkpoint(tmp_path):
    path = _shared_path(tmp_path, "fsdp.ckpt")
    theirs = TwoGroupGPT()
    with _FullStateDictOnCPU():
        trainer = _trainer(strategy=_lightning_fsdp_on_cpu(), max_epochs=1, max_steps=-1)
        trainer.fit(theirs)
        trainer.save_checkpoint(path)
    assert trainer.global_step == 8
    ckpt = torch.load(path, weights_only=True)
    osd = ckpt["optimizer_states"][0]
    assert all(isinstance(k, int) for k in osd["state"]) and len(osd["state"]) >= 5  # index-keyed, frozen: none
    # FSDP numbers parameters in model order (embed 0, frozen 1-2, blocks 3-14, norm 15-16), listed per group
    assert [g["params"] for g in osd["param_groups"]] == [list(range(3, 15)), [0, 1, 2, 15, 16]]
    # the file holds what the FSDP run trained: the reference after one epoch
    after_one = reference(epochs(1))
    saved = max_diff({k: ckpt["state_dict"][k] for k in after_one}, after_one)
    assert saved < 1e-6, saved

    # resume with ours, one more epoch: equals single-process SGD over both epochs
    resumed = TwoGroupGPT(lr=0.5)  # the checkpoint's learning rates (0.1, 0.05) must win
    ours = _trainer(max_epochs=2, max_steps=-1)
    ours.fit(resumed, ckpt_path=path)
    assert ours.global_step == 16
    assert [g["lr"] for g in ours.optimizers[0].param_groups] == [0.1, 0.05]
    diff = max_diff(_full_params(resumed), reference(epochs(2)))
    assert diff < 1e-6, diff
    dist.barrier()
