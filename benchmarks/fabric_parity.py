"""Fabric(strategy="shard_fsdp_tp") against one process on the same global batches, and bf16-mixed against DDP.

1. fp32: ``--world-size`` CPU ranks (gloo) train the tests' TinyGPT with AdamW for ``--steps`` steps through
   Fabric, each rank on its slice of the global batch; one process trains the same model on the whole batches.
   Printed: the largest parameter difference after the steps.
2. bf16-mixed: the first-step loss of each rank (Fabric, FSDP bf16 parameter gather + autocast) against DDP's
   bf16-mixed on the same local batch (the fp32 model under ``torch.autocast("cpu", torch.bfloat16)``) and
   against fp32. Printed: the relative differences.

    python benchmarks/fabric_parity.py --world-size 2 --steps 8
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    torch.set_num_threads(1)
    import lightning as L

    import strategies  # noqa: F401
    from tests.fsdp_models import batches, full_state, make_model, max_diff
    from tests.test_fabric import GLOBAL_BATCH, _adamw, _reference, _train
    from tests.test_precision_autocast import _data, _ddp_bf16_mixed_loss, _model

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="shard_fsdp_tp")
    fabric.launch()
    model = fabric.setup_module(make_model(0))
    opt = fabric.setup_optimizers(_adamw(model))
    _train(fabric, model, opt, iter(batches(steps, GLOBAL_BATCH)), steps)
    diff = max_diff(full_state(model.module), _reference(steps))

    mixed = L.Fabric(accelerator="cpu", devices=world, strategy="shard_fsdp_tp", precision="bf16-mixed")
    mixed.launch()
    classifier = mixed.setup_module(_model())
    x, y = (t.chunk(world)[rank] for t in _data().tensors)
    loss = F.cross_entropy(classifier(x), y).item()
    ddp = _ddp_bf16_mixed_loss(x, y)
    fp32 = F.cross_entropy(_model()(x), y).item()
    rows = [None] * world
    dist.all_gather_object(rows, (rank, loss, ddp, fp32))
    if rank == 0:
        print(f"fp32 AdamW, {steps} steps, {world} ranks vs one process: max |param diff| = {diff:.2e}")
        for r, ours, ref, full in rows:
            print(
                f"bf16-mixed rank {r}: first loss {ours:.6f}, "
                f"DDP bf16-mixed {ref:.6f} (rel {abs(ours - ref) / ref:.2e}), "
                f"fp32 {full:.6f} (rel {abs(ours - full) / full:.2e})"
            )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.world_size, port, args.steps), nprocs=args.world_size)


if __name__ == "__main__":
    main()
