"""``nn.TransformerEncoder``'s nested-tensor eval path, kept away from tensor-parallel layers.

In eval mode without gradients and with a ``src_key_padding_mask``, ``nn.TransformerEncoder`` turns its input
into a nested tensor (padding dropped) and hands it to its layers, expecting each layer to take its fused fast
path. A layer holding forward hooks refuses that path, and the hooks TP styles install on its Linears then meet
the nested tensor: ``DTensor.from_local`` of it raised "NestedTensorImpl doesn't support sizes". The encoder's
own check never looks at its layers' hooks (torch's DTensor fails alike).

The fix keeps such encoders on padded tensors (``use_nested_tensor = False``) and reproduces what the nested
path returns: the same values at real positions, and at padded positions zeros before the encoder's final norm
(torch's ``to_padded_tensor(0.0)``). A forward pre-hook decides, with torch's own conditions, whether the nested
path would have run; when it would, the final norm is held back until the forward hook has zeroed the padding.

Example::

    parallelize_module(model, tp_mesh, plan)  # calls keep_encoders_padded(model, styled modules) itself
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["keep_encoders_padded"]

_SIGNATURE = inspect.signature(nn.TransformerEncoder.forward)
_DEVICE_TYPES = ("cpu", "cuda", "xpu")


def keep_encoders_padded(root: nn.Module, styled: list[nn.Module]) -> list[nn.TransformerEncoder]:
    """Guard every ``nn.TransformerEncoder`` under ``root`` whose layers contain one of ``styled`` (modules a TP
    style hooked); returns the encoders guarded now (each is guarded once)."""
    styled_ids = {id(m) for m in styled}
    guarded = []
    for encoder in root.modules():
        if not isinstance(encoder, nn.TransformerEncoder) or getattr(encoder, "_tp_nested_guard", False):
            continue
        if any(id(m) in styled_ids for m in encoder.layers.modules()):
            _guard(encoder)
            guarded.append(encoder)
    return guarded


def _guard(encoder: nn.TransformerEncoder) -> None:
    # What torch would have done is decided with the constructor's choice, kept here.
    encoder._tp_nested_guard = True
    encoder._tp_use_nested_tensor = bool(getattr(encoder, "use_nested_tensor", False))
    encoder.use_nested_tensor = False
    encoder.register_forward_pre_hook(_before, with_kwargs=True)
    encoder.register_forward_hook(_after, always_call=True)


def _before(encoder: nn.TransformerEncoder, args: tuple, kwargs: dict) -> None:
    bound = _SIGNATURE.bind(encoder, *args, **kwargs)
    src, mask = bound.arguments["src"], bound.arguments.get("mask")
    padding = bound.arguments.get("src_key_padding_mask")
    encoder.__dict__.pop("_tp_held", None)
    if padding is None:
        return
    # As torch's forward reads the mask: a float mask (0 real, -inf padded) whatever the caller passed.
    padding = F._canonical_mask(
        mask=padding,
        mask_name="src_key_padding_mask",
        other_type=F._none_or_dtype(mask),
        other_name="mask",
        target_type=src.dtype,
    )
    if not _would_nest(encoder, src, mask, padding):
        return
    # In the instance's __dict__: nn.Module.__setattr__ would register the norm as a second submodule.
    encoder.__dict__["_tp_held"] = (padding != 0, encoder.norm)  # True at padded positions
    encoder.norm = None  # applied in _after, once the padded positions hold zeros


def _after(encoder: nn.TransformerEncoder, args: tuple, output):
    held = encoder.__dict__.pop("_tp_held", None)
    if held is None:
        return None
    padding, norm = held
    encoder.norm = norm
    if not isinstance(output, torch.Tensor):  # the forward raised (always_call): only restore the norm
        return None
    output = output.masked_fill(padding[..., None], 0.0)
    return norm(output) if norm is not None else output


def _would_nest(encoder: nn.TransformerEncoder, src: torch.Tensor, mask, padding: torch.Tensor) -> bool:
    """torch's ``TransformerEncoder.forward`` conditions for converting ``src`` to a nested tensor."""
    first = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and encoder._tp_use_nested_tensor):
        return False
    if first.training or src.dim() != 3 or mask is not None or src.is_nested or torch.is_autocast_enabled():
        return False
    if getattr(encoder, "mask_check", True):
        if torch.compiler.is_compiling():
            return False
        if not torch._nested_tensor_from_mask_left_aligned(src, padding.logical_not()):
            return False
    attn = first.self_attn
    tensors = (
        src,
        attn.in_proj_weight,
        attn.in_proj_bias,
        attn.out_proj.weight,
        attn.out_proj.bias,
        first.norm1.weight,
        first.norm1.bias,
        first.norm2.weight,
        first.norm2.bias,
        first.linear1.weight,
        first.linear1.bias,
        first.linear2.weight,
        first.linear2.bias,
    )
    if not all(t.device.type in _DEVICE_TYPES for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
