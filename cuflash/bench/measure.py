"""Measuring: an implementation's forward and backward timed on shared input sets, its
output checked against cuflash's, any failure kept as a one-line note."""

import dataclasses
import warnings

import numpy as np

from .cases import DIRECTIONS, Case, make_input_sets, rotation_count, tflops
from .environment import cupy
from .implementations import CuflashAttention
from .progress import print_status, progress_bar
from .timing import Timing, time_calls

MAX_NOTE_CHARS = 300


@dataclasses.dataclass
class Measurement:
    """One implementation, case and direction: its timing, or why there is none."""

    case: Case
    impl: str
    direction: str
    timing: Timing | None = None
    note: str = ""
    rel_error: float | None = None  # relative L2 distance of the forward output from cuflash's

    @property
    def seconds(self):
        return None if self.timing is None else self.timing.median

    @property
    def tflops(self):
        return (
            None if self.timing is None else tflops(self.case.flops(self.direction), self.seconds)
        )

    def to_dict(self):
        """A JSON-ready record."""
        record = {
            "impl": self.impl,
            "direction": self.direction,
            **dataclasses.asdict(self.case),
            "flops": self.case.flops(self.direction),
            "tflops": self.tflops,
            "note": self.note,
            "rel_error": self.rel_error,
        }
        if self.timing is not None:
            record.update(self.timing.summary())
        return record

    @classmethod
    def from_dict(cls, record):
        """The measurement of a :meth:`to_dict` record, its timing reduced to the median."""
        case = Case(
            record["dtype"],
            record["head_dim"],
            record["seqlen"],
            record["causal"],
            record["batch"],
            record["heads"],
        )
        median = record.get("median_s")
        return cls(
            case,
            record["impl"],
            record["direction"],
            None if median is None else Timing((median,)),
            record["note"],
            record["rel_error"],
        )


def first_line(text):
    """The first line of ``text`` (an exception's message, say), stripped."""
    return (str(text).strip().splitlines() or [""])[0]


def failure_reason(exc, caught_warnings):
    """A one-line reason for a failed run: "OOM", or the warnings and the error."""
    if "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower():
        return "OOM"
    lines = [first_line(w.message) for w in caught_warnings]
    lines.append(f"{type(exc).__name__}: {first_line(exc)}")
    return "; ".join(dict.fromkeys(lines))[:MAX_NOTE_CHARS]


def run_or_reason(impl, work):
    """``(work(), "")`` run inside ``impl.context()``, or ``(None, reason)`` when it raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with impl.context():
                return work(), ""
        except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
            return None, failure_reason(exc, caught)


def measure_direction(impl, direction, input_sets, target_seconds):
    """Time ``impl`` in ``direction`` over ``input_sets``; a failure becomes a note."""
    make_call = impl.forward_call if direction == "fwd" else impl.backward_call
    timing, note = run_or_reason(
        impl, lambda: time_calls([make_call(x) for x in input_sets], target_seconds)
    )
    return Measurement(impl.case, impl.name, direction, timing=timing, note=note)


def forward_output(impl, x):
    """The forward output of ``impl`` on ``x`` as a CuPy array."""
    with impl.context():
        out = impl.forward_call(x)()
    return out if isinstance(out, cupy.ndarray) else cupy.from_dlpack(out.detach())


def relative_error(out, reference):
    """``||out - reference|| / ||reference||`` in float32."""
    out, reference = out.astype(np.float32), reference.astype(np.float32)
    return float(cupy.linalg.norm(out - reference) / cupy.linalg.norm(reference))


def agreement(impl, x, reference):
    """Relative distance of ``impl``'s forward output on ``x`` from ``reference``.

    Returns None, and says why on stderr, if the extra forward call fails.
    """
    try:
        return relative_error(forward_output(impl, x), reference)
    except Exception as exc:  # noqa: BLE001 - the timing stands without the check
        print_status(f"{impl.name} {impl.case}: no agreement check: {failure_reason(exc, [])}")
        return None


def free_memory(torch):
    """Return cached blocks of CuPy's pool (and torch's allocator) to the driver."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def measure_implementation(impl, input_sets, target_seconds, reference):
    """Forward and backward Measurements of ``impl``, the forward checked against ``reference``."""
    fwd = measure_direction(impl, "fwd", input_sets, target_seconds)
    if fwd.timing is not None and reference is not None:
        fwd.rel_error = agreement(impl, input_sets[0], reference)
    if not impl.has_backward:
        bwd = Measurement(impl.case, impl.name, "bwd", note="forward only")
    elif fwd.timing is None:
        bwd = Measurement(impl.case, impl.name, "bwd", note=fwd.note)
    else:
        bwd = measure_direction(impl, "bwd", input_sets, target_seconds)
    return [fwd, bwd]


def skipped(impl, note):
    """Measurements of both directions of ``impl`` that did not run."""
    return [Measurement(impl.case, impl.name, d, note=note) for d in DIRECTIONS]


def measure_case(case, factories, budget, measurements_left, l2_bytes, torch):
    """Every implementation on shared input sets of ``case``."""
    input_sets = make_input_sets(case, rotation_count(case, l2_bytes))
    results, reference = [], None
    for index, make in enumerate(factories):
        impl = make(case)
        if budget.remaining() <= 0:
            results += skipped(impl, "time budget exhausted")
            continue
        target = budget.target_for(measurements_left - 2 * index)
        fwd, bwd = measure_implementation(impl, input_sets, target, reference)
        results += [fwd, bwd]
        if impl.name == CuflashAttention.name and fwd.timing is not None:
            reference = forward_output(impl, input_sets[0])
        free_memory(torch)
    return results


def run_grid(cases, factories_for, budget, l2_bytes, torch):
    """Measurements of every case, with a progress bar on stderr.

    ``factories_for(case)`` gives the implementations' constructors for a case.
    """
    measurements = []
    bar = progress_bar(len(cases), "cases")
    measurements_per_case = [2 * len(factories_for(case)) for case in cases]
    for index, case in enumerate(cases):
        bar.set_postfix_str(f"{case.dtype} D={case.head_dim} S={case.seqlen} causal={case.causal}")
        factories = factories_for(case)
        left = sum(measurements_per_case[index:])
        if budget.remaining() <= 0:
            measurements += [
                m for make in factories for m in skipped(make(case), "time budget exhausted")
            ]
        else:
            measurements += measure_case(case, factories, budget, left, l2_bytes, torch)
        free_memory(torch)
        bar.update(1)
    bar.close()
    return measurements
