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
import pickle
import shutil
from collections import Counter
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
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from lightning_shard import comm
from lightning_shard.checkpoint import (
    CheckpointSecurityError,
    check_optimizer_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from lightning_shard.checkpoint.state_dict import check_optimizer_loadable, check_param_groups
from lightning_shard.comm import broadcast_object
from lightning_shard.fsdp import check_optimizer_params
from lightning_shard.mesh import DeviceMesh, init_device_mesh
from lightning_shard.tensor import DTensor
from lightning_shard.tensor.ops import load_rules
from lightning_shard.tp.coverage import REPLICATED_WARN_FRACTION
from lightning_shard.tp.input_check import replicated_gradients_apart, rng_states_differ, sync_rng_states
from lightning_shard.tp.loss import replicated_loss
from numba_kernels import warm_kernels
from strategies import (
    agreement,
    auto,
    batch_counts,
    collectives,
    finetuning,
    loading,
    nodes,
    parallelize,
    requeue,
    unsupported,
)
from strategies.compile import check_no_tensor_parallelism, compile_fsdp_units
from strategies.generation import wrap_generate
from strategies.hf_attentions import gather_attention_weights
from strategies.input_checks import EveryBatchCheck, FirstBatchCheck
from strategies.interrupts import resharded_on_exception
from strategies.metrics import set_data_parallel_group, sync_metrics_over_data_parallel
from strategies.peft_adapters import refuse_prefix_tuning_under_tp, wrap_peft_methods
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
        tensor_parallel_size: 1 (FSDP only), an int, or ``"auto"`` (the planner's choice; see below).
            Both sizes also accept their digits as a string (``"2"``), as command lines pass them.
        fsdp_unit: ``"auto"`` (the repeated block class), a set of module classes, or a callable (rank 0 warns
            when one matches no module: the whole model is then one unit).
        tp_plan: ``"auto"`` (``lightning_shard.tp.auto_tp_plan``), a plan dict, or ``None`` (no TP).
        sequence_parallel: with ``tp_plan="auto"``, shard the activations between blocks on the sequence dim
            (norms and residuals on ``T / tp`` tokens; each block's all-reduces become all-gather +
            reduce-scatter pairs). ``"auto"`` (default): on where the blocks allow it and nothing outside
            them could be indexed by position; off, with the reason in the startup summary, for Hugging
            Face models (they build masks and positions from the embedding's shape), encoder-decoders,
            ``nn.MultiheadAttention`` and models holding a position table outside the blocks. ``True``
            forces it where the blocks allow it (a Hugging Face decoder is then refused; where the blocks rule
            it out, as in T5 or BERT, it is off with the reason), ``False`` turns it off. Under sequence
            parallel a sequence length not divisible by the TP size raises, naming the fix (pad it).
        loss_parallel: with ``tp_plan="auto"``, the LM head returns vocabulary-sharded DTensor logits and
            ``training_step`` and ``backward`` run inside ``lightning_shard.tp.loss_parallel()``, so
            ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())`` never gathers the logits. The loss is
            a replicated DTensor; the strategy hands Lightning its local value (log ``loss.full_tensor()``).
        reshard_after_forward: free gathered parameters after forward (True), keep them (False), or keep a
            k-way shard for a backward all-gather over k neighbouring ranks (int k; see ``fully_shard``).
            ``sharding_strategy`` names without resharding override ``True`` and refuse an int k.
            ``"auto"``: the planner's choice.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU (True/False, or ``"auto"``).
        state_dict_type: ``"sharded"`` (a DCP directory) or ``"full"`` (one file) for checkpoints.
        sharding_strategy: FSDP1's names, so Lightning ``FSDPStrategy`` users switch by one string.
        activation_checkpointing_policy: module classes whose forward is recomputed in backward; ``"auto"``:
            the planner chooses between none and the repeated block class (what ``fsdp_unit="auto"`` finds).
        planner_batch, planner_seq_len: micro-batch and sequence length the planner sizes activations for
            when a knob is ``"auto"`` (and the module has neither ``example_input_array`` nor a train dataloader).
        planner_device_memory: the memory per device the planner fits into (bytes or ``"24GiB"``); default
            ``None``: the GPU's total memory, or on CPU the host's RAM divided by the local processes.
        compile_fsdp_units: ``torch.compile`` each FSDP unit's forward after sharding (``True``, or a dict of
            ``torch.compile`` arguments); FSDP only (refused with tensor parallelism); see ``strategies.compile``.
        process_group_backend, timeout, start_method: process-group and launcher settings.

    ``"auto"`` (``tensor_parallel_size``, ``activation_checkpointing_policy``, ``reshard_after_forward``,
    ``cpu_offload``, each independently): rank 0 runs ``lightning_shard.planner.choose_configuration`` once
    with the user's values for the other knobs and sends the choice to every rank; it is logged with the
    planner's table (``planner_table``, ``parallel_summary["auto"]``). When the planner cannot run on the
    model, the ``"auto"`` knobs take the defaults (TP 1, no checkpointing, reshard True, no offload) with a
    message saying why; when nothing fits, ``NoFitError`` is raised on every rank (docs/strategy.md).

    Example: ``ShardFSDPTPStrategy(tensor_parallel_size=2, state_dict_type="full")``.
    """

    strategy_name = "shard_fsdp_tp"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = 1,
        fsdp_unit: str | set[type] | Callable[[nn.Module], bool] = "auto",
        tp_plan: str | dict | None = "auto",
        sequence_parallel: bool | Literal["auto"] = "auto",
        loss_parallel: bool = False,
        reshard_after_forward: bool | int | Literal["auto"] = True,
        cpu_offload: bool | Literal["auto"] = False,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        sharding_strategy: str = "FULL_SHARD",
        activation_checkpointing_policy: set[type] | Literal["auto"] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn"] = "popen",
        planner_batch: int = 1,
        planner_seq_len: int = 2048,
        planner_device_memory: int | str | None = None,
        compile_fsdp_units: bool | dict = False,
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
        data_parallel_size = _check_size("data_parallel_size", data_parallel_size)
        tensor_parallel_size = _check_size("tensor_parallel_size", tensor_parallel_size)
        _check_arguments(
            sharding_strategy=sharding_strategy, tensor_parallel_size=tensor_parallel_size, fsdp_unit=fsdp_unit,
            tp_plan=tp_plan, reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
            activation_checkpointing_policy=activation_checkpointing_policy,
            process_group_backend=process_group_backend, timeout=timeout, planner_batch=planner_batch,
            planner_seq_len=planner_seq_len, planner_device_memory=planner_device_memory,
        )  # fmt: skip
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self.fsdp_unit = fsdp_unit
        self.tp_plan = tp_plan
        if sequence_parallel != "auto" and not isinstance(sequence_parallel, bool):
            raise TypeError(f"shard_fsdp_tp: sequence_parallel={sequence_parallel!r} must be True, False or 'auto'")
        if not isinstance(loss_parallel, bool):
            raise TypeError(f"shard_fsdp_tp: loss_parallel={loss_parallel!r} must be True or False")
        for name, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
            if value is True and tp_plan != "auto":
                raise ValueError(
                    f"shard_fsdp_tp: {name}=True applies to tp_plan='auto'; with tp_plan={type(tp_plan).__name__} "
                    "write the sequence-parallel or loss-parallel layouts into your plan instead"
                )
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
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
        self.planner_device_memory = planner_device_memory
        # The knobs as asked ("auto" or a value); the attributes above hold what is applied once decided.
        self._auto_request = dict(
            activation_checkpointing_policy=activation_checkpointing_policy,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=cpu_offload,
        )
        if not isinstance(compile_fsdp_units, (bool, dict)):
            raise TypeError(
                f"ShardFSDPTPStrategy: compile_fsdp_units={compile_fsdp_units!r} must be a bool or a dict of "
                "torch.compile arguments"
            )
        if compile_fsdp_units:
            check_no_tensor_parallelism(tensor_parallel_size, tp_plan)
        self.compile_fsdp_units = compile_fsdp_units
        self._device_mesh: DeviceMesh | None = None
        self.num_nodes = 1
        self.parallel_summary: dict = {}
        self.planner_table: str | None = None  # the planner's table when a knob is "auto"
        self.auto_configuration: dict | None = None  # what the "auto" knobs resolved to, and why
        self._eval_position_checks: dict[str, bool] = {}  # loops with a length-less dataloader (batch_counts)
        self._first_batch_check = FirstBatchCheck()  # the ranks of a TP group must see the same batches
        self._batch_check: EveryBatchCheck | None = None  # and every training batch, in an existing all-reduce
        self._requeue: requeue.DeferredRequeue | None = None  # SLURM auto-requeue, run where the ranks agree
        # names materialize could not initialise (None: nothing was on meta); checked before the first step,
        # after a checkpoint had the chance to fill them
        self._unset_after_materialize: list[str] | None = None
        self._rng_resync_reported = False  # the per-step RNG sync logs its first resync only
        self._agreement_due = False  # the ranks compare optimizers and settings at a fit's first training step

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
            # Lightning's MixedPrecision names the autocast device ("cpu" for Trainer(accelerator="cpu") on a machine
            # with a GPU, where autocast("cuda") would leave every op alone); setup_environment settles it on the
            # root device's type (Lightning says "cuda" for an accelerator it does not know by name)
            device = getattr(plugin, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
            plugin = ShardPrecision(getattr(plugin, "precision", "32-true"), device)
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ processes and mesh
    def _configure_launcher(self) -> None:
        # Lightning calls this in Trainer(...), once the device count is known: size errors now, not in the ranks.
        world = self.num_nodes * self.num_processes
        _check_sizes_for_world(self._data_parallel_size, self._tensor_parallel_size, world)
        if self.cluster_environment.creates_processes_externally:
            # torchrun/SLURM started the ranks already: a world other than devices x num_nodes fails here, on every
            # rank, instead of in a mesh or collective sized for processes that do not exist
            nodes.check_launched_world(self)
            return
        if self._start_method == "spawn":
            self._launcher = _MultiProcessingLauncher(self, start_method="spawn")
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        unsupported.refuse_callbacks(self.lightning_module)  # on every rank, before the process group exists
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        if isinstance(self.precision_plugin, ShardPrecision):
            self.precision_plugin.use_device(self.root_device.type)  # autocast where the model runs
        # before the mesh: ranks that build meshes of other shapes pair up the wrong subgroups
        agreement.check_ranks_agree({"strategy arguments": self._argument_entries()}, when="about the strategy")
        self._device_mesh = self._build_mesh()
        self.lightning_module._device_mesh = self._device_mesh
        unsupported.warn_throughput_under_tp(self.lightning_module, self._device_mesh.size("tensor_parallel"))
        # The engine's one-time loads (numba kernels, DTensor op rules) now, before the model exists: neither the
        # first step nor the memory around the model pays for them (docs/strategy.md).
        warm_kernels(self.root_device)
        load_rules()

    def _argument_entries(self) -> dict[str, str]:
        """The strategy's arguments as asked (``"auto"`` before the planner decides), for ``agreement``; the
        planner's own inputs are left out: rank 0's planner decides for every rank."""
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        if dp == "auto" and isinstance(tp, int) and self.world_size % tp == 0:
            dp = self.world_size // tp  # "auto" and the size it stands for build the same mesh
        asked = {
            "data_parallel_size": dp,
            "tensor_parallel_size": tp,
            "fsdp_unit": self.fsdp_unit,
            "tp_plan": self.tp_plan,
            "sequence_parallel": self.sequence_parallel,
            "loss_parallel": self.loss_parallel,
            "sharding_strategy": self.sharding_strategy,
            **self._auto_request,
            "state_dict_type": self.state_dict_type,
            "compile_fsdp_units": self.compile_fsdp_units,
            "precision": self.precision_plugin.precision,
            "num_nodes": self.num_nodes,
            "devices": self.num_processes,
            # Trainer(sync_batchnorm=True): SyncBatchNorm all-reduces in its forward, BatchNorm does not
            "sync_batchnorm": type(getattr(self, "_layer_sync", None)).__qualname__,
        }
        return {name: agreement.describe_choice(value) for name, value in asked.items()}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _build_mesh(self) -> DeviceMesh:
        world = self.world_size
        tp = self._tensor_parallel_size
        request = auto.Request(tensor_parallel_size=tp, **self._auto_request)
        if request.auto_knobs():
            tp = self._apply_auto(request, world)
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
        if nodes.tp_crosses_nodes(tp, self.num_processes, self.num_nodes):
            rank_zero_warn(
                f"shard_fsdp_tp: tensor_parallel_size={tp} does not divide the {self.num_processes} devices of a node, "
                "so tensor-parallel groups span nodes and every TP collective crosses the network; choose a TP size "
                "that divides the devices per node"
            )
        # the mesh's consecutive ranks (a TP group, a HYBRID_SHARD shard group) must share a node, whatever order
        # the launcher numbered them in
        order = nodes.node_major_ranks(
            node_rank=self.node_rank, local_rank=self.local_rank, num_nodes=self.num_nodes, devices=self.num_processes
        )
        if no_shard:
            shape, names = (dp, 1, tp), ("replicate", "data_parallel", "tensor_parallel")
        elif hybrid:  # shard within a node, replicate across nodes
            per_node = max(1, self.num_processes)
            replicas = dp // per_node if dp % per_node == 0 and dp > per_node else 1
            shape, names = (replicas, dp // replicas, tp), ("replicate", "data_parallel", "tensor_parallel")
        else:
            shape, names = (dp, tp), ("data_parallel", "tensor_parallel")
        return init_device_mesh(device_type, shape, mesh_dim_names=names, rank_order=order)

    def _apply_auto(self, request: auto.Request, world: int) -> int:
        """Decide the ``"auto"`` knobs (rank 0's planner, the same on every rank), set the strategy's
        activation checkpointing, resharding and offload from them, log the choice; returns the TP size."""
        configuration, why = self._plan_configuration(request, world)
        values = auto.settings(request, configuration, self.lightning_module)
        self.activation_checkpointing_policy = values["activation_checkpointing_policy"]
        self.reshard_after_forward = values["reshard_after_forward"]
        self.cpu_offload = values["cpu_offload"]
        self.planner_table = configuration.table if configuration is not None else None
        auto_knobs = request.auto_knobs()
        self.auto_configuration = {**values, "auto": auto_knobs, "decided_by": why}
        text = f"shard_fsdp_tp: 'auto' ({', '.join(auto_knobs)}) -> {auto.describe(values)}; {why}"
        rank_zero_info(text + (f"\n{self.planner_table}" if self.planner_table else ""))
        return values["tensor_parallel_size"]

    def _plan_configuration(self, request: auto.Request, world: int):
        """``(Configuration or None, why)`` for the ``"auto"`` knobs, decided on rank 0 and sent to every rank.

        Each rank planning alone could decide differently (per-node memory, a different first batch, the
        planner failing on one rank) and build a different mesh or FSDP layout: a hang or a crash. An error of
        rank 0's planner (``NoFitError``) is raised on every rank before the mesh is built.
        """
        if not _distributed_is_initialized() or world == 1:
            return self._plan_configuration_here(request, world)
        from lightning_shard.planner import NoFitError

        outcome: tuple = (None, None, None)
        error: Exception | None = None
        if self.global_rank == 0:
            try:
                outcome = (*self._plan_configuration_here(request, world), None)
            except Exception as e:  # raised below on every rank, after the broadcast (no rank left waiting)
                error = e
                outcome = (None, None, (isinstance(e, NoFitError), f"{type(e).__name__}: {e}"))
        configuration, why, failed = broadcast_object(outcome, src=0)
        if error is not None:
            raise error
        if failed is not None:
            no_fit, message = failed
            kind = NoFitError if no_fit else RuntimeError
            raise kind(f"shard_fsdp_tp: the 'auto' settings failed on rank 0: {message}")
        return configuration, why

    def _plan_configuration_here(self, request: auto.Request, world: int):
        """The planner's choice on this process (the fastest predicted configuration that fits, with the
        user's values for the knobs not ``"auto"``): ``(Configuration, why)``, or ``(None, why)`` when the
        planner cannot run here (the ``"auto"`` knobs then take ``auto.FALLBACK``). Needs the model's layers
        at this point (built in ``__init__``); a model built later in ``configure_model`` cannot be planned."""
        module = self.lightning_module
        fallback = "the defaults for the 'auto' knobs, because "
        if module is None or next(module.parameters(), None) is None:
            return None, fallback + (
                "the planner needs the model's layers and there are none yet (a model built in configure_model; "
                "with Fabric, the mesh comes before the model)"
            )
        hybrid, _, no_shard = _SHARDING[self.sharding_strategy]
        if no_shard:
            return None, fallback + "the planner does not model NO_SHARD (it also excludes TP)"
        from lightning_shard.planner import NoFitError, choose_configuration
        from lightning_shard.planner.estimate import format_bytes

        kwargs = request.planner_kwargs()
        dp = self._data_parallel_size
        if kwargs["tensor_parallel_size"] == "auto" and isinstance(dp, int) and world % dp == 0:
            kwargs["tensor_parallel_size"] = world // dp  # a fixed data-parallel size leaves one TP size
        memory, device = self._planner_device()
        try:
            example_input, step, batch, seq_len = auto.planner_step(module, self.planner_batch, self.planner_seq_len)
            configuration = choose_configuration(
                module, world, max(1, self.num_processes), memory, self.precision_plugin.precision,
                batch=batch, seq_len=seq_len, example_input=example_input, step=step,
                # "auto": per TP size, as auto_tp_plan decides it; a plan of the user's decides itself
                sequence_parallel=self.sequence_parallel if self.tp_plan == "auto" else False,
                loss_parallel=self.loss_parallel,
                hybrid_shard=hybrid, device=device, **kwargs,
            )  # fmt: skip
        except NoFitError as e:  # nothing fits: the planner's message says by how much and which knob helps most
            raise NoFitError(
                f"{e}\nIn this strategy's arguments: checkpointing every block is activation_checkpointing_policy="
                "'auto' (or the block class), CPU offload is cpu_offload=True (or 'auto'); the budget is "
                "planner_device_memory (or the device's memory) less a 10% margin"
            ) from e
        except Exception as e:  # the planner could not run this model's step on meta
            return None, fallback + f"the planner could not estimate this model ({e!r})"
        return configuration, (
            f"chosen by the planner on {format_bytes(memory)} per device: the highest predicted tokens/s that "
            "fits (predicted, not measured)"
        )

    def _planner_device(self) -> tuple[int, str]:
        """(memory per device, the planner's device name): ``planner_device_memory`` when given, else the GPU's
        total memory, or on CPU the host's RAM divided by the local processes."""
        from lightning_shard.planner import parse_bytes

        if self.root_device.type == "cuda":
            memory = torch.cuda.get_device_properties(self.root_device).total_memory
            name = torch.cuda.get_device_name(self.root_device).lower()
            device = "a100" if "a100" in name else "h100"
        else:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, self.num_processes)
            device = "cpu"
        if self.planner_device_memory is not None:
            memory = parse_bytes(self.planner_device_memory)
        return memory, device

    def _sync_tp_rng_states(self, before: str | None = None) -> None:
        """The ranks of a TP group draw the same random numbers (dropout on replicated activations): their
        generators take TP rank 0's state where they differ. At the end of setup (e.g. after
        ``seed_everything(seed + rank)``) and ``before`` every training step: code that runs on one rank
        only between steps (a rank-zero callback that samples, a per-rank seed in ``on_train_start``) moves that
        rank's generator alone, and its dropout masks for the same replicated activations would differ from the
        others' while the collectives mix the two, with no error."""
        mesh = self.device_mesh
        if mesh.size("tensor_parallel") == 1:
            return
        if not sync_rng_states(mesh.get_group("tensor_parallel"), self.root_device):
            return
        if before is None:
            rank_zero_info(
                "shard_fsdp_tp: the random number generators differed across the ranks of a tensor-parallel group "
                "(seeded per rank?); each now uses its TP group's first rank's state, so dropout draws the same "
                "mask for the replicated activations. Seed by the data-parallel rank to keep per-replica streams"
            )
        elif not self._rng_resync_reported:
            self._rng_resync_reported = True
            rank_zero_info(
                f"shard_fsdp_tp: before {before} the random number generators differed across the "
                "ranks of a tensor-parallel group (something drew random numbers or seeded on some ranks only "
                "since the last step, e.g. a rank-zero-only callback); they now use the TP group's first rank's "
                "state, as before every training step (reported once)"
            )

    def _fsdp_mesh(self) -> DeviceMesh:
        mesh = self.device_mesh
        if "replicate" in mesh.mesh_dim_names:
            return mesh["replicate", "data_parallel"]
        return mesh["data_parallel"]

    # ------------------------------------------------------------------ model setup
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # empty_init=True: parameters on meta, materialized shard by shard after sharding; buffers are built as
        # usual (their values, e.g. rotary tables, cannot be recomputed from meta).
        meta = parallelize.parameters_on_meta() if empty_init else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        model = self.model
        if not getattr(model, "_shard_fsdp_tp_done", False):  # else parallelized by an earlier Trainer call
            self._check_model_agrees(model)
            if parallelize.is_parallelized(model):
                rank_zero_info("shard_fsdp_tp: the model is already parallelized in configure_model; left as it is")
            else:
                self._parallelize(model)
                model._shard_fsdp_tp_done = True
        unsupported.refuse_exports(model)
        wrap_peft_methods(model)
        self.model = model
        self._sync_metrics_over_data_parallel()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # before Lightning registers its signal handlers: SIGUSR1's save must not run wherever a rank happens to be
            self._requeue = requeue.DeferredRequeue.install(trainer)
        self.setup_precision_plugin()

    def _check_model_agrees(self, model: nn.Module) -> None:
        """Raise on every rank unless every rank built the same parameters (names, order, shapes, dtypes,
        ``requires_grad``) and buffers (names, shapes, dtypes; the broadcast pairs them in name order) from the
        same module classes, before the broadcast and ``fully_shard`` pair them up by position."""
        sections = {
            "parameters": agreement.parameter_entries(model),
            "buffers": agreement.buffer_entries(model),
            "modules": agreement.module_entries(model),
        }
        agreement.check_ranks_agree(sections, when="about the model (before it is sharded)")

    def _check_training_agrees(self) -> None:
        """At a fit's first training step (after ``configure_optimizers`` and the callbacks' ``on_fit_start`` /
        ``on_train_start`` / ``on_train_epoch_start``, which may freeze parameters or change settings): raise on
        every rank unless the optimizers, the trainable parameters and the Trainer's loop settings agree."""
        if not self._agreement_due:
            return
        self._agreement_due = False
        trainer = self.lightning_module.trainer
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        sections = {
            "Trainer settings": agreement.trainer_entries(trainer),
            "optimizers": agreement.optimizer_entries(self.model, self.optimizers, schedulers),
            "trainable parameters": agreement.trainable_entries(self.model),
        }
        agreement.check_ranks_agree(sections, when="at the first training step")

    def _sync_metrics_over_data_parallel(self) -> None:
        """Under TP, torchmetrics metrics without a ``process_group`` of their own synchronise over the
        data-parallel ranks (``strategies.metrics``): over the world they counted each batch once per TP rank.
        Called at setup and at the start of each loop, for metrics assigned in a hook after setup."""
        mesh = self._device_mesh
        tp = mesh.size("tensor_parallel") if mesh is not None else 1
        set_data_parallel_group(mesh.get_group("data_parallel") if tp > 1 else None)  # None: the world
        if tp > 1:  # without TP the world is the data-parallel ranks: metrics are left as they are
            sync_metrics_over_data_parallel(self.lightning_module)

    def _apply_layer_sync(self, model: nn.Module) -> None:
        """``Trainer(sync_batchnorm=True)``: BatchNorm layers become ``nn.SyncBatchNorm``, as Lightning's DDP and
        FSDP strategies convert them, with statistics over the ranks that see different data: all ranks, or
        under tensor parallelism this rank's data-parallel group (the ranks of one TP group see the same batch,
        and counting it once per TP rank would skew the running variance's correction). A custom
        ``LayerSync`` plugin is applied as it is."""
        from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

        layer_sync = getattr(self, "_layer_sync", None)
        if layer_sync is None:
            return
        if isinstance(layer_sync, TorchSyncBatchNorm):
            tp = self.device_mesh.size("tensor_parallel")
            group = None if tp == 1 else self.device_mesh["data_parallel"].get_group()
            nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
        else:
            layer_sync.apply(model)

    def _parallelize(self, model: nn.Module) -> None:
        refuse_prefix_tuning_under_tp(model, self.device_mesh.size("tensor_parallel"), self.tp_plan)
        model = self.precision_plugin.convert_module(model)
        self._apply_layer_sync(model)
        # Shard first, then move the shards (FSDP1's device_id): TP splits host tensors on the host (its
        # DTensors' local shards stay there), then fully_shard moves one unit's parameters at a time, so a
        # model that fits on the host but not on one device is never whole on it. The broadcasts run on the
        # host over the mesh's groups, which carry host tensors; meta tensors (no values yet) are skipped, the
        # real buffers of a model built with empty_init=True are not.
        if self.compile_fsdp_units:  # tensor_parallel_size="auto" is decided by now
            check_no_tensor_parallelism(self.device_mesh.size("tensor_parallel"), self.tp_plan)
        parallelize.broadcast_plain_model(model, self.device_mesh)
        summary = parallelize.apply_parallelism(
            model,
            self.device_mesh,
            fsdp_unit=self.fsdp_unit,
            tp_plan=self.tp_plan,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.precision_plugin.mp_policy,
            cpu_offload=self.cpu_offload,
            fsdp_mesh=self._fsdp_mesh(),
            activation_checkpointing_policy=self.activation_checkpointing_policy,
        )
        model._fsdp_state.agreement_checked = True  # compared before sharding (_check_model_agrees)
        if summary["tp_plan"] is not None:
            tp_mesh = self.device_mesh["tensor_parallel"]
            summary["attention_weights_gathered"] = gather_attention_weights(model, summary["tp_plan"], tp_mesh)
            summary["generate_wrapped"] = wrap_generate(
                model, tp_mesh.get_group(), self.root_device, full_logits=self._loss_parallel_active()
            )
        self._unset_after_materialize = parallelize.materialize(model, self.root_device)
        if self._unset_after_materialize:  # said now; the first step raises if no checkpoint fills them
            names = self._unset_after_materialize
            shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            rank_zero_warn(
                f"shard_fsdp_tp: the model was built on the meta device and no reset_parameters() writes {shown}; "
                "they hold a placeholder (NaN) until a checkpoint loads them, and the first step raises if they "
                "still do (give their modules a reset_parameters())"
            )
        _move_buffers(model, self.root_device)
        parallelize.check_no_drift(model)
        self._sync_tp_rng_states()
        if self.compile_fsdp_units:
            options = self.compile_fsdp_units if isinstance(self.compile_fsdp_units, dict) else None
            summary["compiled_units"] = compile_fsdp_units(model, options)
        if self.auto_configuration is not None:
            summary["auto"] = self.auto_configuration
            summary["planner_table"] = self.planner_table
        self.parallel_summary = summary
        units = summary["fsdp_units"]
        plan = summary["tp_plan"]
        mesh = dict(zip(self.device_mesh.mesh_dim_names, self.device_mesh.shape))
        coverage = summary.get("tp_coverage")
        tp_text = f"{len(plan) if plan else 0} entries" + (f"; {coverage.describe()}" if coverage else "")
        counts = Counter(units)  # nested unit classes (a block and its MLP) each by name
        rank_zero_info(
            f"shard_fsdp_tp: mesh {mesh}, precision {self.precision_plugin.precision}, FSDP units: "
            f"{', '.join(f'{n} x {name}' for name, n in counts.items()) or '-'} + root, TP plan: {tp_text}"
        )
        for warning in parallelize.unmatched_choices(self.fsdp_unit, self.activation_checkpointing_policy, summary):
            rank_zero_warn(warning)
        rank_zero_info(_memory_line(model, summary))
        skipping = parallelize.random_layer_skipping(model)
        if skipping and self.world_size > 1:
            rank_zero_warn(
                f"shard_fsdp_tp: {'; '.join(skipping)} skip layers at random in training, each rank by its own "
                "draw. Every rank must skip the same layers, or the FSDP and TP collectives of the layers stop "
                "pairing up across ranks (a hang). Set layerdrop=0 (Hugging Face turns LayerDrop off under FSDP "
                "for the models that support it), or keep the ranks' random states equal (seed_everything, and "
                "batches of the same shape on every rank so that dropout draws the same amount)"
            )
        if coverage is not None and coverage.replicated_fraction > REPLICATED_WARN_FRACTION:
            rank_zero_warn(
                f"shard_fsdp_tp: tensor parallelism leaves {100 * coverage.replicated_fraction:.1f}% of the "
                f"weight-matrix elements replicated on every TP rank (more than "
                f"{100 * REPLICATED_WARN_FRACTION:.0f}%), so TP saves little memory for them. {coverage.describe()}. "
                "Pass tp_plan= a plan covering these modules, or use tensor_parallel_size=1 (FSDP only)"
            )

    # The LightningModule is the root FSDP module, but Lightning calls training_step, not forward: route each
    # step through the module's __call__ so the root's hooks (unshard, reshard, backward hooks) run.
    def training_step(self, *args: Any, **kwargs: Any):
        args, kwargs = self._first_batch_check(self._device_mesh, "training", args, kwargs)
        self._check_initialised()
        self._check_training_agrees()
        self._sync_tp_rng_states(before=f"training step {self.lightning_module.trainer.global_step}")
        with (
            resharded_on_exception(self.model),
            self.precision_plugin.train_step_context(),
            self._loss_parallel_context(),
        ):
            out = self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)
        return _local_loss(out) if self._loss_parallel_active() else out

    def _check_initialised(self) -> None:
        """Before the first step of any loop (after Lightning restored a checkpoint): raise on every rank if a
        tensor built on meta still has no value (``parallelize.check_initialised``)."""
        if self._unset_after_materialize is None:
            return
        names, self._unset_after_materialize = self._unset_after_materialize, None
        parallelize.check_initialised(self.model, names)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # loss_parallel's backward ops (vocab-parallel log-softmax / nll) must run inside the context too.
        with resharded_on_exception(self.model), self._loss_parallel_context():
            out = super().backward(closure_loss, *args, **kwargs)
        self._check_tp_replicated_gradients()
        return out

    def _check_tp_replicated_gradients(self, modules: list[nn.Module] | None = None) -> None:
        """The TP ranks' generators were synced before the step; if they differ after a backward, the model drew or
        seeded differently on the ranks inside the step (Hugging Face Reformer reseeds from OS entropy in every
        training forward), and dropout on a replicated activation may have drawn different masks. Then the
        gradients of the replicated parameters are compared: different ones would make the ranks' copies part ways
        with no error, so every rank raises before the optimizer step. One all-reduce of two integers per backward
        under TP; the gradient comparison only when the generators differ, over ``modules`` (default: the model)."""
        mesh = self.device_mesh
        if mesh.size("tensor_parallel") == 1:
            return
        group = mesh.get_group("tensor_parallel")
        if not rng_states_differ(group, self.root_device):
            return
        named = [item for m in ([self.model] if modules is None else modules) for item in m.named_parameters()]
        apart = replicated_gradients_apart(named, group, self.root_device)
        if apart:
            shown = ", ".join(f"{name} ({rel:.1e})" for name, rel in apart[:3])
            raise RuntimeError(
                "shard_fsdp_tp: the gradients of parameters the tensor-parallel plan leaves replicated differ across "
                f"the ranks of a TP group ({len(apart)} of them; relative difference: {shown}), and the ranks' random "
                "number generators, synced before the step, differ after its backward: the model drew or seeded "
                "differently on the TP ranks inside the step (e.g. Hugging Face Reformer calls torch.seed() in every "
                "training forward), so dropout on replicated activations drew different masks. Training on would "
                "make the ranks' copies of those weights part ways with no error. Set the model's dropout to 0, or "
                "use tensor_parallel_size=1"
            )

    def _loss_parallel_active(self) -> bool:
        return self.loss_parallel and self._device_mesh is not None and self.device_mesh.size("tensor_parallel") > 1

    def _loss_parallel_context(self):
        if not self._loss_parallel_active():
            return nullcontext()
        from lightning_shard.tp import loss_parallel

        return loss_parallel()

    # Evaluation runs inside loss_parallel too: the LM head returns vocabulary-sharded logits in every loop, and a
    # loss computed from them with a plain target outside the context raised (mixing a tensor with DTensors).
    def validation_step(self, *args: Any, **kwargs: Any):
        self._check_eval_position("validation", args, kwargs)
        args, kwargs = self._first_batch_check(self._device_mesh, "validation", args, kwargs)
        self._check_initialised()
        with (
            resharded_on_exception(self.model),
            self.precision_plugin.val_step_context(),
            self._loss_parallel_context(),
        ):
            return self._forward_redirection(self.model, self.lightning_module, "validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        self._check_eval_position("test", args, kwargs)
        args, kwargs = self._first_batch_check(self._device_mesh, "test", args, kwargs)
        self._check_initialised()
        with (
            resharded_on_exception(self.model),
            self.precision_plugin.test_step_context(),
            self._loss_parallel_context(),
        ):
            return self._forward_redirection(self.model, self.lightning_module, "test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        self._check_eval_position("predict", args, kwargs)
        args, kwargs = self._first_batch_check(self._device_mesh, "predict", args, kwargs)
        self._check_initialised()
        with resharded_on_exception(self.model), self.precision_plugin.predict_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "predict_step", *args, **kwargs)

    # Lightning's predict sampler (UnrepeatedDistributedSampler) deals the samples without padding, so with
    # 17 samples and a batch of 4 one data-parallel rank runs 3 batches and the other 2: the third batch's FSDP
    # all-gather then pairs with nothing (gloo: a collective-mismatch crash; NCCL: a hang). DDP survives this
    # (no collectives in an eval forward), a sharded model cannot. Validation and test pad through
    # DistributedSampler, but a user's own per-rank data (use_distributed_sampler=False) can differ the same way.
    def on_train_start(self) -> None:
        super().on_train_start()
        self._agreement_due = True  # checked at the first training step, after the epoch-start hooks
        self._sync_metrics_over_data_parallel()
        finetuning.clear_restarting(self.lightning_module.trainer)  # the groups were rebuilt at load time

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The ranks' training batch counts may differ with data split by the user (an IterableDataset sharding
        # itself, a sampler of the user's): compare, one batch ahead, before the forward that would hang.
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer
        if self.world_size > 1 and not isinstance(trainer.fit_loop._data_fetcher, _DataLoaderIterDataFetcher):
            same = self._every_batch_check()  # TP: the same all-reduce checks every batch (input_checks.py)
            batch_counts.check_train_ends_alike(trainer, batch_idx, self.root_device, same, batch)
        if self._requeue is not None:
            self._requeue.at_batch_start(trainer, batch_idx, self.reduce_boolean_decision)

    def _every_batch_check(self) -> EveryBatchCheck | None:
        """The per-batch TP same-batch check, built once; ``None`` without TP or when the mesh is not the world
        (the all-reduce it rides in spans the world)."""
        mesh = self._device_mesh
        if mesh is None or mesh.size("tensor_parallel") == 1 or mesh.size() != self.world_size:
            return None
        if self._batch_check is None:
            self._batch_check = EveryBatchCheck(mesh)
        return self._batch_check

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._sync_metrics_over_data_parallel()
        self._check_batch_counts_alike("validation", self.lightning_module.trainer._evaluation_loop)

    def on_test_start(self) -> None:
        super().on_test_start()
        self._sync_metrics_over_data_parallel()
        self._check_batch_counts_alike("test", self.lightning_module.trainer._evaluation_loop)

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._check_batch_counts_alike("predict", self.lightning_module.trainer.predict_loop)

    def _check_batch_counts_alike(self, loop: str, eval_loop) -> None:
        """Raise on every rank, before the first batch, unless every rank runs the same number of batches in
        each of ``loop``'s dataloaders. A length-less dataloader counts as unknown here; with one, the ranks
        compare their positions before every step instead (``_check_eval_position``)."""
        if self.world_size == 1:
            return
        self._eval_position_checks[loop] = batch_counts.has_lengthless_loader(eval_loop._combined_loader)
        counts = [int(c) if math.isfinite(c) else None for c in eval_loop.max_batches]
        every = comm.all_gather_objects(counts)
        if all(c == every[0] for c in every):
            return
        longest = max(len(ranks) for ranks in every)
        unequal = [i for i in range(longest) if len({ranks[i] if i < len(ranks) else None for ranks in every}) > 1]
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(every))
        hint = (
            "Lightning's predict sampler splits the samples without padding; make the dataset length a multiple of "
            f"{self.distributed_sampler_kwargs['num_replicas']} x the batch size (pad it, then drop the padded "
            "predictions), or run predict on one device"
            if loop == "predict"
            else "give every rank the same number of batches (Lightning's DistributedSampler pads to equal them)"
        )
        raise RuntimeError(
            f"shard_fsdp_tp: the {loop} dataloader(s) {unequal} give the ranks different numbers of batches "
            f"({per_rank}); a sharded model's forward runs collectives on every rank, so the rank with more "
            f"batches would wait for the others forever (or crash on a collective mismatch). {hint}"
        )

    def _check_eval_position(self, loop: str, args: tuple, kwargs: dict) -> None:
        """With a length-less dataloader in ``loop`` (counts unknown before it), raise on every rank as soon as
        the ranks' positions part (``strategies.batch_counts``): before the forward that would hang."""
        if not self._eval_position_checks.get(loop):
            return
        trainer = self.lightning_module.trainer
        eval_loop = trainer.predict_loop if loop == "predict" else trainer._evaluation_loop
        position = batch_counts.eval_position(eval_loop, args, kwargs)
        if position is not None:
            batch_counts.check_eval_positions_alike(loop, position, self.root_device)

    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:  # e.g. a forward with grad inside configure_optimizers
            check_optimizer_params(getattr(optimizer, "_optimizer", optimizer))

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
        else:
            _write_full_checkpoint(checkpoint, path, self.global_rank, "shard_fsdp_tp")
        self.barrier("save_checkpoint")

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint into the sharded model and optimizers, whatever mesh it was saved on; returns the
        rest of Lightning's checkpoint. All or nothing: model and optimizers are checked (and a directory is
        read and verified) before either is modified.

        Accepted: our sharded directories, DCP directories of other tools with Lightning's layout
        (ModelParallelStrategy: "state_dict", "optimizer_{i}", ``meta.pt``; FSDPStrategy(state_dict_type="sharded"):
        the same with "model"), our full files, consolidated files,
        and full checkpoints of other Lightning strategies of the same model (DDP: optimizer state keyed by
        parameter index, matched by parameter order).

        Lightning's part of the checkpoint (loops, callbacks, what ``on_save_checkpoint`` added) is unpickled
        with ``weights_only=True`` (classes allowlisted with ``torch.serialization.add_safe_globals`` load too)
        unless the caller passes ``weights_only=False``: then the objects it holds are rebuilt, running their
        code, so only for checkpoints you trust."""
        # rank 0's path on every rank; where SLURM's auto-requeue misread an interrupted save's leftovers, the latest
        # complete HPC checkpoint (strategies/requeue.py)
        path = str(checkpoint_path)
        path = Path(self.broadcast(requeue.published_hpc_path(path) if self.global_rank == 0 else path))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        strict = self.lightning_module.strict_loading
        trusted = weights_only is False
        _check_seen_alike(path)
        if path.is_dir():
            return self._load_sharded(path, optimizers, strict, trusted)
        if not path.is_file():
            raise FileNotFoundError(f"shard_fsdp_tp: no checkpoint at {path}")
        try:
            checkpoint = loading.load_full_file(path, weights_only=not trusted)
        except pickle.UnpicklingError as e:
            if "GLOBAL" not in str(e):  # damaged bytes, not a Python object: torch's own error says so
                raise
            raise _untrusted_objects(path, e) from e
        optim_states = checkpoint.pop("optimizer_states", None)
        if optim_states is None:
            optim_states = [
                checkpoint.pop(f"optimizer_{i}") for i in range(len(optimizers)) if f"optimizer_{i}" in checkpoint
            ]
        with finetuning.param_groups_restored(self.lightning_module._trainer, checkpoint.get("callbacks") or {}):
            pairs = list(zip(optimizers, optim_states or []))
            for optimizer, optim_state in pairs:  # before the model is touched
                check_optimizer_state_dict(self.model, optimizer, optim_state)
            model_state = checkpoint.pop(loading.model_entry(set(checkpoint), path))
            set_model_state_dict(self.model, model_state, strict=strict)
            for optimizer, optim_state in pairs:
                set_optimizer_state_dict(self.model, optimizer, optim_state)
        return checkpoint

    def _load_sharded(self, path: Path, optimizers: list, strict: bool, trusted: bool = False) -> dict[str, Any]:
        try:  # verified before the load, so a damaged meta.pt changes nothing either
            meta = _read_meta(path, weights_only=not trusted)
        except CheckpointSecurityError as e:
            raise _untrusted_objects(path / META_FILE, e) from e
        # the param groups a finetuning callback added, before the optimizer templates are built from them
        with finetuning.param_groups_restored(self.lightning_module._trainer, meta.get("callbacks") or {}):
            self._load_sharded_states(path, optimizers, strict)
        return meta

    def _load_sharded_states(self, path: Path, optimizers: list, strict: bool) -> None:
        """The model and optimizer states of a sharded directory, checked before anything is copied."""
        keys = loading.saved_keys(path)
        saved = _top_level_entries(keys)
        state = {loading.model_entry(saved, path): get_model_state_dict(self.model)}  # FSDPStrategy: "model"
        for i, optimizer in enumerate(optimizers):
            if f"optimizer_{i}" in saved:  # absent in weights-only checkpoints
                check_optimizer_loadable(optimizer)  # LBFGS: before its missing state meets the saved keys
                state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optimizer)
                loading.optimizer_template_as_saved(state[f"optimizer_{i}"], f"optimizer_{i}", keys)

        def check_optimizers(loaded: dict[str, Any]) -> None:  # the param groups, before anything is copied
            for i, optimizer in enumerate(optimizers):
                if f"optimizer_{i}" in loaded:
                    check_param_groups(self.model, optimizer, loaded[f"optimizer_{i}"])

        load(state, path, strict=strict, before_commit=check_optimizers)
        for i, optimizer in enumerate(optimizers):
            if f"optimizer_{i}" in state:  # tensors are in place already; this sets the hyperparameters
                set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"])

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        comm.barrier(device=self.root_device)

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        return comm.broadcast_object(obj, src)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """Lightning's reduction over all ranks (``self.log(..., sync_dist=True)``, ``reduce_fx``), with one
        difference under tensor parallelism: a sum over the default group counts each data-parallel replica once
        (``strategies.collectives``: the world sum divided by the TP size). Means, max and min need no change; an
        explicit ``group`` is reduced as given.
        """
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if isinstance(tensor, DTensor):  # a loss under loss_parallel: its value on this rank, whole (a partial sum
            tensor = replicated_loss(tensor.detach())  # with label smoothing), as a plain tensor for c10d
        if group is not None:  # only None is Lightning's default here (self.log's sync_dist_group)
            if _distributed_is_initialized():
                comm.check_devices("reduce", group, tensor)
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return collectives.reduce_over_data_parallel(tensor, self._device_mesh, None, reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """True on every rank when all (``all=True``) or any ranks decided True: a count over every rank, not
        ``reduce``'s data-parallel sum."""
        return collectives.decided_on_ranks(decision, self.root_device, all)

    def all_gather(self, tensor: torch.Tensor, group=None, sync_grads: bool = False) -> torch.Tensor:
        """``LightningModule.all_gather``: under tensor parallelism, over the default group, each data-parallel
        replica's tensor once (``(data_parallel_size, ...)``, ``strategies.collectives``); a gather over the
        world would repeat each TP group's batch ``tensor_parallel_size`` times."""
        return collectives.all_gather_over_data_parallel(tensor, self._device_mesh, group, sync_grads)

    def teardown(self) -> None:
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _write_full_checkpoint(obj: dict[str, Any], path: Path, rank: int, who: str) -> None:
    """Rank 0 writes ``obj`` to a temporary file, fsyncs it and renames it to ``path``; then one broadcast gives
    every rank rank 0's outcome, so a failed write raises the same error on every rank (no rank is left waiting
    in a collective) and leaves the previous file at ``path`` untouched.

    Example: ``_write_full_checkpoint(checkpoint, Path("last.ckpt"), self.global_rank, "shard_fsdp_tp")``.
    """
    error, cause = None, None
    if rank == 0:
        try:
            _write_atomically(obj, path, who)
        except Exception as e:  # every rank raises it below, after the broadcast
            error, cause = f"{type(e).__name__}: {e}", e
    if _distributed_is_initialized():
        error = broadcast_object(error)
    if error is not None:
        raise RuntimeError(
            f"{who}: rank 0 could not write the full checkpoint {path} ({error}); the previous file at that path, "
            "if any, is unchanged"
        ) from cause


