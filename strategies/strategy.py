"""ShardFSDPTPStrategy: ``Trainer(strategy="shard_fsdp_tp")`` shards any LightningModule with our engine.

At setup the strategy builds a ``(data_parallel, tensor_parallel)`` mesh (``self.device_mesh`` on the
LightningModule), runs ``configure_model`` (meta-device init welcome), applies tensor parallelism (auto
plan) and ``fully_shard`` per block and on the root, materializes meta parameters shard by shard, and checks
that no parameter can drift across ranks. A model the user already parallelized in ``configure_model`` is
left as it is.

Example::

    import strategies  # registers "shard_fsdp_tp"
    trainer = Trainer(accelerator="cpu", devices=2, strategy="shard_fsdp_tp", precision="bf16-mixed")
    trainer.fit(model)
"""

from __future__ import annotations

import io
import math
import os
import shutil
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from lightning_shard import comm
from lightning_shard.checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from lightning_shard.mesh import DeviceMesh, init_device_mesh
from lightning_shard.tensor.ops import load_rules
from numba_kernels import warm_kernels
from strategies import parallelize
from strategies.precision import ShardPrecision

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint

_SHARDING = {
    # FSDP1 name -> (hybrid?, reshard_after_forward, no_shard?)
    "FULL_SHARD": (False, True, False),
    "SHARD_GRAD_OP": (False, False, False),
    "NO_SHARD": (False, False, True),
    "HYBRID_SHARD": (True, True, False),
    "_HYBRID_SHARD_ZERO2": (True, False, False),
}


