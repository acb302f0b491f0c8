"""Every kernel variant compiles through NVRTC for sm_80 and sm_90a, without a GPU,
with no register spills and no stack frame in the compiler's report."""

import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuflash import kernel_build

ARCHS = {"sm_80": 80, "sm_90a": 90}
JOBS = [(v, arch) for arch, sm in ARCHS.items() for v in kernel_build.all_variants(sm)]


def _compile(job):
    variant, arch = job
    return kernel_build.compile_offline(variant, arch).kernels()


@pytest.fixture(scope="module")
def resource_reports():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover - a broken install, not a skip
        pytest.fail(f"NVRTC is not usable: {exc}")
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(JOBS, pool.map(_compile, JOBS)))


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"{j[0].dtype}-d{j[0].head_dim}-{j[1]}")
def test_variant_compiles_without_spills(resource_reports, job):
    kernels = resource_reports[job]
    assert set(kernels) == set(job[0].kernel_names())
    for role, info in kernels.items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (role, info)
        assert info["stack"] == 0, (role, info)
        assert 0 < info["registers"] <= 255, (role, info)


def test_variants_cover_every_dtype_and_head_dim():
    variants = kernel_build.all_variants()
    assert len(variants) == 3 * 32
    assert {v.head_dim for v in variants} == set(range(8, 257, 8))


def test_source_is_self_contained():
    """Local includes are inlined, so CuPy's cache hash covers every kernel line."""
    src = kernel_build.module_source()
    assert '#include "' not in src
    for name in ("common.cuh", "general_fwd.cuh", "general_bwd.cuh"):
        first_code_line = next(
            line for line in (kernel_build.KERNEL_DIR / name).read_text().splitlines()
            if line.startswith("template") or line.startswith("struct"))
        assert first_code_line in src


@pytest.mark.parametrize("head_dim", [8, 64, 128, 136, 256])
def test_shared_memory_fits_sm80(head_dim):
    tiles = kernel_build.Tiles(head_dim, sm=80)
    sizes = [tiles.fwd_smem(), tiles.dkdv_smem(), tiles.dq_smem()]
    if tiles.fwd_tc:
        sizes.append(tiles.fwd_tc_smem())
    if tiles.bwd_tc:
        sizes.append(tiles.bwd_tc_smem())
    if tiles.bwd_tcw:
        sizes.append(tiles.bwd_tcw_smem())
    sizes.append(tiles.fwd_tc32_smem())
    if tiles.bwd_tc32:
        sizes.append(tiles.bwd_tc32_smem())
    assert max(sizes) <= 163 * 1024


