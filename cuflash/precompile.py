"""Compile kernel variants ahead of their first call, in parallel processes.

A kernel is compiled (NVRTC) on its first call and kept in CuPy's on-disk
cache, so a later process only loads it. ``python -m cuflash.precompile``
fills that cache for the current GPU, one process per CPU core, so that no
call pays the compile time: before a test run, a benchmark, or a deployment.
For example ``python -m cuflash.precompile --dtypes bfloat16 --head-dims 64,128``.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import time

from .core.problem import DTYPES_BY_NAME
from .errors import InvalidArgumentError
from .gpu import kernel_build, registry


def jobs_for(dtypes, head_dims, sm):
    """Every (variant, kernel role) of ``dtypes`` x ``head_dims`` for tile generation ``sm``."""
    for name in dtypes:
        if name not in DTYPES_BY_NAME:
            raise InvalidArgumentError(
                "dtypes", f"unknown dtype {name!r}; expected one of {sorted(DTYPES_BY_NAME)}"
            )
    for d in head_dims:
        if d not in kernel_build.HEAD_DIMS:
            raise InvalidArgumentError(
                "head_dims", f"unsupported head_dim {d}: must be a multiple of 8 from 8 to 256"
            )
    return [
        (kernel_build.Variant(DTYPES_BY_NAME[name], d, sm), role)
        for name in dtypes
        for d in head_dims
        for role in kernel_build.Variant(DTYPES_BY_NAME[name], d, sm).kernel_names()
    ]


def _compile(job):
    variant, role = job
    start = time.perf_counter()
    kernel_build.load(variant).kernel(role)
    return time.perf_counter() - start


def precompile(dtypes=tuple(DTYPES_BY_NAME), head_dims=kernel_build.HEAD_DIMS, processes=None):
    """Compile every kernel of ``dtypes`` x ``head_dims`` for the current GPU.

    Parameters
    ----------
    dtypes : sequence of {"float32", "float16", "bfloat16"}
    head_dims : sequence of int
        Multiples of 8 from 8 to 256.
    processes : int, optional
        Worker processes (each holds its own CUDA context); default: the CPU count.

    Returns
    -------
    count : int
        Kernels compiled or found in the cache.
    seconds : float
        The summed time of the workers (the wall time is about this divided
        by ``processes``).
    """
    import cupy

    sm = kernel_build.generation(int(cupy.cuda.Device().compute_capability))
    jobs = jobs_for(dtypes, head_dims, sm)
    processes = processes or os.cpu_count() or 1
    context = multiprocessing.get_context("spawn")  # CUDA contexts do not survive fork
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        times = list(pool.map(_compile, jobs))
    return len(jobs), sum(times)


def modifier_jobs(
    dtypes,
    head_dims,
    sm,
    compute_capability,
    directions=("forward", "backward"),
    mask_only=False,
):
    """The (variant, role) pairs that calls with user modifiers of ``dtypes`` x
    ``head_dims`` launch on a GPU of ``compute_capability``: the dispatch's modified
    forward, its modified backward (atomic, where it adds dQ so, and not) and its dQ
    pass; ``mask_only``: for a user's mask alone."""
    jobs = []
    for name in dtypes:
        dtype = DTYPES_BY_NAME[name]
        for d in head_dims:
            variant = kernel_build.Variant(dtype, d, sm)
            for direction in directions:
                spec = registry.choose(
                    direction, dtype, d, compute_capability, modified=True, mask_only=mask_only
                )
                if direction == "forward":
                    jobs.append((variant, spec.role(modified=True)))
                else:
                    dq_pass = spec.dq_pass()
                    jobs += [
                        (variant, spec.role(modified=True)),
                        (variant, dq_pass.role(modified=True)),
                    ]
                    if spec.atomic_dq(d):
                        jobs.append((variant, spec.role(atomic_dq=True, modified=True)))
    return jobs


def precompile_modifiers(
    score_mod=None,
    mask_mod=None,
    dtypes=("bfloat16",),
    head_dims=(128,),
    built_ins=False,
    threads=None,
    directions=("forward", "backward"),
):
    """Compile the kernels that calls with these user modifiers (``cuflash.modifiers``)
    launch, for the current GPU, in parallel threads (NVRTC runs without the GIL): a
    modifier's kernels are compiled on its first call otherwise. Kernels are shared by
    every modifier of the same code (whatever arrays it reads). ``built_ins``: for calls
    that also pass ``softcap`` or ``alibi_slopes``. Returns the number of kernels."""
    import cupy

    functors = kernel_build.UserFunctors.of(score_mod, mask_mod, built_ins)
    if functors is None:
        return 0
    capability = int(cupy.cuda.Device().compute_capability)
    jobs = modifier_jobs(
        dtypes,
        head_dims,
        kernel_build.generation(capability),
        capability,
        directions,
        mask_only=functors.key[-1],
    )
    device = cupy.cuda.Device().id

    def compile_one(job):
        variant, role = job
        with cupy.cuda.Device(device):
            kernel_build.load(variant).kernel(role, functors)

    with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, jobs))
    return len(jobs)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cuflash.precompile", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--dtypes",
        default=",".join(DTYPES_BY_NAME),
        help="comma-separated dtypes (default: all three)",
    )
    parser.add_argument(
        "--head-dims",
        default="64,128,256",
        help="comma-separated head dims, or 'all' (default: 64,128,256)",
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="worker processes (default: the CPU count)"
    )
    args = parser.parse_args(argv)
    head_dims = (
        kernel_build.HEAD_DIMS
        if args.head_dims == "all"
        else [int(x) for x in args.head_dims.split(",")]
    )
    start = time.perf_counter()
    count, busy = precompile(args.dtypes.split(","), head_dims, args.processes)
    print(
        f"{count} kernels ready in {time.perf_counter() - start:.1f} s "
        f"({busy:.1f} s of compile and load across the workers)"
    )


if __name__ == "__main__":
    main()
