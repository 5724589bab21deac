"""Precision for "shard_fsdp_tp": Lightning's precision strings mapped onto FSDP's MixedPrecisionPolicy.

=============  ==========================  ==============================================================
precision      master weights              compute / gradient reduction
=============  ==========================  ==============================================================
"32-true"      fp32                        fp32 / fp32
"bf16-mixed"   fp32                        bf16 under autocast (FSDP casts the gathered params) / fp32
"16-mixed"     fp32                        fp16 under autocast / fp32, loss scaled by a sharded gradient scaler
"bf16-true"    bf16                        bf16 / fp32
"16-true"      fp16                        fp16 / fp32
"64-true"      fp64                        fp64 / fp64 (the default dtype is float64 in each step, as in
                                           Lightning's ``DoublePrecision``)
=============  ==========================  ==============================================================

"-mixed" means what it means in Lightning: the step runs under ``torch.autocast(device, dtype)``, so the ops
autocast keeps in fp32 (losses everywhere; on CUDA also softmax, log_softmax, layer_norm, ...) compute in fp32.
FSDP still all-gathers the parameters in the low dtype (half the communication and memory of fp32); autocast
then finds them already in that dtype for matmuls and upcasts them for its fp32 ops. This is torch's FSDP2
``MixedPrecisionPolicy(param_dtype=bf16)`` plus autocast, what Lightning's ``ModelParallelStrategy`` gives with
``precision="bf16-mixed"``. Ops outside autocast's lists (embedding, add, gelu, ...) follow their inputs' dtype:
bf16 here, fp32 under DDP's autocast, whose weights stay fp32 (docs/strategy.md gives the measured difference).

Example: ``Trainer(strategy="shard_fsdp_tp", precision="bf16-mixed")``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_shard import comm
from lightning_shard.fsdp import MixedPrecisionPolicy
from lightning_shard.tensor import DTensor

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "32", "64")

_POLICIES = {
    "32-true": MixedPrecisionPolicy(),
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "16-mixed": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
    "bf16-true": MixedPrecisionPolicy(reduce_dtype=torch.float32),
    "16-true": MixedPrecisionPolicy(reduce_dtype=torch.float32),
    "64-true": MixedPrecisionPolicy(),  # gathered and reduced in float64 (the staging copies take torch's path)
}
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
_ALIASES = {"32": "32-true", "64": "64-true"}
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ShardedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose unscale works on sharded (DTensor) gradients: each rank unscales its shards and the
    "found inf" flag is all-reduced, so every rank skips or takes the step together.

    The unscale and the inf/NaN check are ``torch._amp_foreach_non_finite_check_and_unscale_`` over the local
    shards, one call per (device, dtype), as torch's GradScaler and FSDP2's ShardedGradScaler do: the flag stays
    on the device, so there is no host synchronisation per gradient. CPU-offloaded gradients are checked on
    the host and their flag added to the device's.

    Example: ``ShardedGradScaler("cuda")`` (used by ``"16-mixed"``).
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                by_device.setdefault((g.device, g.dtype), []).append(g)
        found = torch.zeros_like(found_inf)  # 0-dim in torch's GradScaler
        for (device, _), grads in by_device.items():
            flag = torch.zeros((), dtype=found.dtype, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
            found.add_(flag.to(found.device))
        if dist.is_initialized():
            comm.all_reduce(found, dist.group.WORLD, "max")
        found_inf.copy_(found.clamp_(max=1.0))
        return {found_inf.device: found_inf}


class ShardPrecision(Precision):
    """Lightning precision plugin for "shard_fsdp_tp" (see the module docstring).

    >>> ShardPrecision("bf16-mixed").mp_policy.param_dtype, ShardPrecision("16-mixed", "cpu").scaler is not None
    (torch.bfloat16, True)
    """

    def __init__(self, precision: str, device: str = "cpu") -> None:
        precision = _ALIASES.get(precision, precision)
        if precision not in _POLICIES:
            raise ValueError(f"shard_fsdp_tp: precision={precision!r} is not supported; use one of {sorted(_POLICIES)}")
        self.precision = precision
        self.device = torch.device(device).type  # autocast takes the device type
        self.scaler = ShardedGradScaler(device) if precision == "16-mixed" else None

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return _POLICIES[self.precision]

    def use_device(self, device_type: str) -> None:
        """Autocast (and the fp16 gradient scaler) on ``device_type``, the strategy's root device type once the
        devices are known. Before that the type is a guess: Lightning's own plugin names ``"cuda"`` for every
        accelerator it does not know by name (an ``Accelerator`` instance, say). A type autocast does not support
        (the simulator's stand-in device) keeps the guess.

        Example: ``plugin.use_device(strategy.root_device.type)`` (in the strategies' ``setup_environment``).
        """
        if device_type == self.device or not torch.amp.is_autocast_available(device_type):
            return
        self.device = device_type
        if self.scaler is not None:
            self.scaler = ShardedGradScaler(device_type)

    def forward_context(self):
        """``torch.autocast(device, dtype)`` for the "-mixed" precisions (around every step, as Lightning's
        ``MixedPrecision`` does); for the "-true" precisions their dtype as the default dtype, as Lightning's
        ``HalfPrecision`` and ``DoublePrecision`` do (a tensor a step creates without a dtype is bfloat16,
        float16 or float64, as on one device); nothing for "32-true"."""
        true_dtype = _TRUE_DTYPES.get(self.precision)
        if true_dtype is not None:
            return _default_dtype(true_dtype)
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        return torch.autocast(self.device, dtype=dtype) if dtype is not None else nullcontext()

    def convert_module(self, module: nn.Module) -> nn.Module:
        dtype = _TRUE_DTYPES.get(self.precision)
        return module.to(dtype) if dtype is not None else module

    def tensor_init_context(self):
        dtype = _TRUE_DTYPES.get(self.precision)
        return _default_dtype(dtype) if dtype is not None else nullcontext()

    def module_init_context(self):
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        dtype = _TRUE_DTYPES.get(self.precision)
        if dtype is None:
            return data

        def cast(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return torch.utils._pytree.tree_map(cast, data)

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        skipped = closure_result is None
        if not model.automatic_optimization or not skipped:
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return step_output
        return closure_result

    def clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        """One global norm over every gradient, sharded or plain (our mesh-aware clip_grad_norm_)."""
        from lightning_shard.utils import clip_grad_norm_

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        clip_grad_norm_(params, clip_val)

    def clip_grad_by_value(self, optimizer, clip_val: float) -> None:
        """Clamp every gradient element; shards are clamped locally (no communication needed)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                    g.clamp_(-clip_val, clip_val)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class _default_dtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self):
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.previous)