SASS_JOBS = [("bfloat16", 128, "sm_90a"), ("float16", 256, "sm_90a"), ("float32", 64, "sm_80"),
             ("float32", 128, "sm_90a"), ("bfloat16", 64, "sm_80"), ("float16", 64, "sm_90a")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, head_dim, arch", SASS_JOBS, ids=lambda x: str(x))
def test_sass_has_the_matrix_instructions(dtype, head_dim, arch):
    """The tensor-core kernels issue HMMA (mma.sync) or HGMMA (wgmma), from registers only;
    the general kernels none; the three-pass float32 backward issues three times the
    one-pass count (the three-pass forward, which sums in chunks, a multiple of three)."""
    from support import DTYPES

    variant = kernel_build.Variant(DTYPES[dtype], head_dim, ARCHS[arch])
    report = kernel_build.compile_offline(variant, arch)
    if kernel_build.find_cuobjdump() is None:
        pytest.fail("cuobjdump is missing: install the test extra (nvidia-cuda-cuobjdump)")
    try:
        opcodes = report.sass_opcodes()
    except RuntimeError as exc:  # an older cuobjdump than this NVRTC
        pytest.skip(str(exc))
    assert set(opcodes) == set(variant.kernel_names())
    for role, ops in opcodes.items():
        matrix = ops["HMMA"] + ops["HGMMA"]
        if role in ("fwd", "delta", "dkdv", "dkdv_atomic_dq", "dq", "abs_max", "split_f16"):
            assert matrix == 0, (role, matrix)
            continue
        assert ops["LDL"] == ops["STL"] == 0, (role, ops["LDL"], ops["STL"])
        if role == "fwd_wgs":  # per key tile three products each: D / 16 for S, keys / 16
            assert ops["HGMMA"] == 3 * (head_dim + variant.tiles.fwd_wgs) // 16, (role, ops)
            assert ops["HMMA"] == 0, (role, ops)
        elif role.startswith("dkdv_wgs"):  # per query tile three products each: D / 16
            # for S^T and for dP^T, 64 queries / 16 for dV or dK, and for dQ 2 key steps
            dq = 2 if role.endswith("atomic_dq") else 0
            assert ops["HGMMA"] == 3 * (2 * head_dim // 16 + 64 // 16 + dq), (role, ops)
            assert ops["HMMA"] == 0, (role, ops)
        elif role.startswith("fwd_wg"):  # per key tile: D / 16 for S, keys / 16 for P V
            keys = getattr(variant.tiles, role)[0]  # Tiles.fwd_wg or Tiles.fwd_wgp
            sites = 2 if role.endswith("p") else 1  # pipelined: S and P V each in two places
            assert ops["HGMMA"] == sites * (head_dim + keys) // 16, (role, ops)
            assert ops["HMMA"] == 0, (role, ops)
        elif role.startswith(("dkdv_wgb", "dkdv_wgd")):  # per query tile: D / 16 each for
            # S^T and dP^T, BM / 16 each for dV and dK, and for dQ 8 16-key steps: 128 keys
            # at D = 64 and 128, 64 keys in two column chunks at 256
            rows = getattr(variant.tiles, "bwd_" + role.split("_")[1])[0]
            dq = 8 if role.endswith("atomic_dq") else 0
            assert ops["HGMMA"] == 2 * head_dim // 16 + 2 * rows // 16 + dq, (role, ops)
            assert ops["HMMA"] == 0, (role, ops)
        else:
            assert ops["HMMA"] > 0 and ops["HGMMA"] == 0, (role, ops)
    if "dkdv_tc32" in opcodes:
        assert opcodes["dkdv_tc32"]["HMMA"] == 3 * opcodes["dkdv_tf32"]["HMMA"]
    if "fwd_tc32" in opcodes:
        three, one = opcodes["fwd_tc32"]["HMMA"], opcodes["fwd_tf32"]["HMMA"]
        assert three % 3 == 0 and three > one, (three, one)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_shared_memory_fits_sm90(head_dim):
    """Every Hopper kernel's shared memory within the 227 KB a block may opt into."""
    tiles = kernel_build.Tiles(head_dim, sm=90)
    sizes = [tiles.fwd_wg_smem(), tiles.fwd_wg_smem(tiles.fwd_wgp) if tiles.fwd_wgp else 0]
    sizes += [tiles.bwd_wg_smem(family) for family in ("wgb", "wgd")
              if getattr(tiles, f"bwd_{family}")]
    if tiles.fwd_wgs:
        sizes += [tiles.fwd_wgs_smem(), tiles.bwd_wgs_smem()]
    assert (tiles.fwd_wgs is None) is (tiles.bwd_wgs is None) is (head_dim == 256)
    assert 0 < max(sizes) <= 227 * 1024


def test_precompile_job_list():
    """``python -m cuflash.precompile`` compiles every role of every variant asked for."""
    from cuflash import precompile

    jobs = precompile.jobs_for(["bfloat16", "float32"], [64, 136], sm=90)
    expected = sum(len(kernel_build.Variant(precompile.DTYPES_BY_NAME[n], d, 90).kernel_names())
                   for n in ("bfloat16", "float32") for d in (64, 136))
    assert len(jobs) == expected == len(set(jobs))
    assert {role for _, role in jobs} >= {"fwd", "fwd_tc", "fwd_wg", "fwd_wgp", "fwd_tc32", "dkdv_wgb",
                                          "dkdv_tc", "dkdv_tcw", "fwd_wgs", "dkdv_wgs"}
    from cuflash import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="head_dim"):
        precompile.jobs_for(["float16"], [12], sm=80)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        precompile.jobs_for(["float64"], [64], sm=80)
