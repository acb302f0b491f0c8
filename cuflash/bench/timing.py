"""GPU timing: CUDA events around calls rotating among input sets, the median of many,
and the run's wall-clock budget shared out among its measurements."""

import dataclasses
import math
import statistics
import time

import numpy as np

from .environment import cupy

TARGET_SECONDS = 0.2  # timed calls per measurement, before the time budget shrinks it
QUICK_TARGET_SECONDS = 0.05
MIN_TARGET_SECONDS = 0.02
MIN_REPEATS = 5
MAX_REPEATS = 100
BUDGET_OVERHEAD = 4  # warm-up, sizing round and agreement check, per timed second


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of each timed call of one measurement."""

    samples: tuple

    @property
    def median(self):
        return statistics.median(self.samples)

    def summary(self):
        """Median, quartiles, minimum (seconds) and the number of calls."""
        p25, _, p75 = np.percentile(self.samples, (25, 50, 75))
        return {
            "median_s": self.median,
            "p25_s": float(p25),
            "p75_s": float(p75),
            "min_s": min(self.samples),
            "repeats": len(self.samples),
        }


def event_times(calls, count):
    """Run ``count`` calls, rotating through ``calls``, each between two CUDA events.

    Nothing synchronizes between calls, so the GPU runs them back to back
    whenever the host enqueues faster than the GPU computes.

    Returns
    -------
    list of float
        Seconds of GPU time of each call.
    """
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(count)]
    for index, (start, end) in enumerate(events):
        start.record()
        calls[index % len(calls)]()
        end.record()
    events[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(start, end) / 1e3 for start, end in events]


WARM_UP_SECONDS = 2.0  # of steady GPU work before a run's first measurement


def warm_up_gpu(seconds=WARM_UP_SECONDS):
    """Keep the GPU busy for ``seconds`` (float32 matrix products) before the first
    measurement: on a machine just started, the first decode cases of a run timed 2-3x
    slow for every implementation, torch's included, and a second run in the same call
    did not (an H100 and an H200, 2026-12-06)."""
    a = cupy.ones((4096, 4096), dtype=np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a = a @ a
            a *= np.float32(1.0 / 4096)
        cupy.cuda.get_current_stream().synchronize()
    del a
    cupy.get_default_memory_pool().free_all_blocks()


def time_calls(calls, target_seconds):
    """Time ``calls`` (one per input set) in rotation on CuPy's current stream.

    Each call runs once to warm up (compilation, plans, allocator), one
    round is timed to size the run, then enough calls to fill
    ``target_seconds`` (clipped to ``MIN_REPEATS .. MAX_REPEATS``) are timed.
    """
    for call in calls:
        call()
    per_call = statistics.median(event_times(calls, len(calls)))
    repeats = int(
        np.clip(math.ceil(target_seconds / max(per_call, 1e-9)), MIN_REPEATS, MAX_REPEATS)
    )
    return Timing(tuple(event_times(calls, repeats)))


class Budget:
    """The wall-clock time left to the run, shared out among its measurements."""

    def __init__(self, seconds, target_seconds):
        self.deadline = time.monotonic() + seconds
        self.target_seconds = target_seconds

    def remaining(self):
        return self.deadline - time.monotonic()

    def target_for(self, measurements_left):
        """Seconds of timed calls for the next measurement."""
        share = self.remaining() / max(1, measurements_left) / BUDGET_OVERHEAD
        return float(np.clip(share, MIN_TARGET_SECONDS, self.target_seconds))