class ShardFSDPTPStrategy(ParallelStrategy):
    """FSDP x TP for Lightning on the ``lightning_shard`` engine. Every argument has a default.

    Args:
        data_parallel_size: ranks per data-parallel group; ``"auto"`` = world size / TP size.
        tensor_parallel_size: 1 (FSDP only), an int, or ``"auto"`` (the planner's choice, or 1 without one).
        fsdp_unit: ``"auto"`` (the repeated block class), a set of module classes, or a callable.
        tp_plan: ``"auto"`` (``lightning_shard.tp.auto_tp_plan``), a plan dict, or ``None`` (no TP).
        reshard_after_forward: free gathered parameters after forward (True), keep them (False), or keep a
            k-way shard for a backward all-gather over k neighbouring ranks (int k; see ``fully_shard``).
            ``sharding_strategy`` names without resharding override it.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU.
        state_dict_type: ``"sharded"`` (a DCP directory) or ``"full"`` (one file) for checkpoints.
        sharding_strategy: FSDP1's names, so Lightning ``FSDPStrategy`` users switch by one string.
        activation_checkpointing_policy: module classes whose forward is recomputed in backward.
        planner_batch, planner_seq_len: micro-batch and sequence length the planner sizes activations for
            when ``tensor_parallel_size="auto"``.
        process_group_backend, timeout, start_method: process-group and launcher settings.

    Example: ``ShardFSDPTPStrategy(tensor_parallel_size=2, state_dict_type="full")``.
    """

    strategy_name = "shard_fsdp_tp"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = 1,
        fsdp_unit: str | set[type] | Callable[[nn.Module], bool] = "auto",
        tp_plan: str | dict | None = "auto",
        reshard_after_forward: bool | int = True,
        cpu_offload: bool = False,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        sharding_strategy: str = "FULL_SHARD",
        activation_checkpointing_policy: set[type] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn"] = "popen",
        planner_batch: int = 1,
        planner_seq_len: int = 2048,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        _check_choice("sharding_strategy", sharding_strategy, _SHARDING)
        _check_choice("state_dict_type", state_dict_type, ("sharded", "full"))
        _check_choice("start_method", start_method, ("popen", "spawn"))
        _check_size("data_parallel_size", data_parallel_size)
        _check_size("tensor_parallel_size", tensor_parallel_size)
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self.fsdp_unit = fsdp_unit
        self.tp_plan = tp_plan
        self.sharding_strategy = sharding_strategy
        hybrid, reshard, _ = _SHARDING[sharding_strategy]
        self.reshard_after_forward = reshard_after_forward if reshard else False
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.planner_batch = planner_batch
        self.planner_seq_len = planner_seq_len
        self._device_mesh: DeviceMesh | None = None
        self.num_nodes = 1
        self.parallel_summary: dict = {}
        self.planner_table: str | None = None  # the planner's table when tensor_parallel_size="auto"

    # ------------------------------------------------------------------ registry / properties
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="FSDP x TP on the lightning_shard engine")

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("shard_fsdp_tp: the device mesh exists only after the processes are set up")
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning asks this of custom strategies to decide on the distributed sampler."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The sampler splits data over the data-parallel ranks only; TP ranks of one group see the same data."""
        mesh = self.device_mesh
        dp_dims = [n for n in mesh.mesh_dim_names if n != "tensor_parallel"]
        sizes = [mesh.size(n) for n in dp_dims]
        coords = [mesh.get_local_rank(n) for n in dp_dims]
        rank = 0
        for size, coord in zip(sizes, coords):
            rank = rank * size + coord
        return {"num_replicas": math.prod(sizes), "rank": rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizer state can only be loaded into the sharded optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it in place

    @ParallelStrategy.precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        # Lightning hands us its generic plugin for the precision string; keep the string, use ours.
        if plugin is not None and not isinstance(plugin, ShardPrecision):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            plugin = ShardPrecision(getattr(plugin, "precision", "32-true"), device)
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ processes and mesh
    def _configure_launcher(self) -> None:
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "spawn":
            self._launcher = _MultiProcessingLauncher(self, start_method="spawn")
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        self._device_mesh = self._build_mesh()
        self.lightning_module._device_mesh = self._device_mesh
        # The engine's one-time loads (numba kernels, DTensor op rules) now, before the model exists: neither the
        # first step nor the memory around the model pays for them (docs/strategy.md).
        warm_kernels(self.root_device)
        load_rules()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _build_mesh(self) -> DeviceMesh:
        world = self.world_size
        tp = self._tensor_parallel_size
        if tp == "auto":
            tp = self._plan_tensor_parallel_size(world)
        dp = world // tp if self._data_parallel_size == "auto" else self._data_parallel_size
        if world % tp:
            raise ValueError(
                f"shard_fsdp_tp: tensor_parallel_size={tp} does not divide the {world} devices; choose a divisor"
            )
        if dp * tp != world:
            raise ValueError(
                f"shard_fsdp_tp: data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} but the world "
                f"size is {world}; make the product equal the number of devices (or use 'auto')"
            )
        device_type = self.root_device.type
        hybrid, _, no_shard = _SHARDING[self.sharding_strategy]
        if (hybrid or no_shard) and tp > 1:
            raise ValueError(
                f"shard_fsdp_tp: sharding_strategy={self.sharding_strategy!r} with tensor_parallel_size={tp} is not "
                "supported; use FULL_SHARD or SHARD_GRAD_OP with tensor parallelism"
            )
        if no_shard:
            return init_device_mesh(
                device_type, (dp, 1, tp), mesh_dim_names=("replicate", "data_parallel", "tensor_parallel")
            )
        if hybrid:
            per_node = max(1, self.num_processes)
            replicas = dp // per_node if dp % per_node == 0 and dp > per_node else 1
            return init_device_mesh(
                device_type,
                (replicas, dp // replicas, tp),
                mesh_dim_names=("replicate", "data_parallel", "tensor_parallel"),
            )
        return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))

    def _plan_tensor_parallel_size(self, world: int) -> int:
        """``tensor_parallel_size="auto"``: the memory planner's choice (the smallest TP that fits), logged with
        its table. Needs the model's layers at this point (built in ``__init__``); a model built later in
        ``configure_model`` gets TP 1 with a message saying why."""
        module = self.lightning_module
        if next(module.parameters(), None) is None:
            rank_zero_info(
                "shard_fsdp_tp: tensor_parallel_size='auto' needs the layers before configure_model; using 1"
            )
            return 1
        from lightning_shard.planner import choose_tensor_parallel_size

        if self.root_device.type == "cuda":
            memory = torch.cuda.get_device_properties(self.root_device).total_memory
        else:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, self.num_processes)
        try:
            tp, table = choose_tensor_parallel_size(
                module, world, max(1, self.num_processes), memory, self.precision_plugin.precision,
                batch=self.planner_batch, seq_len=self.planner_seq_len, cpu_offload=self.cpu_offload,
                reshard_after_forward=self.reshard_after_forward,
            )  # fmt: skip
        except ValueError:
            raise  # nothing fits: the planner's message lists the smallest requirement and the options
        except Exception as e:  # the planner could not run this model's forward on meta
            rank_zero_info(f"shard_fsdp_tp: the planner could not estimate this model ({e!r}); using TP 1")
            return 1
        rank_zero_info(f"shard_fsdp_tp: tensor_parallel_size='auto' chose {tp}:\n{table}")
        self.planner_table = table
        return tp

    def _fsdp_mesh(self) -> DeviceMesh:
        mesh = self.device_mesh
        if "replicate" in mesh.mesh_dim_names:
            return mesh["replicate", "data_parallel"]
        return mesh["data_parallel"]

    # ------------------------------------------------------------------ model setup
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # empty_init=True: build on meta; parameters are materialized shard by shard after sharding.
        meta = torch.device("meta") if empty_init else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        model = self.model
        if getattr(model, "_shard_fsdp_tp_done", False):
            pass  # parallelized by this strategy in an earlier Trainer call (e.g. validate, then fit)
        elif parallelize.is_parallelized(model):
            rank_zero_info("shard_fsdp_tp: the model is already parallelized in configure_model; left as it is")
        else:
            self._parallelize(model)
            model._shard_fsdp_tp_done = True
        self.model = model
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _parallelize(self, model: nn.Module) -> None:
        model = self.precision_plugin.convert_module(model)
        has_meta = any(p.is_meta for p in model.parameters())
        if not has_meta:
            # Shard first, then move the shards (FSDP1's device_id): fully_shard moves one unit's parameters at a
            # time, so a model that fits on the host but not on one device is never whole on it. The broadcast
            # runs on the host over the mesh's groups, which carry host tensors. TP shards plain tensors where
            # they are, so with TP the model goes to the device first.
            if self.device_mesh.size("tensor_parallel") > 1:
                _move_tensors(model, self.root_device, parameters=True)
            parallelize.broadcast_plain_model(model, self.device_mesh)
        summary = parallelize.apply_parallelism(
            model,
            self.device_mesh,
            fsdp_unit=self.fsdp_unit,
            tp_plan=self.tp_plan,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.precision_plugin.mp_policy,
            cpu_offload=self.cpu_offload,
            fsdp_mesh=self._fsdp_mesh(),
            activation_checkpointing_policy=self.activation_checkpointing_policy,
        )
        parallelize.materialize(model, self.root_device)
        _move_tensors(model, self.root_device, parameters=False)
        parallelize.check_no_drift(model)
        self.parallel_summary = summary
        units = summary["fsdp_units"]
        plan = summary["tp_plan"]
        mesh = dict(zip(self.device_mesh.mesh_dim_names, self.device_mesh.shape))
        rank_zero_info(
            f"shard_fsdp_tp: mesh {mesh}, precision {self.precision_plugin.precision}, FSDP units: "
            f"{len(units)} x {units[0] if units else '-'} + root, TP plan: {len(plan) if plan else 0} entries"
        )

    # The LightningModule is the root FSDP module, but Lightning calls training_step, not forward: route each
    # step through the module's __call__ so the root's hooks (unshard, reshard, backward hooks) run.
    def training_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.train_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.val_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.test_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.predict_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "predict_step", *args, **kwargs)

    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def model_to_device(self) -> None:
        pass  # parameters are placed by fully_shard; buffers in _parallelize

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: our DTensors (each rank its shards). Full: plain tensors on rank 0, gathered one at a time."""
        full = self.state_dict_type == "full"
        return get_model_state_dict(self.model, full_state_dict=full, cpu_offload=full)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (not index), sharded or full like the model."""
        full = self.state_dict_type == "full"
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return get_optimizer_state_dict(self.model, optimizer, full_state_dict=full, cpu_offload=full)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint loads the model in place

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint loads the optimizers in place

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        """Sharded: a DCP directory (model under "state_dict", optimizers under "optimizer_{i}", the rest of
        Lightning's checkpoint in ``meta.pt``), published atomically. Full: one file written by rank 0 to a
        temporary name and renamed, so a crash never leaves a half-written checkpoint under ``filepath``."""
        if storage_options is not None:
            raise TypeError("shard_fsdp_tp: save_checkpoint(storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        if self.state_dict_type == "sharded":
            state = {"state_dict": checkpoint.pop("state_dict")}
            for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{i}"] = optim_state
            meta = io.BytesIO()
            torch.save(checkpoint, meta)
            if path.is_file():
                raise ValueError(f"shard_fsdp_tp: {path} is a file; a sharded checkpoint is a directory")
            save(state, path, extra_files={META_FILE: meta.getvalue()})
        elif self.global_rank == 0:
            if path.is_dir():
                raise IsADirectoryError(f"shard_fsdp_tp: {path} is a directory; a full checkpoint is one file")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        self.barrier("save_checkpoint")

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded directory or a full file (ours or consolidated) into the sharded model and
        optimizers, whatever mesh it was saved on; returns the rest of Lightning's checkpoint."""
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        if path.is_dir():
            state = {"state_dict": get_model_state_dict(self.model)}
            saved = _top_level_entries(path)
            for i, optimizer in enumerate(optimizers):
                if f"optimizer_{i}" in saved:  # absent in weights-only checkpoints
                    state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optimizer)
            load(state, path, strict=strict)
            for i, optimizer in enumerate(optimizers):
                if f"optimizer_{i}" in state:
                    set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"])
            meta_file = path / META_FILE
            return torch.load(meta_file, map_location="cpu", weights_only=True) if meta_file.is_file() else {}
        if not path.is_file():
            raise FileNotFoundError(f"shard_fsdp_tp: no checkpoint at {path}")
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), strict=strict)
        optim_states = checkpoint.pop("optimizer_states", None)
        if optim_states is None:
            optim_states = [
                checkpoint.pop(f"optimizer_{i}") for i in range(len(optimizers)) if f"optimizer_{i}" in checkpoint
            ]
        for optimizer, optim_state in zip(optimizers, optim_states or []):
            set_optimizer_state_dict(self.model, optimizer, optim_state)
        return checkpoint

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        comm.barrier(device=self.root_device)

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        comm.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group=None, sync_grads: bool = False) -> torch.Tensor:
        from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    def teardown(self) -> None:
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _move_tensors(model: nn.Module, device: torch.device, parameters: bool) -> None:
    """Put every (non-meta) buffer, and with ``parameters`` every plain parameter, on ``device`` by replacing
    the module's entry (not ``.data``, which cannot change a tensor's device type under the simulator's fake
    tensors); a tensor registered on several modules (tied weights) stays shared."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        entries = [module._buffers] + ([module._parameters] if parameters else [])
        for table in entries:
            for name, t in table.items():
                if t is None or t.is_meta or t.device == device or type(t).__name__ == "DTensor":
                    continue
                if id(t) not in moved:
                    data = t.detach().to(device)
                    moved[id(t)] = nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                table[name] = moved[id(t)]


def _top_level_entries(path: Path) -> set[str]:
    """The top-level names ("state_dict", "optimizer_0", ...) stored in a sharded checkpoint directory."""
    from lightning_shard.checkpoint._safe_io import SafeFileSystemReader

    keys = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key.split(".", 1)[0] for key in keys}


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"ShardFSDPTPStrategy: {name}={value!r} is not one of {sorted(allowed)}")


def _check_size(name: str, value) -> None:
    if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"ShardFSDPTPStrategy: {name}={value!r} must be 'auto' or a positive int")
