"""``nn.Embedding(max_norm=...)`` and ``nn.EmbeddingBag(max_norm=...)`` under FSDP.

Their forward renormalises the looked-up rows of the weight in place (``torch.embedding_renorm_``, under
``no_grad``), so on one device the parameter itself changes during forward, in training and in eval. Under
FSDP the forward sees the unsharded copy: the renormalisation would land there and be freed at the next
reshard, the sharded master weight would never change, and training would go on from weights a single
device no longer has (measured: 9.5 max parameter difference after 3 SGD steps on 2 ranks), with no error.

``install_max_norm_hooks`` gives each such module a forward pre-hook that does on the sharded master what
one device does to its weight with the global batch: the rows looked up by any data-parallel rank (a
presence mask of ``num_embeddings`` entries, summed over the shard group and, for HSDP, the replicate group)
are renormalised in this rank's shard and, when the group is unsharded, in the unsharded weight too (which a
tied LM head reads whole). The module's own renormalisation of its local rows then finds them within
``max_norm`` and leaves them unchanged, as a second renormalisation on one device would.

The hook is collective: every rank of the group must call the module the same number of times, which FSDP's
all-gathers already require. A weight that tensor parallelism shards cannot be renormalised row by row on
its local part (a row's norm needs the whole row, and the rows a rank holds are not the rows it looks up):
``fully_shard`` refuses it, naming the module.

Example::

    emb = nn.Embedding(100, 16, max_norm=1.0)
    fully_shard(model)             # installs the hook; training then equals one device on the global batch
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_shard import comm
from lightning_shard.fsdp.param_group import FSDPParamGroup

_RENORM_TYPES = (nn.Embedding, nn.EmbeddingBag)


def install_max_norm_hooks(group: FSDPParamGroup) -> None:
    """A renormalising forward pre-hook on every embedding of ``group`` with ``max_norm`` set (see module
    docstring); raises ``ValueError`` for one whose weight tensor parallelism shards."""
    for index, fp in enumerate(group.params):
        for module, name in fp.refs:
            if not isinstance(module, _RENORM_TYPES) or name != "weight" or module.max_norm is None:
                continue
            if fp.tp_spec is not None and not all(p.is_replicate() for p in fp.tp_spec.placements):
                raise ValueError(
                    f"fully_shard: {type(module).__name__} {fp.fqn.rsplit('.', 1)[0]!r} has max_norm="
                    f"{module.max_norm}, which renormalises whole rows of its weight in place during forward, but "
                    f"tensor parallelism shards that weight ({list(fp.tp_spec.placements)}), so no rank holds "
                    "whole rows; leave the embedding replicated in the TP plan (the automatic plan does), or set "
                    "max_norm=None"
                )
            module.register_forward_pre_hook(_RenormHook(group, index))


class _RenormHook:
    """The pre-hook of one embedding: renormalise, in the master shard and the unsharded weight, the rows any
    data-parallel rank looks up in this call."""

    def __init__(self, group: FSDPParamGroup, index: int) -> None:
        self.group = group
        self.index = index

    def __call__(self, module: nn.Module, args: tuple) -> None:
        indices = args[0] if args else None
        if not isinstance(indices, torch.Tensor):
            return  # called with keywords: nn.Embedding's own forward would fail on it anyway
        group, fp = self.group, self.group.params[self.index]
        weight = module._parameters["weight"]
        if weight is not fp.sharded and weight is not fp.unsharded:
            # Inside summon_full_params (FSDP hooks off; e.g. a forward on rank 0 only, which a collective here
            # would hang): the module holds the full parameter, which its own forward renormalises.
            return
        if hasattr(indices, "full_tensor"):
            indices = indices.full_tensor()
        rows = self._rows_looked_up_anywhere(indices.reshape(-1), module.num_embeddings, group)
        with torch.no_grad():
            shard = fp.sharded._local_tensor
            start = group.mesh_info.shard_rank * group.layout.rows_per_shard[self.index]
            local = rows[(rows >= start) & (rows < start + shard.shape[0])] - start
            if local.numel():
                torch.embedding_renorm_(shard, local.to(shard.device), module.max_norm, module.norm_type)
            if group.is_unsharded and weight is fp.unsharded:
                unsharded = weight._local_tensor if hasattr(weight, "_local_tensor") else weight
                torch.embedding_renorm_(unsharded, rows.to(unsharded.device), module.max_norm, module.norm_type)

    @staticmethod
    def _rows_looked_up_anywhere(indices: torch.Tensor, num_embeddings: int, group: FSDPParamGroup) -> torch.Tensor:
        present = torch.zeros(num_embeddings, dtype=torch.int32, device=group.device)
        present[indices.to(group.device)] = 1
        comm.all_reduce(present, group.mesh_info.shard_group)
        if group.mesh_info.replicate_group is not None:
            comm.all_reduce(present, group.mesh_info.replicate_group)
        return present.nonzero().reshape(-1)
