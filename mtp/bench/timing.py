"""Wall-clock and memory measurement shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from mtp.util.environment import current_rss  # the one reader of a process's memory

__all__ = ["current_rss", "interleaved_median_ms", "median_ms", "peak_rss", "reset_peak_rss",
           "sync"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of `fn` in milliseconds, synchronising CUDA around each call."""
    return interleaved_median_ms([fn], device, warmup, reps)[0]


def interleaved_median_ms(fns: list[Callable[[], object]], device: torch.device, warmup: int,
                          reps: int) -> list[float]:
    """Median wall time of each of `fns` in milliseconds, the calls alternating between them."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            t.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def reset_peak_rss() -> None:
    """Reset this process's peak resident set size (VmHWM; Linux: 5 into clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """Peak bytes resident since the start or the last `reset_peak_rss` (Linux)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM"))
    return int(line.split()[1]) * 1024
