"""The strategy's ``"auto"`` knobs: which ones the user left to the planner, and the settings a
:class:`~lightning_shard.planner.plan.Configuration` turns into.

Four knobs accept ``"auto"``: ``tensor_parallel_size``, ``activation_checkpointing_policy``,
``reshard_after_forward`` and ``cpu_offload``. The planner (``choose_configuration``) searches the ones left
``"auto"`` and keeps the user's value for the others; :func:`settings` maps its answer onto the strategy's
arguments. When the planner cannot run, :data:`FALLBACK` (the conservative defaults) stands in for it.

Example::

    request = Request(tensor_parallel_size=1, activation_checkpointing_policy="auto",
                      reshard_after_forward=True, cpu_offload=False)
    settings(request, configuration, model)
    # {'tensor_parallel_size': 1, 'activation_checkpointing_policy': {Block}, 'reshard_after_forward': True, ...}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

AUTO = "auto"
# What an "auto" knob becomes when the planner cannot run on the model: the strategy's own defaults (the
# least surprising choice: no TP, no recomputation, parameters freed after forward, nothing on the host).
FALLBACK = {
    "tensor_parallel_size": 1,
    "activation_checkpointing_policy": None,
    "reshard_after_forward": True,
    "cpu_offload": False,
}


@dataclass(frozen=True)
class Request:
    """The four knobs as the user set them (each a value or ``"auto"``)."""

    tensor_parallel_size: int | str
    activation_checkpointing_policy: object
    reshard_after_forward: bool | int | str
    cpu_offload: bool | str

    def auto_knobs(self) -> list[str]:
        """The names of the knobs left to the planner, in argument order."""
        return [name for name, value in asdict(self).items() if _is_auto(value)]

    def planner_kwargs(self) -> dict:
        """The planner's names for the knobs: ``"auto"`` to search, the user's value otherwise."""
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "activation_checkpointing": self.activation_checkpointing_policy,
            "reshard_after_forward": self.reshard_after_forward,
            "cpu_offload": self.cpu_offload,
        }


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


def settings(request: Request, configuration, model: nn.Module | None) -> dict:
    """The strategy's four settings: the user's value where given, else the configuration's (``None``: the
    planner did not run, :data:`FALLBACK`). The planner's activation checkpointing ``"full"`` (every repeated
    block recomputed) becomes the set of the repeated block classes, what ``fsdp_unit="auto"`` wraps."""
    chosen = FALLBACK if configuration is None else {
        "tensor_parallel_size": configuration.tensor_parallel_size,
        "activation_checkpointing_policy": _policy(configuration.activation_checkpointing, model),
        "reshard_after_forward": configuration.reshard_after_forward,
        "cpu_offload": configuration.cpu_offload,
    }  # fmt: skip
    return {name: chosen[name] if _is_auto(value) else value for name, value in asdict(request).items()}


def _policy(checkpointing, model: nn.Module | None):
    if checkpointing is None:
        return None
    if checkpointing == "full":
        from lightning_shard.fsdp.units import find_repeated_blocks

        classes = {type(b) for b in find_repeated_blocks(model)} if model is not None else set()
        return classes or None
    return set(checkpointing)  # a policy the user passed reaches the planner and comes back as a frozenset


def describe(values: dict) -> str:
    """One line: ``TP 1, activation checkpointing {Block}, reshard_after_forward True, cpu_offload False``."""
    policy = values["activation_checkpointing_policy"]
    ac = "off" if not policy else "{" + ", ".join(sorted(c.__name__ for c in policy)) + "}"
    return (
        f"TP {values['tensor_parallel_size']}, activation checkpointing {ac}, "
        f"reshard_after_forward {values['reshard_after_forward']}, cpu_offload {values['cpu_offload']}"
    )