def _write_atomically(obj: dict[str, Any], path: Path, who: str) -> None:
    if path.is_dir():
        raise IsADirectoryError(f"{who}: {path} is a directory; a full checkpoint is one file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check_seen_alike(path: Path) -> None:
    """Raise on every rank unless every rank sees ``path`` as the same kind of thing (a directory, a file, or
    nothing): a rank that does not see it (a node-local disk, a per-node mount) would raise alone while the others
    went on into the load's collectives and waited for it until the process group's timeout."""
    kind = "a directory" if path.is_dir() else "a file" if path.is_file() else "missing"
    if not _distributed_is_initialized() or torch.distributed.get_world_size() == 1:
        return
    kinds = comm.all_gather_objects(kind)
    if len(set(kinds)) > 1:
        seen = {k: [rank for rank, other in enumerate(kinds) if other == k] for k in dict.fromkeys(kinds)}
        described = "; ".join(f"{k} on rank(s) {ranks}" for k, ranks in seen.items())
        raise FileNotFoundError(
            f"shard_fsdp_tp: the checkpoint {path} is not the same on every rank ({described}); put it on a "
            "filesystem every rank sees (a shared path), or copy it to the same path on every node"
        )


def _read_meta(path: Path, weights_only: bool | None = True) -> dict[str, Any]:
    """Lightning's non-tensor checkpoint part (``meta.pt``) of a sharded directory, checked against the checksum
    in our marker when there is one, read with ``weights_only`` (Fabric's ``load(weights_only=...)``)."""
    from lightning_shard.checkpoint._safe_io import read_marker, undecodable, verify_file

    meta_file = path / META_FILE
    if not meta_file.is_file():
        return {}
    data = meta_file.read_bytes()
    verify_file(str(path), META_FILE, data, read_marker(str(path)))
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except Exception as e:  # other tools' directories have no checksum: name the file torch's reader refused
        raise undecodable(str(meta_file), "Lightning's checkpoint state", e) from e


def _untrusted_objects(path: Path, error: Exception) -> CheckpointSecurityError:
    """The error for Lightning's checkpoint part holding Python objects (e.g. from ``on_save_checkpoint``) when
    loaded with ``weights_only=True``: which file, which class, and the opt-in for a checkpoint the user trusts.

    Lightning's ``trainer.fit(..., weights_only=False)`` does not reach strategies that restore the checkpoint
    after setup (this one, and Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy``: ``Trainer._run`` drops
    the argument there), so the opt-in named is torch's allowlist, which ``weights_only=True`` loads honour."""
    reason = next((line for line in str(error).splitlines() if "GLOBAL" in line), str(error).splitlines()[0])
    return CheckpointSecurityError(
        f"shard_fsdp_tp: {path} holds Python objects beyond tensors and plain containers ({reason.strip()}), "
        "e.g. something on_save_checkpoint or a callback stored; they are not unpickled by default because "
        "unpickling runs their code. If you trust this checkpoint, allowlist their classes on every rank before "
        "the Trainer loads it: torch.serialization.add_safe_globals([TheClass]) (or `with "
        "torch.serialization.safe_globals([TheClass]): trainer.fit(...)`); or store plain values (tensors, "
        "numbers, strings, lists, dicts) instead"
    )


def _memory_line(model: nn.Module, summary: dict) -> str:
    """The startup summary's memory line: parameters in full vs on this rank (rank 0's shards), and what the
    gradients and an Adam optimizer add, so a user sees the sharded footprint before the first step. Records
    ``summary["parameter_bytes"] = (full, this rank)``."""
    from lightning_shard.planner.estimate import format_bytes

    params = list(model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
    summary["parameter_bytes"] = (full, local)
    shared = summary.get("shared_left_to_parent") or []
    tied = f"; shared parameters kept in an enclosing unit: {len(shared)}" if shared else ""
    return (
        f"shard_fsdp_tp: parameters {sum(p.numel() for p in params) / 1e6:.2f} M, {format_bytes(full)} in full, "
        f"{format_bytes(local)} on this rank (gradients the same again, Adam state 2x more: ~{format_bytes(4 * local)} "
        f"of model states per rank before activations){tied}"
    )


def _local_loss(out):
    """``training_step``'s loss under ``loss_parallel``: a replicated DTensor becomes its local value (the
    same on every TP rank), with gradients flowing back into the DTensor graph."""
    from lightning_shard.tensor import DTensor

    if isinstance(out, DTensor):
        return replicated_loss(out)
    if isinstance(out, dict) and isinstance(out.get("loss"), DTensor):
        return {**out, "loss": replicated_loss(out["loss"])}
    return out


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Put every (non-meta) buffer on ``device`` by replacing the module's entry (not ``.data``, which cannot
    change a tensor's device type under the simulator's fake tensors); a buffer registered on several modules
    stays shared. A DTensor buffer (tensor parallelism replicated it while the model was on the host) moves its
    local tensor. Parameters are placed by fully_shard, one unit at a time."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, t in module._buffers.items():
            if t is None or t.is_meta:
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.device == device:
                continue
            if id(t) not in moved:
                if isinstance(t, DTensor):
                    moved[id(t)] = DTensor.from_local(
                        local.detach().to(device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
                    )
                else:
                    moved[id(t)] = t.detach().to(device)
            module._buffers[name] = moved[id(t)]


def _top_level_entries(keys: set[str]) -> set[str]:
    """The top-level names ("state_dict", "optimizer_0", ...) among a sharded checkpoint's ``loading.saved_keys``."""
    return {key.split(".", 1)[0] for key in keys}


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"ShardFSDPTPStrategy: {name}={value!r} is not one of {sorted(allowed)}")


def _check_size(name: str, value) -> int | str:
    """A mesh size as given: a positive int, ``"auto"``, or the same as a string (``"2"``, as LightningCLI and
    other command lines pass it); returns the int or ``"auto"``."""
    given = value
    if isinstance(value, str) and value.strip().isdecimal():
        value = int(value.strip())
    elif isinstance(value, str) and value.strip() == "auto":
        value = "auto"
    if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"ShardFSDPTPStrategy: {name}={given!r} must be 'auto' or a positive int (or its digits)")
    return value


