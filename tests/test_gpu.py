"""GPU variants, following Lightning's multi-GPU conventions (``RunIf``; ``standalone=True`` tests run alone
with ``PL_RUN_STANDALONE_TESTS=1``). Skipped without CUDA."""

import copy
import os
import subprocess
import sys

import torch

from strategies.testing import RunIf
from tests.fsdp_models import batches, full_state, loss_fn, make_model, max_diff


@RunIf(min_cuda_gpus=1)
def test_fully_shard_on_one_gpu_matches_plain_model():
    from lightning_shard import init_device_mesh
    from lightning_shard.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("data_parallel",))  # a group of one over NCCL
    model = make_model().cuda()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for x, y in batches(3, 4):
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            loss_fn(m, x.cuda(), y.cuda()).backward()
            opt.step()
    assert max_diff(full_state(model), full_state(ref)) < 1e-5


@RunIf(min_cuda_gpus=2, standalone=True)
def test_main_job_on_two_gpus():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "examples/finetune_classifier.py", "--devices", "2", "--accelerator", "gpu",
         "--precision", "bf16-mixed", "--max-steps", "5"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "accuracy" in out.stdout.lower()
