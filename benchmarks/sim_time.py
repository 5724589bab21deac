"""Time ``simulate_training`` in-process: wall and CPU seconds of the Llama-3-8B simulation, for whichever
checkout is first on ``PYTHONPATH`` (to compare two versions, alternate them).

Example::

    PYTHONPATH=/path/to/checkout python benchmarks/sim_time.py --devices 8
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.sim_models import llama3_8b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8192)
    args = p.parse_args()
    import lightning_shard
    from lightning_shard.simulate.run import SimulationRequest, simulate_training

    request = SimulationRequest(
        devices=args.devices, tensor_parallel_size=args.tensor_parallel_size, precision="bf16-mixed",
        batch=1, seq_len=args.seq_len,
    )  # fmt: skip
    wall, cpu = time.perf_counter(), time.process_time()
    report = simulate_training(llama3_8b, request)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{os.path.dirname(os.path.dirname(lightning_shard.__file__))}: wall {wall:.1f} s, cpu {cpu:.1f} s, "
        f"peak {report['peak_device_bytes']} bytes, load {load}"
    )


if __name__ == "__main__":
    main()
