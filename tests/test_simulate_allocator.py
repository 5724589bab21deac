"""The CUDA caching allocator replay (``lightning_shard.simulate.allocator``) on hand-derived cases, the memory
tracker's allocator trace, and the reserved peaks the simulator reports for both engines.

Every expected value below is worked out by hand from the allocator's documented rules
(``c10/cuda/CUDACachingAllocator.cpp``): sizes round up to 512 bytes; requests up to 1 MiB use the small pool
and 2 MiB segments; 1-10 MiB requests use 20 MiB segments; larger ones a segment of their size rounded up to
2 MiB; best fit within the pool of the request's stream; a block splits when at least 512 bytes (small pool) or
more than 1 MiB (large pool) would remain; freed neighbours coalesce.
"""

import pytest
import torch
from torch import nn

from lightning_shard.simulate.allocator import (
    Alloc,
    AllocatorConfig,
    AllocatorOutOfMemory,
    Free,
    Phase,
    replay,
)
from lightning_shard.simulate.memory import MemoryTracker

KiB, MiB = 1 << 10, 1 << 20


def test_a_one_byte_request_is_a_512_byte_block_in_a_2_mib_small_segment():
    r = replay([Alloc(1, 1)])
    assert (r.peak_requested, r.peak_allocated, r.peak_reserved) == (1, 512, 2 * MiB)


def test_small_requests_pack_into_2_mib_segments():
    # four 512 KiB blocks fill one 2 MiB segment exactly (the last takes the whole 512 KiB remainder); a fifth
    # needs a second segment
    r = replay([Alloc(k, 512 * KiB) for k in range(4)])
    assert r.peak_reserved == 2 * MiB and r.segments == 1
    r = replay([Alloc(k, 512 * KiB) for k in range(5)])
    assert r.peak_reserved == 4 * MiB and r.segments == 2


def test_small_and_large_pools_do_not_share_blocks():
    # 1 MiB is the largest small request (a 2 MiB segment); 1 MiB + 1 byte is large: a free small segment
    # cannot serve it, so a 20 MiB large segment is reserved
    r = replay([Alloc(1, MiB), Free(1), Alloc(2, MiB + 1)])
    assert r.peak_reserved == 2 * MiB + 20 * MiB
    assert r.peak_allocated == MiB + 512  # one at a time: the larger, rounded up to 512


def test_requests_between_1_and_10_mib_share_20_mib_segments():
    # six 3 MiB blocks fit in 20 MiB (2 MiB left, split off since more than 1 MiB remains); the seventh does not
    assert replay([Alloc(k, 3 * MiB) for k in range(6)]).peak_reserved == 20 * MiB
    assert replay([Alloc(k, 3 * MiB) for k in range(7)]).peak_reserved == 40 * MiB


def test_large_requests_reserve_their_size_rounded_to_2_mib_and_split_only_above_1_mib():
    # 10 MiB + 1 byte -> 10 MiB + 512 -> a 12 MiB segment; 2 MiB - 512 remain (> 1 MiB): split off
    r = replay([Alloc(1, 10 * MiB + 1)])
    assert (r.peak_reserved, r.peak_allocated) == (12 * MiB, 10 * MiB + 512)
    # 11 MiB in 12 MiB leaves exactly 1 MiB: not split, the whole block is handed out and counted allocated
    r = replay([Alloc(1, 11 * MiB)])
    assert (r.peak_reserved, r.peak_allocated) == (12 * MiB, 12 * MiB)


def test_a_freed_block_is_reused_by_best_fit_not_first_fit():
    # a 16 MiB segment (lower address) and a 12 MiB one, both freed; 11 MiB takes the 12 MiB block (the
    # smallest that fits), so 15 MiB still fits the 16 MiB one: nothing new is reserved. First fit would
    # have split the 16 MiB block and reserved 16 MiB more for the 15 MiB request.
    trace = [Alloc(1, 16 * MiB), Alloc(2, 12 * MiB), Free(1), Free(2), Alloc(3, 11 * MiB), Alloc(4, 15 * MiB)]
    r = replay(trace)
    assert r.peak_reserved == 28 * MiB and r.segments == 2


def test_a_free_block_serves_only_its_own_streams_requests():
    trace = [Alloc(1, 12 * MiB, "default"), Free(1), Alloc(2, 12 * MiB, "side")]
    assert replay(trace).peak_reserved == 24 * MiB
    trace += [Alloc(3, 12 * MiB, "default")]  # the default stream's block is free again for it
    assert replay(trace).peak_reserved == 24 * MiB


