"""``perf/gpu_memory_peak_gib``, ``perf/gpu_memory_reserved_gib``, ``perf/cuda_alloc_retries``
(``asyncgrpo_cli.train.cuda_memory``)."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo_cli.train.cuda_memory import MemoryWatch


def test_a_step_reports_its_peak_the_reserve_and_the_retries_since_the_step_before():
    watch = MemoryWatch()
    first = watch.observe({"allocated_bytes.all.peak": 3 * 2**30, "reserved_bytes.all.current": 4 * 2**30,
                           "num_alloc_retries": 2})
    assert first == {"perf/gpu_memory_peak_gib": 3.0, "perf/gpu_memory_reserved_gib": 4.0,
                     "perf/cuda_alloc_retries": 2.0}
    second = watch.observe({"allocated_bytes.all.peak": 2**29, "reserved_bytes.all.current": 4 * 2**30,
                            "num_alloc_retries": 5})
    assert second["perf/cuda_alloc_retries"] == 3.0 and second["perf/gpu_memory_peak_gib"] == 0.5


def test_nothing_is_logged_off_cuda():
    assert MemoryWatch().step(torch.device("cpu")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_peak_is_the_steps_own():
    watch, device = MemoryWatch(), torch.device("cuda", torch.cuda.current_device())
    watch.step(device)
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # 256 MiB during "the step"
    del x
    got = watch.step(device)
    assert got["perf/gpu_memory_peak_gib"] >= 0.25 and got["perf/cuda_alloc_retries"] == 0
    assert watch.step(device)["perf/gpu_memory_peak_gib"] < 0.25  # reset: the next step did not hold it
