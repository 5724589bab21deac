"""The strategy's ``"auto"`` knobs: which ones the user left to the planner, and the settings a
:class:`~lightning_shard.planner.plan.Configuration` turns into.

Four knobs accept ``"auto"``: ``tensor_parallel_size``, ``activation_checkpointing_policy``,
``reshard_after_forward`` and ``cpu_offload``. The planner (``choose_configuration``) searches the ones left
``"auto"`` and keeps the user's value for the others; :func:`settings` maps its answer onto the strategy's
arguments. When the planner cannot run, :data:`FALLBACK` (the conservative defaults) stands in for it.
:func:`planner_step` says what the planner runs on a LightningModule (its ``example_input_array``, or a batch of
its train data through ``training_step``).

Example::

    request = Request(tensor_parallel_size=1, activation_checkpointing_policy="auto",
                      reshard_after_forward=True, cpu_offload=False)
    settings(request, configuration, model)
    # {'tensor_parallel_size': 1, 'activation_checkpointing_policy': {Block}, 'reshard_after_forward': True, ...}
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch
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


def planner_step(module: nn.Module, batch: int, seq_len: int) -> tuple[Callable | None, Callable | None, int, int]:
    """What the planner runs on its meta copy of a LightningModule: ``(example_input, step, batch, seq_len)``.

    ``example_input_array`` when set, passed as Lightning passes it (a tuple or list unpacked into
    ``module(*inputs)``, a dict as ``module(**inputs)``); otherwise the first batch of the train dataloader
    (``trainer.fit(train_dataloaders=...)``, the datamodule's or the module's), run through
    ``training_step(batch, 0)``; otherwise ``(None, None, batch, seq_len)``: the planner's default (token ids for
    the first embedding through ``forward``). The micro-batch and sequence length come from the data when there
    is data (the first tensor's dims 0 and 1), else from ``batch`` / ``seq_len``. The planner asks for other
    micro-batches (its "micro-batch N" advice): every tensor whose first dim is the data's batch gets that size.

    Example::

        example_input, step, batch, seq_len = planner_step(lightning_module, 1, 2048)
        plan(lightning_module, 8, 8, "80GB", batch=batch, seq_len=seq_len, example_input=example_input, step=step)
    """
    sample = getattr(module, "example_input_array", None)
    if sample is not None:
        inputs = tuple(sample) if isinstance(sample, (list, tuple)) else (sample,)
        data_batch, data_seq = _batch_and_seq(inputs, batch, seq_len)
        return (lambda b, t, d: _on_meta(inputs, data_batch, b)), None, data_batch, data_seq
    data = first_train_batch(module)
    if data is not None:
        data_batch, data_seq = _batch_and_seq(data, batch, seq_len)
        return (
            (lambda b, t, d: (_on_meta(data, data_batch, b),)),
            (lambda m, inputs: m.training_step(inputs[0], 0)),
            data_batch,
            data_seq,
        )
    return None, None, batch, seq_len


def first_train_batch(module: nn.Module):
    """A first batch of the train data the Trainer will use (dataloaders passed to ``fit``, the datamodule's,
    the module's ``train_dataloader``), or ``None`` when there is none yet: for its shapes, so a map-style
    ``DataLoader``'s first samples in order (``_in_order``). Drawing it leaves every random generator as it was
    (the loader's own, torch's, Python's and NumPy's: a dataset may use them), so the planner's look does not
    change the run it plans.

    Several train dataloaders (a list, tuple or dict of them, or a ``CombinedLoader``) give the batch Lightning
    hands ``training_step``: the same structure holding each loader's first batch.

    Example: ``first_train_batch(lightning_module)`` -> ``(x, y)``.
    """
    trainer = getattr(module, "_trainer", None)
    owners = []
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    given = getattr(source, "instance", None)
    if given is not None and not hasattr(given, "train_dataloader"):  # trainer.fit(model, train_dataloaders=...)
        owners.append(lambda: given)
    for owner in (getattr(trainer, "datamodule", None), module):
        make = getattr(owner, "train_dataloader", None) if owner is not None else None
        if make is not None:
            owners.append(make)
    for make in owners:
        try:
            with _random_states_kept():
                return _first_batch(make())
        except Exception:  # noqa: BLE001 - no data yet (or not defined): the planner falls back to its default
            continue
    return None


def _first_batch(data):
    """The first batch ``data`` gives ``training_step``, built as Lightning's training loop builds it: through a
    ``CombinedLoader`` (what ``fit`` wraps any train data in), so a list, tuple or dict of loaders gives the same
    structure of each loader's first batch. A new one over loaders taken in order (``_in_order``): the user's
    own stays untouched. Every mode ``fit`` accepts starts with every loader's first batch."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    combined = CombinedLoader(data.iterables if isinstance(data, CombinedLoader) else data, "max_size_cycle")
    combined.flattened = [_in_order(loader) for loader in combined.flattened]
    batch, _, _ = next(iter(combined))
    return batch


def _in_order(data):
    """A map-style ``DataLoader``'s first batch taken in order, in this process: the planner needs its shapes, and
    the loader's own sampler and workers would draw from its generator (its shuffle order, the workers' seeds)
    or leave persistent workers behind, changing the run it plans. Anything else as it is."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(data, DataLoader) and data.batch_size is not None and not isinstance(data.dataset, IterableDataset):
        return DataLoader(data.dataset, batch_size=data.batch_size, collate_fn=data.collate_fn)
    return data


@contextmanager
def _random_states_kept():
    """Restore torch's CPU generator, Python's and NumPy's global random states on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _batch_and_seq(obj, batch: int, seq_len: int) -> tuple[int, int]:
    """The first tensor's dims 0 and 1 (micro-batch, sequence length); the defaults where it has none."""
    flat = [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]
    if not flat or flat[0].ndim == 0:
        return batch, seq_len
    first = flat[0]
    return int(first.shape[0]), int(first.shape[1]) if first.ndim > 1 else seq_len


def _on_meta(obj, data_batch: int, batch: int):
    """``obj``'s tensors on the meta device, those with ``data_batch`` rows resized to ``batch`` rows."""

    def meta(t: torch.Tensor) -> torch.Tensor:
        if t.ndim and t.shape[0] == data_batch:
            return t.new_empty((batch, *t.shape[1:]), device="meta")
        return t.to("meta")

    return torch.utils._pytree.tree_map_only(torch.Tensor, meta, obj)
