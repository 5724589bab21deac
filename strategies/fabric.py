"""``Fabric(strategy="shard_fsdp_tp")``: the Trainer strategy's engine behind Lightning Fabric's strategy API.

The mesh, the parallelization (TP plan, FSDP units, meta-device materialization, drift check), the option
validation and the precision table are the Trainer strategy's own code: this strategy holds a
``ShardFSDPTPStrategy`` configured with the same options (``self.engine``) and calls it. What is Fabric's
own is the API around it: ``setup_module`` / ``setup_module_and_optimizers`` / ``setup_optimizer``,
``module_init_context``, ``no_backward_sync``, gradient clipping, and ``save_checkpoint`` /
``load_checkpoint`` with Fabric's state dicts (user-chosen keys) in the Trainer's two formats.

Example::

    import strategies  # registers "shard_fsdp_tp" for the Trainer and for Fabric
    fabric = Fabric(accelerator="cpu", devices=2, strategy="shard_fsdp_tp", precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MyModel()                      # on meta, materialized shard by shard in setup
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": 10})
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _apply_filter, _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _Stateful
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard import comm
from lightning_shard.checkpoint import (
    check_optimizer_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from lightning_shard.checkpoint.state_dict import check_param_groups
from lightning_shard.fsdp import FSDPModule, check_optimizer_params
from lightning_shard.fsdp.optimizer_guard import unsharded_fqn
from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor
from lightning_shard.tensor.ops import load_rules
from numba_kernels import warm_kernels
from strategies import agreement, collectives, loading, nodes, parallelize
from strategies.fabric_precision import ShardFabricPrecision
from strategies.input_checks import check_first_forwards, check_initialised_at_first_forward
from strategies.metrics import set_data_parallel_group, sync_metrics_over_data_parallel
from strategies.peft_adapters import wrap_peft_methods
from strategies.strategy import (
    META_FILE,
    ShardFSDPTPStrategy,
    _read_meta,
    _top_level_entries,
    _write_full_checkpoint,
)

# A checkpoint written by the Trainer strategy keeps the model under this key and optimizer i under
# "optimizer_{i}" (sharded) or "optimizer_states"[i] (full); Fabric maps them onto the user's keys on load.
_TRAINER_MODEL_KEY = "state_dict"


class ShardFSDPTPFabricStrategy(ParallelStrategy):
    """FSDP x TP for Lightning Fabric on the ``lightning_shard`` engine; the options are the Trainer strategy's.

    Args:
        data_parallel_size, tensor_parallel_size, fsdp_unit, tp_plan, reshard_after_forward, cpu_offload,
        state_dict_type, sharding_strategy, activation_checkpointing_policy, compile_fsdp_units,
        process_group_backend, timeout:
            as for ``ShardFSDPTPStrategy`` (docs/strategy.md). ``tensor_parallel_size="auto"`` needs the model,
            which Fabric creates after the mesh: it means 1 here (with a message), and the other ``"auto"``
            knobs (checkpointing, resharding, offload) take the strategy's defaults, with a message.
        state_dict_type: ``"sharded"`` (a DCP directory plus ``meta.pt``) or ``"full"`` (one file) for
            ``fabric.save``.

    Example: ``Fabric(devices=4, strategy=ShardFSDPTPFabricStrategy(tensor_parallel_size=2))``.
    """

    strategy_name = "shard_fsdp_tp"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = 1,
        fsdp_unit: str | set[type] | Callable[[nn.Module], bool] = "auto",
        tp_plan: str | dict | None = "auto",
        reshard_after_forward: bool | int | Literal["auto"] = True,
        cpu_offload: bool | Literal["auto"] = False,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        sharding_strategy: str = "FULL_SHARD",
        activation_checkpointing_policy: set[type] | Literal["auto"] | None = None,
        compile_fsdp_units: bool | dict = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        precision=None,
    ) -> None:
        # The Trainer strategy validates the options and later builds the mesh and parallelizes the model.
        self.engine = ShardFSDPTPStrategy(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            fsdp_unit=fsdp_unit,
            tp_plan=tp_plan,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            state_dict_type=state_dict_type,
            sharding_strategy=sharding_strategy,
            activation_checkpointing_policy=activation_checkpointing_policy,
            compile_fsdp_units=compile_fsdp_units,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self.state_dict_type = state_dict_type
        self._num_nodes = 1
        self._backward_sync_control = _ShardBackwardSyncControl()
        self._set_up_modules: list[nn.Module] = []  # whose replicated gradients each backward checks under TP

    # ------------------------------------------------------------------ registry / properties
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="FSDP x TP on the lightning_shard engine")

    @property
    def precision(self) -> ShardFabricPrecision:
        return self._precision if self._precision is not None else ShardFabricPrecision("32-true", self._device())

    @precision.setter
    def precision(self, plugin) -> None:
        # Fabric's connector hands us its generic plugin for the precision string; keep the string, use ours
        # (so "bf16-mixed" means the same as in the Trainer strategy, and unsupported strings raise).
        if plugin is not None and not isinstance(plugin, ShardFabricPrecision):
            # Fabric's MixedPrecision names its accelerator's autocast device (see the Trainer strategy's setter)
            device = getattr(plugin, "device", None) or self._device()
            plugin = ShardFabricPrecision(getattr(plugin, "precision", "32-true"), device)
        self._precision = plugin

    def _device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(data_parallel, tensor_parallel)`` mesh (after ``fabric.launch()``)."""
        return self.engine.device_mesh

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is split over the data-parallel ranks only; the ranks of one TP group see the same batches."""
        return self.engine.distributed_sampler_kwargs

    @property
    def process_group_backend(self) -> str | None:
        return self.engine.process_group_backend

    # ------------------------------------------------------------------ processes and mesh
    def _configure_launcher(self) -> None:
        if self.cluster_environment.creates_processes_externally:
            nodes.check_launched_world(self)  # as the Trainer strategy: devices x num_nodes against the launched world
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        engine = self.engine
        engine.cluster_environment = self.cluster_environment
        engine.parallel_devices = self.parallel_devices
        engine.num_nodes = self.num_nodes
        self.precision.use_device(self.root_device.type)  # autocast where the model runs
        engine._precision_plugin = self.precision  # mp_policy, convert_module, precision: the same table
        engine._process_group_backend = engine._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(self.cluster_environment, engine._process_group_backend, timeout=engine._timeout)
        # before the mesh, as in the Trainer strategy (strategies/agreement.py)
        agreement.check_ranks_agree({"strategy arguments": engine._argument_entries()}, when="about the strategy")
        if engine._tensor_parallel_size == "auto":
            rank_zero_info(
                "shard_fsdp_tp (Fabric): tensor_parallel_size='auto' needs the model before the mesh; using 1"
            )
            engine._tensor_parallel_size = 1
        engine._device_mesh = engine._build_mesh()
        tp = engine._device_mesh.size("tensor_parallel")
        # torchmetrics metrics synchronised by gather_over_data_parallel (those of a set-up module, or the user's
        # own via sync_metrics_over_data_parallel) gather over this mesh's data-parallel ranks; None: the world.
        set_data_parallel_group(engine._device_mesh.get_group("data_parallel") if tp > 1 else None)
        # The engine's one-time loads before the model exists, as in the Trainer strategy (docs/strategy.md).
        warm_kernels(self.root_device)
        load_rules()

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model and optimizers
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True``: parameters on meta, materialized shard by shard in ``setup_module``, buffers
        built on the host as usual (``parallelize.parameters_on_meta``); otherwise on the root device. Both in the
        precision's dtype (``"bf16-true"``: bf16)."""
        stack = ExitStack()
        stack.enter_context(parallelize.parameters_on_meta() if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        pass  # parameters are placed by fully_shard, buffers in setup_module

    def setup_module(self, module: nn.Module) -> nn.Module:
        """TP, FSDP per unit and on the root, meta materialization, drift check (the Trainer strategy's code)."""
        if getattr(module, "_shard_fsdp_tp_done", False):
            return module
        self.engine._check_model_agrees(module)  # before the broadcast and fully_shard pair tensors by position
        if parallelize.is_parallelized(module):
            rank_zero_info("shard_fsdp_tp: the model is already parallelized; left as it is")
            unset = parallelize.materialize(module, self.root_device)
        else:
            self.engine._parallelize(module)
            unset, self.engine._unset_after_materialize = self.engine._unset_after_materialize, None
        wrap_peft_methods(module)
        if self.engine.device_mesh.size("tensor_parallel") > 1:  # its metrics count each TP group's batch once
            sync_metrics_over_data_parallel(module)
        check_first_forwards(module, self.engine.device_mesh)  # the ranks of a TP group must see the same inputs
        if unset is not None:  # a checkpoint loaded before the first forward may still fill them
            check_initialised_at_first_forward(module, unset)
        self._sync_rng_before_training_forwards(module)
        module._shard_fsdp_tp_done = True
        self._set_up_modules.append(module)
        return module

    def _sync_rng_before_training_forwards(self, module: nn.Module) -> None:
        """Fabric has no training step: the TP group's generators are synced before every forward in training
        mode instead (see ``ShardFSDPTPStrategy._sync_tp_rng_states``)."""
        if self.engine.device_mesh.size("tensor_parallel") == 1:
            return
        forwards = itertools.count()

        def pre_forward(mod: nn.Module, args: tuple) -> None:
            if mod.training:
                self.engine._sync_tp_rng_states(before=f"training-mode forward {next(forwards)}")

        module.register_forward_pre_hook(pre_forward)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler=None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard the module, then point the optimizers (created on the unsharded module, no state yet) at the
        sharded parameters of the same names."""
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        for optimizer in optimizers:
            _check_remappable(optimizer, names)
        module = self.setup_module(module)
        sharded = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        _check_optimizers_agree(module, optimizers, [scheduler] if scheduler is not None else [])
        return module, optimizers, scheduler

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        # See ShardFSDPTPStrategy._check_tp_replicated_gradients; fabric.backward(loss) names no module.
        self.engine._check_tp_replicated_gradients([module] if module is not None else self._set_up_modules)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # Parameters the sharding replaced (the optimizer was built before setup_module) get the Fabric fix;
        # unsharded temporaries (built between a forward and its backward) the engine's check, which names one.
        params = [p for g in optimizer.param_groups for p in g["params"]]
        plain = [tuple(p.shape) for p in params if not isinstance(p, DTensor) and unsharded_fqn(p) is None]
        if plain:
            raise ValueError(
                f"shard_fsdp_tp (Fabric): the optimizer holds {len(plain)} parameters that are not sharded (shapes "
                f"{plain[:3]}); it would update copies the model no longer uses. Create the optimizer after "
                "`model = fabric.setup_module(model)`, or pass both to `fabric.setup(model, optimizer)`"
            )
        check_optimizer_params(optimizer)
        _check_optimizers_agree(None, [optimizer])
        return optimizer

    # ------------------------------------------------------------------ gradients
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """One global norm over every shard (``lightning_shard.utils.clip_grad_norm_``); returns it."""
        from lightning_shard.utils import clip_grad_norm_

        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient element; each rank clamps its shards (no communication needed)."""
        self.precision.unscale_gradients(optimizer)
        self.precision.trainer_plugin.clip_grad_by_value(optimizer, clip_val)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"):
        """``fabric.all_reduce``: under tensor parallelism a sum over the default group counts each data-parallel
        replica once (the Trainer strategy's ``reduce``; ``strategies.collectives``)."""
        if isinstance(tensor, Tensor):
            return collectives.reduce_over_data_parallel(tensor, self.engine._device_mesh, group, reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``fabric.all_gather``: under tensor parallelism, over the default group, each data-parallel replica's
        tensor once, ``(data_parallel_size, ...)`` (``strategies.collectives``)."""
        return collectives.all_gather_over_data_parallel(tensor, self.engine._device_mesh, group, sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """True on every rank when all (``all=True``) or any ranks decided True: a count over every rank, not
        ``all_reduce``'s data-parallel sum."""
        return collectives.decided_on_ranks(decision, self.root_device, all)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.engine.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        return comm.broadcast_object(obj, src)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Sharded: a DCP directory (modules and optimizers under their keys, every other entry in ``meta.pt``),
        published atomically. Full: one file, written by rank 0 to a temporary name and renamed. Both are the
        Trainer strategy's formats; ``lightning_shard.checkpoint.consolidate`` reads the directory."""
        if storage_options is not None:
            raise TypeError("shard_fsdp_tp (Fabric): save_checkpoint(storage_options=...) is not supported")
        full = self.state_dict_type == "full"
        if filter is not None and not full:
            raise NotImplementedError(
                "shard_fsdp_tp (Fabric): filtered sharded checkpoints cannot be loaded back strictly; use "
                "state_dict_type='full' to save with a filter"
            )
        path = Path(self.broadcast(str(path)))
        module_key, module = _the_module(state, "save")
        tensors: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                converted, target = get_model_state_dict(obj, full_state_dict=full, cpu_offload=full), tensors
            elif isinstance(obj, Optimizer):
                converted = get_optimizer_state_dict(module, obj, full_state_dict=full, cpu_offload=full)
                target = tensors
            else:
                converted, target = (obj.state_dict() if isinstance(obj, _Stateful) else obj), metadata
            _apply_filter(key, filter or {}, converted, target)
        if full:
            _write_full_checkpoint({**tensors, **metadata}, path, self.global_rank, "shard_fsdp_tp (Fabric)")
        else:
            if path.is_file():
                raise ValueError(f"shard_fsdp_tp (Fabric): {path} is a file; a sharded checkpoint is a directory")
            meta = io.BytesIO()
            torch.save(metadata, meta)
            save(tensors, path, extra_files={META_FILE: meta.getvalue()})
        self.barrier()

    def load_checkpoint(
        self,
        path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a sharded directory or a full file (Fabric's or the Trainer
        strategy's), whatever mesh it was saved on; returns the entries not requested in ``state``."""
        path = Path(self.broadcast(str(path)))
        if not path.exists():
            raise FileNotFoundError(f"shard_fsdp_tp (Fabric): no checkpoint at {path}")
        if not state:
            # Everything, as plain tensors (a sharded directory is consolidated tensor by tensor).
            if loading.is_sharded_checkpoint(path):
                return loading.load_sharded_as_full(path)
            return loading.load_full_file(path, weights_only=weights_only)
        if isinstance(state, nn.Module):
            if path.is_dir():
                raise ValueError(
                    f"shard_fsdp_tp (Fabric): load_raw needs a file with a model state dict; {path} is a directory. "
                    "Use fabric.load(path, {'model': model})"
                )
            state_dict = loading.load_full_file(path)
            _refuse_a_whole_checkpoint(path, state, state_dict)
            set_model_state_dict(state, state_dict, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            raise ValueError(
                "shard_fsdp_tp (Fabric): an optimizer alone cannot be loaded; pass {'model': model, 'optimizer': opt}"
            )
        module_key, module = _the_module(state, "load")
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        requested = state.keys() - {module_key} - optimizers.keys()
        # All or nothing, in the Trainer strategy's order: every key, the optimizer states and (for a directory)
        # meta.pt's checksum are checked before the model or an optimizer is modified.
        load_from = self._load_sharded if path.is_dir() else self._load_full
        remainder = load_from(path, module_key, module, optimizers, requested, strict, weights_only)
        for key in requested:
            if key in remainder:
                obj = state[key]
                value = remainder.pop(key)
                if isinstance(obj, _Stateful):
                    obj.load_state_dict(value)
                else:
                    state[key] = value
        return remainder

    def _load_sharded(self, path, module_key, module, optimizers, requested, strict, weights_only) -> dict[str, Any]:
        keys = loading.saved_keys(path)
        saved = _top_level_entries(keys)
        model_src = _source_key(module_key, saved, [_TRAINER_MODEL_KEY])
        to_load = {model_src: get_model_state_dict(module)}
        optim_src = {}
        for i, (key, optimizer) in enumerate(optimizers.items()):
            src = _source_key(key, saved, [f"optimizer_{i}"], required=strict)
            if src is not None:
                optim_src[key] = src
                to_load[src] = get_optimizer_state_dict(module, optimizer)
                loading.optimizer_template_as_saved(to_load[src], src, keys)

        def check_optimizers(loaded: dict[str, Any]) -> None:  # the param groups, before anything is copied
            for key, src in optim_src.items():
                check_param_groups(module, optimizers[key], loaded[src])

        meta = _read_meta(path, weights_only=weights_only)  # verified against its checksum before the load
        _validate_keys_for_strict_loading(requested, meta.keys(), strict=strict)
        load(to_load, path, strict=strict, before_commit=check_optimizers)
        for key, src in optim_src.items():  # tensors are in place already; this sets the hyperparameters
            set_optimizer_state_dict(module, optimizers[key], to_load[src])
        return meta

    def _load_full(self, path, module_key, module, optimizers, requested, strict, weights_only) -> dict[str, Any]:
        checkpoint = loading.load_full_file(path, weights_only=weights_only)
        model_src = _source_key(module_key, checkpoint.keys(), [_TRAINER_MODEL_KEY])
        model_state = checkpoint.pop(model_src)
        trainer_list = checkpoint.pop("optimizer_states", None) if model_src == _TRAINER_MODEL_KEY else None
        optim_states = {}
        for i, key in enumerate(optimizers):
            if key in checkpoint:
                optim_states[key] = checkpoint.pop(key)
            elif trainer_list is not None and i < len(trainer_list):
                optim_states[key] = trainer_list[i]
            elif strict:
                raise KeyError(
                    f"shard_fsdp_tp (Fabric): the checkpoint {path} has no optimizer state for {key!r}; "
                    "load with strict=False to skip it"
                )
        _validate_keys_for_strict_loading(requested, checkpoint.keys(), strict=strict)
        for key, optim_state in optim_states.items():  # before the model is touched
            check_optimizer_state_dict(module, optimizers[key], optim_state)
        set_model_state_dict(module, model_state, strict=strict)
        for key, optim_state in optim_states.items():
            set_optimizer_state_dict(module, optimizers[key], optim_state)
        return checkpoint

    def teardown(self) -> None:
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()


class _ShardBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: no reduce-scatter in backward; gradients accumulate unsharded locally
    and are reduced, with the accumulated sum, by the first backward outside the context."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return _NoSync(module) if enabled else nullcontext()


class _NoSync(AbstractContextManager):
    def __init__(self, module: nn.Module) -> None:
        self.fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]

    def __enter__(self) -> None:
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(False, recurse=False)

    def __exit__(self, *exc: Any) -> None:
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def _refuse_a_whole_checkpoint(path: Path, module: nn.Module, state_dict: dict[str, Any]) -> None:
    """Raise when ``load_raw(path, module)`` was given a whole ``fabric.save`` file (``{"model": {...}, ...}``)
    instead of a model state dict: none of the module's keys is at the top level, but one entry holds them.

    Why: with ``strict=False`` nothing would be loaded and nothing said; with ``strict=True`` the error listed
    every parameter as missing without saying where they are.
    """
    own = module.state_dict(keep_vars=True).keys()
    if not own or any(key in state_dict for key in own):
        return
    holders = [k for k, v in state_dict.items() if isinstance(v, Mapping) and any(key in v for key in own)]
    if holders:
        raise ValueError(
            f"shard_fsdp_tp (Fabric): {path} is a whole checkpoint whose entry {holders[0]!r} holds the model's "
            f"state dict (top-level keys: {sorted(state_dict)[:6]}); load_raw needs a plain model state dict. "
            f"Use fabric.load(path, {{{holders[0]!r}: model}})"
        )


def _the_module(state: dict[str, Any], what: str) -> tuple[str, nn.Module]:
    """The one sharded module in a Fabric state dict (its optimizer states are keyed by its parameter names)."""
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module) and parallelize.is_parallelized(v)]
    if len(modules) != 1:
        raise ValueError(
            f"shard_fsdp_tp (Fabric): {what} needs exactly one model set up by Fabric in the state, found "
            f"{[k for k, _ in modules]}; pass it as {{'model': model, ...}} (one model per checkpoint)"
        )
    return modules[0]


def _source_key(key: str, saved, fallbacks: list[str], required: bool = True) -> str | None:
    """The checkpoint entry for the user's ``key``: the key itself, else the Trainer strategy's name for it."""
    if key in saved:
        return key
    for fallback in fallbacks:
        if fallback in saved:
            return fallback
    if required:
        raise KeyError(
            f"shard_fsdp_tp (Fabric): the checkpoint has no entry {key!r} (nor {fallbacks}); its entries are "
            f"{sorted(saved)}"
        )
    return None


def _check_remappable(optimizer: Optimizer, names: dict[int, str]) -> None:
    if optimizer.state:
        raise ValueError(
            "shard_fsdp_tp (Fabric): the optimizer already has state; set up the model and optimizer before the "
            "first step (the state would belong to the unsharded parameters)"
        )
    unknown = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if unknown:
        raise ValueError(
            f"shard_fsdp_tp (Fabric): the optimizer holds {len(unknown)} parameters that are not the model's "
            f"(shapes {unknown[:3]}); create it from model.parameters()"
        )


def _check_optimizers_agree(module: nn.Module | None, optimizers: list, schedulers: list | None = None) -> None:
    """Raise on every rank unless every rank set up the same optimizers (type, param groups, hyper-parameters):
    under FSDP each rank updates its own shard, so different learning rates train silently wrong."""
    sections = {"optimizers": agreement.optimizer_entries(module, optimizers, schedulers or [])}
    agreement.check_ranks_agree(sections, when="about the optimizers (at setup)")
