"""Precision for ``Fabric(strategy="shard_fsdp_tp")``: the Trainer's table (``strategies.precision``) behind
Fabric's precision-plugin interface.

The same precision string gives the same FSDP ``MixedPrecisionPolicy``, the same master-weight dtype, the same
forward context and the same sharded gradient scaler as ``Trainer(strategy="shard_fsdp_tp")``; only the calls
differ (Fabric's ``backward``/``optimizer_step(optimizer)`` instead of Lightning's closure-based loop).

Example::

    fabric = Fabric(accelerator="cpu", devices=2, strategy="shard_fsdp_tp", precision="bf16-mixed")
    fabric.strategy.precision            # a ShardFabricPrecision
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.fsdp import MixedPrecisionPolicy
from strategies.precision import ShardPrecision


class ShardFabricPrecision(FabricPrecision):
    """Fabric precision plugin for "shard_fsdp_tp": every choice is delegated to the Trainer's ``ShardPrecision``.

    Args:
        precision: a Lightning precision string (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
            ``"16-true"``); anything else raises ``ValueError``.
        device: the device type autocast and the gradient scaler run on.

    >>> ShardFabricPrecision("bf16-mixed", "cpu").mp_policy.param_dtype
    torch.bfloat16
    """

    def __init__(self, precision: str, device: str = "cpu") -> None:
        self.trainer_plugin = ShardPrecision(precision, device)
        self.precision = self.trainer_plugin.precision
        self.scaler = self.trainer_plugin.scaler

    def use_device(self, device_type: str) -> None:
        """``ShardPrecision.use_device``: autocast and the scaler on the root device's type.

        Example: ``plugin.use_device(strategy.root_device.type)``.
        """
        self.trainer_plugin.use_device(device_type)
        self.scaler = self.trainer_plugin.scaler

    # ------------------------------------------------------------------ what the engine reads
    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self.trainer_plugin.mp_policy

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.trainer_plugin.convert_module(module)

    def tensor_init_context(self) -> AbstractContextManager:
        return self.trainer_plugin.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.trainer_plugin.module_init_context()

    # ------------------------------------------------------------------ forward
    def forward_context(self) -> AbstractContextManager:
        return self.trainer_plugin.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self.trainer_plugin.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        # As Fabric's own MixedPrecision/HalfPrecision: outputs come back in the default dtype (fp32), so a loss
        # computed on them outside the model is fp32 as well.
        if self.precision == "32-true":
            return data

        def cast(x):
            if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != torch.get_default_dtype():
                return x.to(torch.get_default_dtype())
            return x

        return torch.utils._pytree.tree_map(cast, data)

    # ------------------------------------------------------------------ backward and step
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        step_output = self.scaler.step(optimizer, **kwargs)  # skipped on every rank when any rank overflowed
        self.scaler.update()
        return step_output

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.trainer_plugin.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trainer_plugin.load_state_dict(state_dict)
