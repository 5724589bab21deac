"""Parallel styles: how one module's parameters become DTensors and how its inputs/outputs are converted.

Same names, arguments and defaults as ``torch.distributed.tensor.parallel`` (``input_layouts``,
``output_layouts``, ``use_local_output``, ``desired_input_layouts``, ...), built on our DTensor. Each style
has a ``_check`` (runs before any collective: module type, divisibility) and an ``_apply`` (distributes the
parameters with ``src_data_rank`` semantics and installs forward hooks).

Example::

    parallelize_module(mlp, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_shard.mesh import DeviceMesh
from lightning_shard.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from lightning_shard.tensor.grad_hooks import carry_over_grad_hooks

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "DivideAttributes",
]


class ParallelStyle:
    """Base class: ``_check(fqn, module, tp_size)`` validates, ``_apply(module, mesh)`` rewrites the module.

    ``planned_placements(module)`` tells ``parallelize_module`` which parameters the style distributes and
    how, so tied parameters can be checked for consistency before any collective.

    >>> ColwiseParallel().planned_placements(nn.Linear(4, 2))
    {'weight': (Shard(dim=0),), 'bias': (Shard(dim=0),)}
    """

    src_data_rank: int | None = 0

    def _check(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        return None

    def planned_placements(self, module: nn.Module) -> dict[str, tuple[Placement, ...]]:
        return {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError


def _shard_params(module: nn.Module, placements: dict[str, tuple[Placement, ...]], mesh: DeviceMesh, src) -> None:
    for name, pl in placements.items():
        param = module._parameters.get(name)
        if param is None or isinstance(param, DTensor):
            continue  # already distributed (a tied parameter distributed through another module)
        dt = distribute_tensor(param.detach(), mesh, pl, src_data_rank=src)
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        carry_over_grad_hooks(param, new)  # the user's register_hook / post-accumulate-grad hooks
        module.register_parameter(name, new)


def _type_name(module: nn.Module) -> str:
    return type(module).__name__


def is_conv1d(module: nn.Module) -> bool:
    """True for Hugging Face's ``Conv1D`` (GPT-2): a linear layer whose weight is stored transposed,
    ``(in_features, out_features)``, computing ``x @ weight + bias``. Recognised by name and shape, so
    ``transformers`` is not imported."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(w, torch.Tensor)
        and w.ndim == 2
        and getattr(module, "nf", None) == w.shape[1]
    )


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or Hugging Face's transposed ``Conv1D``: what Colwise/Rowwise shard besides embeddings.

    Not one whose ``weight`` is computed rather than registered (``torch.nn.utils.parametrize``:
    ``weight_norm``, ``spectral_norm``, ...; the old ``nn.utils.weight_norm`` hook): the styles shard the
    ``weight`` parameter itself, and reading a parametrized ``weight`` runs its parametrization (spectral
    norm's power iteration updates its ``_u``/``_v`` buffers at every read in training mode). Such modules
    stay replicated.
    """
    if (isinstance(module, nn.Linear) or is_conv1d(module)) and "weight" not in module._parameters:
        return False
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def _check_type(style: str, fqn: str, module: nn.Module) -> None:
    if not (is_linear(module) or isinstance(module, nn.Embedding)):
        raise ValueError(
            f"{style} on '{fqn}': module type {_type_name(module)} is not supported; {style} shards "
            "nn.Linear, Hugging Face Conv1D and nn.Embedding (plan a parent module's children instead)"
        )
    if isinstance(module, nn.Embedding) and module.sparse:  # a sparse COO gradient of a DTensor weight: no rule
        raise ValueError(
            f"{style} on '{fqn}': nn.Embedding(sparse=True) gets sparse gradients, which tensor parallelism cannot "
            "shard; build it with sparse=False (the same gradient values, dense), or leave it out of the plan"
        )


def _check_divisible(style: str, fqn: str, module: nn.Module, what: str, size: int, tp_size: int) -> None:
    if size % tp_size:
        raise ValueError(
            f"{style} on '{fqn}' ({_type_name(module)}): {what} {size} is not divisible by the tensor-parallel "
            f"size {tp_size}; its shards would be uneven ({-(-size // tp_size)} and fewer), which a local tensor "
            "passed between modules cannot describe. Choose sizes divisible by the TP size, or leave the module "
            "out of the plan"
        )


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    Why: ``DTensor.to_local``'s backward wraps the incoming local gradient with the forward tensor's global
    (contiguous) strides, but a gradient coming back through ``transpose``/``matmul`` in the module's own
    code can be laid out differently; a later ``view`` of that DTensor then fails on the local tensor.
    The output shares the input's memory but is not an autograd view of it, so the module's caller may update
    it in place (Falcon: ``mlp_output += attention_output``); a view returned by a custom Function may not be.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _local(x: DTensor) -> torch.Tensor:
    """``x.to_local()`` for a module output handed to plain-tensor code."""
    local = x.to_local()
    return _DenseGrad.apply(local) if local.requires_grad else local


def _to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement) -> DTensor:
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor or DTensor module input, got {type(x).__name__}")
    # Like torch: a plain tensor is this rank's shard of an evenly sharded (or replicated) global tensor.
    return DTensor.from_local(x, mesh, (layout,), run_check=False)


def _redistribute(x: DTensor, layout: Placement) -> DTensor:
    return x if x.placements == _norm((layout,), x.ndim) else x.redistribute(x.device_mesh, (layout,))


def _check_output_on_tp_mesh(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> None:
    """An output on a larger mesh than the TP one the module's style was applied on comes from parameters still
    sharded by ``fully_shard`` over the data-parallel dim too: the module ran where its FSDP unit's hooks did
    not gather them. Redistributing it onto the TP mesh would fail with a placement-count error."""
    if out.device_mesh == mesh:
        return
    held = [
        f"{n} {list(p.placements)}"
        for n, p in module.named_parameters(recurse=False)
        if isinstance(p, DTensor) and p.device_mesh != mesh
    ]
    if not held:
        return
    raise RuntimeError(
        f"{type(module).__name__} (tensor parallel): its output is a DTensor on the mesh "
        f"{out.device_mesh.mesh_dim_names} {tuple(out.device_mesh.shape)}, not on the tensor-parallel mesh "
        f"{mesh.mesh_dim_names} {tuple(mesh.shape)} its style was applied on: its parameters ({', '.join(held)}) "
        "are still sharded by fully_shard. The module ran outside the forward of its fully_shard unit, whose hooks "
        "gather them: a child called directly, or a custom autograd.Function whose backward recomputes its layers "
        "(e.g. the reversible layers of Hugging Face's Reformer, ReformerLayer.backward_pass). Make the module "
        "that calls it the unit instead (for Reformer fsdp_unit={ReformerEncoder}), or call the unit itself"
    )


def _norm(placements: tuple[Placement, ...], ndim: int) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements)


class ColwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` on its output features (weight and bias ``Shard(0)``) or an ``nn.Embedding``
    on its embedding dim (weight ``Shard(1)``). Input: ``input_layouts`` (default ``Replicate()``), turned
    into ``Replicate()``; output ``Shard(-1)``, redistributed to ``output_layouts`` (default ``Shard(-1)``),
    returned as a local tensor when ``use_local_output`` (default True).

    Example: ``parallelize_module(m, tp_mesh, {"w1": ColwiseParallel()})``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _check(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        name = type(self).__name__
        _check_type(name, fqn, module)
        # A local output sharded on the last dim is re-wrapped by the next module assuming even shards.
        if self.use_local_output and self.output_layouts[0].is_shard():
            if isinstance(module, nn.Embedding):
                _check_divisible(name, fqn, module, "embedding_dim", module.embedding_dim, tp_size)
            else:
                _check_divisible(name, fqn, module, "out_features", linear_dims(module)[1], tp_size)

    def planned_placements(self, module: nn.Module) -> dict[str, tuple[Placement, ...]]:
        if is_conv1d(module):  # weight (in, out): the output features are its columns
            return {n: (Shard(1 if n == "weight" else 0),) for n, p in module._parameters.items() if p is not None}
        dim = 0 if isinstance(module, nn.Linear) else 1
        return {n: (Shard(dim),) for n, p in module.named_parameters(recurse=False) if p is not None}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _shard_with_io_layouts(self, module, device_mesh)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


def _shard_with_io_layouts(style, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Colwise/Rowwise: shard ``module``'s parameters as ``style`` plans, bring the first input from
    ``input_layouts`` to ``desired_input_layouts`` and the output to ``output_layouts`` (local if asked)."""
    placements = style.planned_placements(module)
    src = style.src_data_rank
    desired = style.desired_input_layouts[0]

    def prepare_input(mod, inputs, mesh):
        x = _to_dtensor(inputs[0], mesh, style.input_layouts[0])
        return (_redistribute(x, desired), *inputs[1:])

    def prepare_ids(mod, args, kwargs):
        # An embedding's tensor inputs are ids, the same on every rank. An nn.Embedding subclass may compute
        # its ids from several inputs (OPT's positional embedding: an attention mask and ``position_ids=``
        # keyword), so every tensor argument becomes a replicated DTensor, not only the first.
        def rep(x):
            return _to_dtensor(x, device_mesh, Replicate()) if isinstance(x, torch.Tensor) else x

        return tuple(rep(a) for a in args), {k: rep(v) for k, v in kwargs.items()}

    def prepare_output(mod, out, mesh):
        _check_output_on_tp_mesh(mod, out, mesh)
        layout = style.output_layouts[0]
        if style.use_local_output and layout.is_shard() and not out.placements[0].is_shard():
            _check_even_output(mod, out, layout, mesh)
        out = _redistribute(out, layout)
        return _local(out) if style.use_local_output else out

    if isinstance(module, nn.Embedding) and style.input_layouts[0].is_replicate():
        distribute_module(module, device_mesh, lambda n, m, mesh: _shard_params(m, placements, mesh, src))
        module.register_forward_pre_hook(prepare_ids, with_kwargs=True)
        module.register_forward_hook(lambda m, inputs, out: prepare_output(m, out, device_mesh))
        return module
    return distribute_module(
        module, device_mesh, lambda n, m, mesh: _shard_params(m, placements, mesh, src), prepare_input,
        prepare_output,
    )  # fmt: skip


def _check_even_output(module: nn.Module, out: DTensor, layout: Shard, mesh: DeviceMesh) -> None:
    """A local output sharded on ``layout.dim`` is re-wrapped downstream as an even shard: refuse an uneven
    one (e.g. a sequence length not divisible by the TP size under sequence parallelism) before the
    collective, on every rank (all ranks see the same global shape)."""
    dim = layout.dim % out.ndim
    size, tp = out.shape[dim], mesh.size()
    if size % tp:
        what = "sequence length" if dim == out.ndim - 2 else f"size of dim {dim}"
        raise ValueError(
            f"{_type_name(module)} output of shape {tuple(out.shape)} is sharded on dim {dim} (sequence parallel) "
            f"but its {what} {size} is not divisible by the tensor-parallel size {tp}; pad the batch to a multiple "
            f"of {tp} (e.g. pad_to_multiple_of={tp} in a Hugging Face tokenizer) or turn sequence_parallel off"
        )


class RowwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` on its input features (weight ``Shard(1)``, bias replicated; the output is a
    ``Partial`` sum) or an ``nn.Embedding`` on its rows, i.e. the vocabulary (weight ``Shard(0)``: each rank
    looks up the ids it holds). Input: ``input_layouts`` (default ``Shard(-1)``; a Linear wants ``Shard(-1)``,
    an Embedding ``Replicate()``); output reduced to ``output_layouts`` (default ``Replicate()``: all-reduce;
    ``Shard(1)``: reduce-scatter for sequence parallel).

    Example: ``{"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "w2": RowwiseParallel()}``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _check(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        _check_type("RowwiseParallel", fqn, module)
        # A Linear's sharded input arrives as a local tensor that is re-wrapped assuming even shards.
        if not isinstance(module, nn.Embedding) and self.input_layouts[0].is_shard():
            _check_divisible("RowwiseParallel", fqn, module, "in_features", linear_dims(module)[0], tp_size)

    def planned_placements(self, module: nn.Module) -> dict[str, tuple[Placement, ...]]:
        if isinstance(module, nn.Embedding):
            return {"weight": (Shard(0),)}
        out = {"weight": (Shard(0 if is_conv1d(module) else 1),)}
        # getattr: tp_coverage asks before parallelize_module's _check has refused a module type without a bias
        # (a norm, an activation), which then gets the ValueError naming the style and the module.
        if getattr(module, "bias", None) is not None:
            out["bias"] = (Replicate(),)
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Replicate() if isinstance(module, nn.Embedding) else Shard(-1),)
        return _shard_with_io_layouts(self, module, device_mesh)

    __repr__ = ColwiseParallel.__repr__


class SequenceParallel(ParallelStyle):
    """Run a norm (LayerNorm, RMSNorm, any module whose parameters have at most one dim) or a dropout on an
    input sharded on ``sequence_dim`` (default 1); parameters are replicated. A plain-tensor input is taken
    as this rank's sequence shard; a DTensor input is redistributed to ``Shard(sequence_dim)``. The output
    stays sharded (a DTensor unless ``use_local_output``).

    Example: ``{"layers.*.attention_norm": SequenceParallel()}``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _check(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        big = [n for n, p in module.named_parameters() if p.ndim > 1]
        if big:
            raise ValueError(
                f"SequenceParallel on '{fqn}': module type {_type_name(module)} is not supported; it has "
                f"parameters with more than one dim ({big}). SequenceParallel is for norms and dropout"
            )

    def planned_placements(self, module: nn.Module) -> dict[str, tuple[Placement, ...]]:
        return {n: (Replicate(),) for n, _ in module.named_parameters(recurse=False)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        src = self.src_data_rank

        def replicate(name, mod, mesh):
            _shard_params(mod, {n: (Replicate(),) for n, _ in mod.named_parameters(recurse=False)}, mesh, src)

        def prepare_input(mod, inputs, mesh):
            x = inputs[0]
            if isinstance(x, DTensor):
                return (_redistribute(x, self.sequence_sharding[0]), *inputs[1:])
            return (_to_dtensor(x, mesh, self.sequence_sharding[0]), *inputs[1:])

        def prepare_output(mod, out, mesh):
            return _local(out) if self.use_local_output else out

        return distribute_module(module, device_mesh, replicate, prepare_input, prepare_output)

    def __repr__(self) -> str:
        return (
            f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, use_local_output={self.use_local_output})"
        )


def _as_tuple(layouts):
    return (layouts,) if isinstance(layouts, Placement) else layouts


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs to DTensors with ``input_layouts`` (``None`` leaves an input alone) and
    redistribute them to ``desired_input_layouts``; the same per keyword with ``input_kwarg_layouts`` /
    ``desired_input_kwarg_layouts``. Returns local tensors when ``use_local_output`` (default False).
    Positional inputs beyond ``input_layouts`` pass through unchanged (torch raises instead), so a plan can
    name only the leading activation of a module that takes extra arguments.

    Example: ``{"attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | Sequence[Placement | None] | None = None,
        desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        self.use_local_output = use_local_output
        if self.input_layouts is not None and (
            self.desired_input_layouts is None or len(self.input_layouts) != len(self.desired_input_layouts)
        ):
            raise ValueError(
                f"PrepareModuleInput: input_layouts {self.input_layouts} and desired_input_layouts "
                f"{self.desired_input_layouts} must have the same length"
            )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}

    def _prepare(self, x, mesh, layout, desired):
        if layout is None or not isinstance(x, torch.Tensor):
            return x
        dt = _to_dtensor(x, mesh, layout)
        if desired is not None:
            dt = _redistribute(dt, desired)
        return _local(dt) if self.use_local_output else dt

    def _prepare_args(self, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if self.input_layouts is None:
            return inputs
        head = [
            self._prepare(x, mesh, lay, des)
            for x, lay, des in zip(inputs, self.input_layouts, self.desired_input_layouts)
        ]
        return (*head, *inputs[len(head) :])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:

            def hook(mod, args, kwargs):
                kwargs = {
                    k: self._prepare(
                        v, device_mesh, self.input_kwarg_layouts.get(k), self.desired_input_kwarg_layouts.get(k)
                    )
                    for k, v in kwargs.items()
                }
                return self._prepare_args(args, device_mesh), kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda mod, args: self._prepare_args(args, device_mesh))
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
            f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, use_local_output={self.use_local_output})"
        )


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs to DTensors with ``output_layouts`` (``None`` leaves an output alone) and
    redistribute them to ``desired_output_layouts``; local tensors when ``use_local_output`` (default True).

    Example: ``{"layers.3": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())}``.
    """

    def __init__(
        self,
        *,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement | None],
        use_local_output: bool = True,
    ) -> None:
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: output_layouts {self.output_layouts} and desired_output_layouts "
                f"{self.desired_output_layouts} must have the same length"
            )

    def _prepare(self, outputs, mesh: DeviceMesh):
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        if len(outs) != len(self.output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: the module returned {len(outs)} outputs but output_layouts has "
                f"{len(self.output_layouts)} entries"
            )
        result = []
        for out, lay, des in zip(outs, self.output_layouts, self.desired_output_layouts):
            if lay is None:
                result.append(out)
                continue
            dt = _to_dtensor(out, mesh, lay)
            if des is not None:
                dt = _redistribute(dt, des)
            result.append(_local(dt) if self.use_local_output else dt)
        return result[0] if single else tuple(result)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, inputs, outputs: self._prepare(outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (
            f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
            f"{self.desired_output_layouts}, use_local_output={self.use_local_output})"
        )


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module (torch's name and arguments).

    Example: ``PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
    output_layouts=Replicate(), desired_output_layouts=Shard(1))``.
    """

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts=None,
        desired_input_kwarg_layouts=None,
        use_local_input: bool = False,
        output_layouts,
        desired_output_layouts,
        use_local_output: bool = True,
    ) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module


class DivideAttributes(ParallelStyle):
    """Divide integer attributes of a module by the TP size, so a forward that reshapes with them (e.g.
    ``q.view(B, T, self.n_heads, self.head_dim)`` after a column-sharded projection) sees the local count.
    Not a torch style: ``auto_tp_plan`` emits it for attention modules. Each attribute must be divisible.

    Example: ``{"layers.*.attn": DivideAttributes(("n_heads", "n_kv_heads"))}``.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def _check(self, fqn: str, module: nn.Module, tp_size: int) -> None:
        for name in self.names:
            value = getattr(module, name, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(
                    f"DivideAttributes on '{fqn}' ({_type_name(module)}): attribute {name!r} is {value!r}, not an int"
                )
            if value % tp_size:
                raise ValueError(
                    f"DivideAttributes on '{fqn}' ({_type_name(module)}): {name} {value} is not divisible by "
                    f"the tensor-parallel size {tp_size}"
                )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            setattr(module, name, getattr(module, name) // device_mesh.size())
        return module

    def __repr__(self) -> str:
        return f"DivideAttributes({self.names})"
