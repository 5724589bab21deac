"""What the strategy chose, as a few lines printed at the start of every example (rank 0).

Example::

    class PrintSummary(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            rank_zero_info(parallel_summary(trainer, pl_module))
"""

from __future__ import annotations

import torch


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def parallel_summary(trainer, module: torch.nn.Module) -> str:
    """Mesh, FSDP units, TP plan (first entries) and parameter memory: full model vs this rank's shards."""
    strategy = trainer.strategy
    mesh = getattr(strategy, "device_mesh", None)
    info = getattr(strategy, "parallel_summary", {}) or {}
    lines = ["-" * 72, f"strategy {type(strategy).__name__} on {trainer.world_size} x {strategy.root_device.type}"]
    if mesh is not None:
        lines.append(f"  mesh: {dict(zip(mesh.mesh_dim_names, mesh.shape))}")
    units = info.get("fsdp_units") or []
    lines.append(f"  FSDP units: {len(units)} x {units[0] if units else '-'} + root")
    plan = info.get("tp_plan") or {}
    if plan:
        shown = [f"{k}: {type(v).__name__}" for k, v in list(plan.items())[:6]]
        more = f" ... ({len(plan)} entries)" if len(plan) > 6 else ""
        lines.append(f"  TP plan: {', '.join(shown)}{more}")
    else:
        lines.append("  TP plan: none (tensor_parallel_size=1)")
    params = list(module.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    local = sum(_local(p).numel() * p.element_size() for p in params)
    n = sum(p.numel() for p in params)
    lines.append(
        f"  parameters: {n / 1e6:.1f} M, {full / 2**20:.1f} MiB in full, {local / 2**20:.1f} MiB on this rank "
        f"(+ the same again for gradients, 2x for AdamW state)"
    )
    lines.append("-" * 72)
    return "\n".join(lines)