def test_freed_neighbours_coalesce():
    # one 20 MiB segment: a 3, b 3, then 13 MiB takes the whole 14 MiB rest (1 MiB would remain: no split).
    # Freeing a and b leaves one 6 MiB block, which holds 5 MiB (whole: 1 MiB would remain). Two separate 3 MiB
    # blocks could not: without coalescing a second segment would be reserved.
    trace = [Alloc(1, 3 * MiB), Alloc(2, 3 * MiB), Alloc(3, 13 * MiB), Free(1), Free(2), Alloc(4, 5 * MiB)]
    r = replay(trace)
    assert (r.peak_reserved, r.segments) == (20 * MiB, 1)
    assert r.peak_allocated == 20 * MiB  # 3 + 3 + 14, then 6 + 14


def test_peaks_by_phase_start_from_what_is_held():
    trace = [Phase("a"), Alloc(1, 12 * MiB), Alloc(2, 12 * MiB), Free(2), Phase("b"), Alloc(3, 4 * MiB)]
    r = replay(trace)
    # phase b: the freed 12 MiB block serves 4 MiB (8 MiB remain: split), nothing new is reserved
    assert r.reserved_by_phase == {"a": 24 * MiB, "b": 24 * MiB}
    assert r.allocated_by_phase == {"a": 24 * MiB, "b": 16 * MiB}


def test_at_capacity_cached_segments_are_released_before_out_of_memory():
    trace = [Alloc(1, 12 * MiB), Free(1), Alloc(2, 20 * MiB)]
    assert replay(trace).peak_reserved == 32 * MiB  # unlimited: the cache keeps the 12 MiB segment
    r = replay(trace, AllocatorConfig(capacity=30 * MiB))
    assert (r.peak_reserved, r.releases, r.segments) == (20 * MiB, 1, 1)
    with pytest.raises(AllocatorOutOfMemory, match="capacity"):
        replay([Alloc(1, 12 * MiB)], AllocatorConfig(capacity=10 * MiB))


def test_expandable_segments_grow_one_segment_per_stream_by_pages():
    # 3 MiB maps one 20 MiB page; 50 MiB extends the free 17 MiB at the end by two pages: 60 MiB in all
    # (separate segments: 20 + 50 = 70 MiB)
    trace = [Alloc(1, 3 * MiB), Alloc(2, 50 * MiB)]
    assert replay(trace).peak_reserved == 70 * MiB
    r = replay(trace, AllocatorConfig(expandable_segments=True))
    assert (r.peak_reserved, r.segments) == (60 * MiB, 1)
    # another stream gets its own segment
    r = replay(trace + [Alloc(3, 3 * MiB, "side")], AllocatorConfig(expandable_segments=True))
    assert (r.peak_reserved, r.segments) == (80 * MiB, 2)


def test_an_expandable_segment_maps_nothing_when_its_free_end_already_holds_the_request():
    # 30 MiB maps two 20 MiB pages and is freed: 40 MiB free at the segment's end, still mapped. 3 MiB comes
    # from it (nothing mapped or unmapped); 3 MiB on another stream maps a page of that stream's segment
    trace = [Alloc(1, 30 * MiB), Free(1), Alloc(2, 3 * MiB), Alloc(3, 3 * MiB, "side")]
    r = replay(trace, AllocatorConfig(expandable_segments=True))
    assert (r.peak_reserved, r.segments) == (60 * MiB, 2)


@pytest.mark.parametrize("expandable", [False, True])
def test_every_reserved_byte_is_allocated_or_free_in_a_pool(expandable):
    # random requests of every size class on two streams: at every step the reserved bytes are exactly the
    # handed-out blocks plus the free blocks of the pools, and (no capacity) reservations never shrink
    import random

    from lightning_shard.simulate.allocator import CachingAllocator

    rng = random.Random(0)
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=expandable))
    live, reserved = [], 0
    for key in range(1500):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            nbytes = rng.choice([rng.randint(1, MiB), rng.randint(MiB, 10 * MiB), rng.randint(10 * MiB, 64 * MiB)])
            allocator.malloc(key, nbytes, rng.choice(["default", "side"]))
            live.append(key)
        free = sum(size for pool in allocator._free.values() for size, _, _ in pool)
        assert allocator.allocated + free == allocator.reserved >= reserved
        assert allocator.allocated >= allocator.requested
        reserved = allocator.reserved


