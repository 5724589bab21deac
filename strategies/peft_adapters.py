"""peft adapters whose own code needs help to run on sharded parameters.

* AdaLoRA: ``update_and_allocate(step)``, called by the user after each optimizer step, scores every rank of the
  adapters from the parameters and their gradients (DTensors here: element-wise, so the shards suffice), reads
  the mask to keep as a Python list (``DTensor.tolist()``, a collective on every rank), and in its final phase
  masks ``lora_E`` in place with a plain tensor it builds from that list. That list is the same on every rank,
  so the strategy runs the method inside ``implicit_replication()``, where the plain mask counts as replicated;
  without it the last phase raised "got a plain torch.Tensor of shape (4, 1) mixed with DTensor arguments".
* ``PeftModel.save_pretrained(directory)`` reads the model's own state dict, which holds DTensor shards: it failed
  inside safetensors with "Attempted to access the data pointer on an invalid python storage" (and
  ``safe_serialization=False`` on pickling a DTensor). Without a ``state_dict`` it now raises on the rank that
  calls it, before any collective, naming the way that works: the full state dict gathered on every rank, then
  ``save_pretrained(directory, state_dict=sd)`` on rank 0. (Gathering inside ``save_pretrained`` would hang the
  usual ``if trainer.is_global_zero: model.save_pretrained(...)``, whose other ranks never join the gather.)

* Prefix tuning (``PrefixTuningConfig``) hands every attention layer a key/value cache of all its heads, built
  from a replicated embedding; under tensor parallelism each rank's attention holds only its share of the heads, and
  the first forward failed inside transformers' cache (``torch.cat``: "Sizes of tensors must match ... Expected
  size 2 but got size 1"). It is refused at setup on every rank (``refuse_prefix_tuning_under_tp``): train it
  with FSDP only (``tensor_parallel_size=1``), or ``tp_plan=None``; prompt tuning, P-tuning and LoRA-family
  adapters work under TP.

Example::

    refuse_prefix_tuning_under_tp(lightning_module, tp_size=2, tp_plan="auto")   # raises for prefix tuning
    wrapped = wrap_adalora(lightning_module)   # ["model.base_model (AdaLoraModel)"]
    guard_save_pretrained(lightning_module)     # ["model (PeftModelForCausalLM)"]
"""

from __future__ import annotations

import sys
import types

from torch import nn

from lightning_shard.tensor import DTensor

__all__ = ["guard_save_pretrained", "refuse_prefix_tuning_under_tp", "wrap_adalora", "wrap_peft_methods"]


def wrap_peft_methods(model: nn.Module) -> list[str]:
    """``wrap_adalora`` and ``guard_save_pretrained`` on a sharded ``model`` (the Trainer's and Fabric's setup)."""
    return wrap_adalora(model) + guard_save_pretrained(model)


def refuse_prefix_tuning_under_tp(model: nn.Module, tp_size: int, tp_plan) -> None:
    """Raise ``ValueError`` when ``model`` holds a peft prefix-tuning adapter and tensor parallelism would split its
    attention heads (a TP size above 1 with a plan); see the module docstring."""
    if tp_size <= 1 or tp_plan is None:
        return
    for name, module in model.named_modules():
        configs = getattr(module, "peft_config", None)
        if not isinstance(configs, dict) or not callable(getattr(module, "get_prompt", None)):
            continue
        for adapter, config in configs.items():
            if str(getattr(config, "peft_type", "")).endswith("PREFIX_TUNING"):
                raise ValueError(
                    f"shard_fsdp_tp: {name or 'the model'} ({type(module).__name__}) holds the prefix-tuning adapter "
                    f"{adapter!r}, whose key/value prefix covers every attention head, but tensor_parallel_size="
                    f"{tp_size} splits the heads over the ranks (the first forward would fail inside the model's "
                    "cache). Use tensor_parallel_size=1 (FSDP only) or tp_plan=None, or prompt tuning / LoRA, which "
                    "work under tensor parallelism"
                )


def wrap_adalora(model: nn.Module) -> list[str]:
    """Run ``update_and_allocate`` of every AdaLoRA model inside ``model`` under ``implicit_replication()``
    (see the module docstring); returns their names."""
    wrapped = []
    for name, module in model.named_modules():
        # the class, not the instance: a PeftModel forwards unknown attributes to the AdaLoraModel it wraps
        if not callable(getattr(type(module), "update_and_allocate", None)) or not hasattr(module, "rankallocator"):
            continue
        if _bind(module, "update_and_allocate", _update_and_allocate_replicating):
            wrapped.append(f"{name or 'the model'} ({type(module).__name__})")
    return wrapped


def guard_save_pretrained(model: nn.Module) -> list[str]:
    """Make ``save_pretrained`` of every ``peft.PeftModel`` in ``model`` raise, naming the fix, when called without
    a ``state_dict`` on sharded parameters (see the module docstring); returns their names."""
    peft = sys.modules.get("peft")  # a model holding a PeftModel has imported peft; never import it here
    if peft is None:
        return []
    return [
        f"{name or 'the model'} ({type(module).__name__})"
        for name, module in model.named_modules()
        if isinstance(module, peft.PeftModel) and _bind(module, "save_pretrained", _save_pretrained_checked)
    ]


def _bind(module: nn.Module, method: str, function) -> bool:
    """Set ``module.<method>`` to ``function`` bound to ``module`` (once); False if it already was.

    Why a bound method rather than a closure over the module: ``copy.deepcopy`` rebinds a bound method to the copy,
    while a closure would keep acting on the original module."""
    if getattr(vars(module).get(method), "__func__", None) is function:
        return False
    setattr(module, method, types.MethodType(function, module))
    return True


def _update_and_allocate_replicating(self: nn.Module, *args, **kwargs):
    from lightning_shard.tensor import implicit_replication

    with implicit_replication():
        return type(self).update_and_allocate(self, *args, **kwargs)


def _save_pretrained_checked(self: nn.Module, save_directory, *args, **kwargs):
    if kwargs.get("state_dict") is None and any(isinstance(p, DTensor) for p in self.parameters()):
        raise RuntimeError(
            f"{type(self).__name__}.save_pretrained({save_directory!r}): its parameters are sharded (DTensors), and "
            "peft would write this rank's shards (safetensors refuses them). Gather the full state dict on every "
            "rank, then save on rank 0: `sd = lightning_shard.checkpoint.get_model_state_dict(model, "
            "full_state_dict=True, cpu_offload=True)`, then `if trainer.is_global_zero: model.save_pretrained("
            "directory, state_dict=sd)`; PeftModel.from_pretrained(base_model, directory) reads it back"
        )
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)