def _check_arguments(
    *,
    sharding_strategy,
    tensor_parallel_size,
    fsdp_unit,
    tp_plan,
    reshard_after_forward,
    cpu_offload,
    activation_checkpointing_policy,
    process_group_backend,
    timeout,
    planner_batch,
    planner_seq_len,
    planner_device_memory=None,
) -> None:
    """Everything ``__init__`` can check without knowing the devices, so that ``Trainer(strategy=...)`` fails
    in the user's process with a message naming the argument, rather than in every launched rank."""
    name = "ShardFSDPTPStrategy"
    hybrid, _, no_shard = _SHARDING[sharding_strategy]
    if (hybrid or no_shard) and isinstance(tensor_parallel_size, int) and tensor_parallel_size > 1:
        raise ValueError(
            f"{name}: sharding_strategy={sharding_strategy!r} with tensor_parallel_size={tensor_parallel_size} is "
            "not supported; use FULL_SHARD or SHARD_GRAD_OP with tensor parallelism"
        )
    if isinstance(fsdp_unit, type) or not (
        fsdp_unit == "auto" or isinstance(fsdp_unit, (set, frozenset)) or callable(fsdp_unit)
    ):
        cls = fsdp_unit.__name__ if isinstance(fsdp_unit, type) else None
        hint = f"; to shard every {cls}, pass {{{cls}}}" if cls else ""
        raise TypeError(f"{name}: fsdp_unit={fsdp_unit!r}: use 'auto', a set of module classes, or a callable{hint}")
    # A style object is a valid plan too (parallelize_module applies it to the root); refuse what never is.
    if isinstance(tp_plan, (str, bool, int, float)) and tp_plan != "auto":
        raise TypeError(f"{name}: tp_plan={tp_plan!r}: use 'auto', a dict {{module name: ParallelStyle}}, or None")
    # "auto" exactly (the planner decides); other spellings ("Auto") are refused, not guessed at
    if reshard_after_forward != "auto" and (
        not isinstance(reshard_after_forward, int)
        or (not isinstance(reshard_after_forward, bool) and reshard_after_forward < 1)
    ):
        raise ValueError(
            f"{name}: reshard_after_forward={reshard_after_forward!r}: use True, False, an int >= 1 or 'auto'"
        )
    _, reshard, _ = _SHARDING[sharding_strategy]
    if not reshard and isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        # These strategies keep the gathered parameters until backward: the k-way reshard would be dropped unseen.
        raise ValueError(
            f"{name}: reshard_after_forward={reshard_after_forward} (a {reshard_after_forward}-way shard kept after "
            f"forward) conflicts with sharding_strategy={sharding_strategy!r}, which keeps the parameters gathered "
            "between forward and backward; use sharding_strategy='FULL_SHARD' (or 'HYBRID_SHARD') with it, or leave "
            "reshard_after_forward at its default"
        )
    if cpu_offload != "auto" and not isinstance(cpu_offload, bool):
        raise TypeError(f"{name}: cpu_offload={cpu_offload!r} must be True, False or 'auto'")
    policy = activation_checkpointing_policy
    if (
        policy is not None
        and policy != "auto"
        and not (
            isinstance(policy, (set, frozenset, list, tuple))
            and all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy)
        )
    ):
        hint = f"; pass {{{policy.__name__}}}" if isinstance(policy, type) else ""
        raise TypeError(
            f"{name}: activation_checkpointing_policy={policy!r}: use a set of nn.Module classes, None or 'auto'{hint}"
        )
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise TypeError(f"{name}: process_group_backend={process_group_backend!r} must be a string such as 'nccl'")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"{name}: timeout={timeout!r} must be a datetime.timedelta, e.g. timedelta(minutes=30)")
    for arg, value in (("planner_batch", planner_batch), ("planner_seq_len", planner_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {arg}={value!r} must be a positive int")
    if planner_device_memory is not None:
        from lightning_shard.planner import parse_bytes

        try:
            ok = not isinstance(planner_device_memory, bool) and parse_bytes(planner_device_memory) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"{name}: planner_device_memory={planner_device_memory!r}: use a positive number of bytes or a size "
                "such as '24GiB' (None: the device's own memory)"
            )


def _check_sizes_for_world(dp, tp, world: int) -> None:
    """The mesh sizes against the number of devices, as far as they are fixed ('auto' is decided later)."""
    if world < 1:
        return
    if isinstance(tp, int) and world % tp:
        raise ValueError(
            f"ShardFSDPTPStrategy: tensor_parallel_size={tp} does not divide the {world} devices; choose a divisor"
        )
    if isinstance(dp, int) and isinstance(tp, int) and dp * tp != world:
        raise ValueError(
            f"ShardFSDPTPStrategy: data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} but there are "
            f"{world} devices; make the product equal the number of devices (or use 'auto')"
        )
    if isinstance(dp, int) and world % dp:
        raise ValueError(
            f"ShardFSDPTPStrategy: data_parallel_size={dp} does not divide the {world} devices; choose a divisor"
        )