def test_the_tracker_records_allocations_frees_and_resizes_of_its_device():
    with MemoryTracker("cpu") as mem:
        x = torch.empty(1024)
        storage = x.untyped_storage()
        storage.resize_(0)  # how FSDP frees an unsharded parameter: the block is freed ...
        storage.resize_(2048)  # ... and a new one allocated
        del x, storage
    assert mem.trace == [Phase("setup"), Alloc(1, 4096), Free(1), Alloc(2, 2048), Free(2)]


def test_a_block_used_on_another_stream_is_freed_when_its_stream_waits_for_that_one():
    with MemoryTracker("cpu") as mem:
        x = torch.empty(1024)
        mem.record_stream(x, "reduce")
        del x
        assert mem.trace[-1] == Alloc(1, 4096)  # held: the reduce stream may still use it
        mem.wait_stream("default", "reduce")
    assert mem.trace[-1] == Free(1)


def _simulate(engine=None, factory=None, **request):
    from lightning_shard.simulate.run import SimulationRequest, simulate_training
    from tests.test_simulate_ac import Net

    request = SimulationRequest(**{"devices": 2, "batch": 2, "seq_len": 8, "checkpoint": False, **request})
    return simulate_training(factory or Net, request, engine=engine)


def test_torchs_streams_are_the_ones_the_trace_records():
    # torch's FSDP2 makes its streams with torch.<device>.Stream and enters them with torch.<device>.stream
    from lightning_shard.simulate.handle import RecordingHandle, SimDeviceModule

    handle = RecordingHandle()
    module = SimDeviceModule(handle)
    with MemoryTracker("cpu", lambda: handle.current_stream().name) as mem:
        side = module.Stream(priority=-1)
        with module.stream(side):
            x = torch.empty(10)
            assert module.current_stream() is side
        y = torch.empty(10)
    assert [e for e in mem.trace if type(e) is Alloc] == [Alloc(1, 40, side.name), Alloc(2, 40, "default")]
    del x, y


@pytest.mark.slow
def test_simulated_runs_report_reserved_peaks_for_both_engines():
    from lightning_shard.simulate.reference import TORCH_ENGINE

    ours, torch_ = _simulate(), _simulate(TORCH_ENGINE)
    for report in (ours, torch_):
        assert report["peak_reserved_bytes"] >= report["peak_device_bytes"]
        assert set(report["reserved_by_phase"]) >= {"setup", "forward", "backward", "optimizer"}
    # torch's FSDP2 all-gathers on its own streams (their blocks in their own pools); ours on the current one
    assert ours["allocator_streams"] == ["default"]
    assert len(torch_["allocator_streams"]) > 1
    # a tiny model's blocks are all small: one 2 MiB segment per stream that allocates
    assert ours["peak_reserved_bytes"] == 2 * MiB
    assert torch_["peak_reserved_bytes"] == 2 * MiB * len(torch_["allocator_streams"])


@pytest.mark.slow
def test_selective_checkpointing_keeps_more_than_full_and_less_than_none_on_both_engines():
    from benchmarks.sim_models import llama_tiny
    from lightning_shard.simulate.reference import TORCH_ENGINE

    # torchtitan's policy saves aten.mm outputs: a Llama's bias-free projections (a Linear with a bias runs addmm)
    for engine in (None, TORCH_ENGINE):
        peaks = {
            ac: _simulate(engine, llama_tiny, activation_checkpointing=ac, loss="cross-entropy", batch=2,
                          seq_len=16)["peak_by_phase"]["forward"]
            for ac in (False, "full", "selective-op")
        }  # fmt: skip
        assert peaks["full"] < peaks["selective-op"] < peaks[False], peaks


def test_the_planner_simulates_what_the_simulator_can_run_and_says_what_it_cannot():
    from lightning_shard.planner import estimate
    from lightning_shard.planner.reserved import simulation_request
    from tests.test_simulate_ac import Net

    with torch.device("meta"):
        model = Net()
    common = dict(precision="bf16-mixed", batch=2, seq_len=8)
    est = estimate(model, (4, 1), activation_checkpointing="selective-op", reshard_after_forward=False, **common)
    request = simulation_request(est, **common)
    assert (request.devices, request.sharding_strategy, request.activation_checkpointing) == (
        4, "SHARD_GRAD_OP", "selective-op")  # fmt: skip
    assert request.loss == "cross-entropy"  # the planner's default loss
    with pytest.raises(ValueError, match="activation_checkpointing"):
        simulation_request(estimate(model, (2, 1), activation_checkpointing={nn.Linear}, **common), **common)
