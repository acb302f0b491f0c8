"""Every kernel variant compiles through NVRTC for sm_80 and sm_90a, without a GPU,
with no register spills, no stack frame and no serialized wgmma in the compiler's
report (each tile class at its two ends, :func:`class_ends`)."""

import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from cuflash import AttentionConfig
from cuflash.gpu import kernel_build, registry, standalone, tile_traits

ARCHS = {"sm_80": 80, "sm_90a": 90}


def class_ends(variants):
    """The smallest and largest head_dim of each run of variants whose kernels share
    their tile traits (tile, threads, template arguments): the largest holds the most
    fragments in registers, so it spills first, and the smallest takes the narrowest
    paths. CUFLASH_COMPILE_EVERY_HEAD_DIM=1 compiles every head_dim instead."""
    if os.environ.get("CUFLASH_COMPILE_EVERY_HEAD_DIM"):
        return list(variants)
    runs = {}
    for v in variants:
        key = (str(v.dtype), v.head_dim_v) + tuple(
            (role, t.tile, t.threads, t.template_args)
            for role, t in ((r, v.traits(r)) for r in v.kernel_names())
            if not role.endswith(registry.FP8)  # every other head dim: FP8_JOBS
        )
        runs.setdefault(key, []).append(v)
    ends = {id(v) for run in runs.values() for v in (run[0], run[-1])}
    return [v for v in variants if id(v) in ends]


JOBS = [(v, arch) for arch, sm in ARCHS.items() for v in class_ends(kernel_build.all_variants(sm))]
# The FP8 roles (multiples of 16 only) at their tiles' ends: the smallest of the 64
# class, the last with three consumers (96), the 128 class's (three stages) and the 256
# class's (two), in both output types.
FP8_JOBS = [
    ("bfloat16", 16),
    ("float16", 96),
    ("bfloat16", 128),
    ("float16", 144),
    ("bfloat16", 256),
]


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
        assert not info["wgmma_serialized"], (role, info)
        if "_wgmma_ws" in role:
            # setmaxnreg moves registers within the block's launch allocation (this
            # count times the block's threads: 168 at 384, 128 at 512); the kernels'
            # static_asserts hold their splits to it, and asking for more waits
            # forever on a GPU.
            threads = job[0].traits(role).threads
            assert info["registers"] == 65536 // threads // 8 * 8, (role, info)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float16", 96)])
def test_176_key_forward_tiles_compile_without_spills(dtype, head_dim, monkeypatch):
    """forward_wgmma_ws's plain roles on 176-key tiles (``CUFLASH_FORWARD_KEYS=176``):
    no spills, its wgmma not serialized, the producer's wider split (32 / 232)."""
    from support import DTYPES

    monkeypatch.setenv("CUFLASH_FORWARD_KEYS", "176")
    variant = kernel_build.Variant(DTYPES[dtype], head_dim, 90)
    roles = ["forward_wgmma_ws", "forward_wgmma_ws_persistent"]
    assert all(variant.traits(r).template_args[:2] == (176, 2) for r in roles)
    # the variants' names are cached for the process: none of these may outlive the test
    kernel_build.Variant.kernel_names.cache_clear()
    try:
        assert ", 176, 2, 2, " in variant.kernel_names()["forward_wgmma_ws"]
        report = kernel_build.compile_offline(variant, "sm_90a", roles)
    finally:
        kernel_build.Variant.kernel_names.cache_clear()
    for role, info in report.kernels().items():
        assert info["spill_stores"] == info["spill_loads"] == info["stack"] == 0, (role, info)
        assert not info["wgmma_serialized"], (role, info)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, head_dim", FP8_JOBS, ids=str)
def test_fp8_roles_compile_without_spills(dtype, head_dim):
    """forward_wgmma_ws's FP8 role: no spills, stack frame or serialized wgmma, the
    warpgroups' register split as the 16-bit roles' (class_ends leaves it out)."""
    from support import DTYPES

    variant = kernel_build.Variant(DTYPES[dtype], head_dim, 90)
    role = "forward_wgmma_ws" + registry.FP8
    info = kernel_build.compile_offline(variant, "sm_90a", [role]).kernels()[role]
    assert info["spill_stores"] == info["spill_loads"] == info["stack"] == 0, info
    assert not info["wgmma_serialized"], info
    assert info["registers"] == 65536 // variant.traits(role).threads // 8 * 8, info


def test_serialized_wgmma_advisories_are_read():
    """Both of ptxas's advisories that it serialized a kernel's wgmma (C7519, C7512: every
    wgmma then waits for the one before, which the register counts do not show) mark the
    kernel; a kernel the log does not name stays unmarked."""
    log = "\n".join(
        [
            "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions"
            " are serialized due to insufficient register resources for the function 'k_a'",
            "ptxas info    : (C7519) Potential Performance Loss: wgmma.mma_async instructions"
            " are serialized due to the presence of Extern calls in the function 'k_b'",
        ]
        + [
            line
            for name in ("k_a", "k_b", "k_c")
            for line in (
                f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'",
                "ptxas info    : Used 168 registers",
                "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
            )
        ]
    )
    variant = kernel_build.Variant(np.dtype(np.float16), 128, 90)
    report = kernel_build.CompileReport(
        variant, "sm_90a", log, b"", {"a": "k_a", "b": "k_b", "c": "k_c"}
    )
    marked = {role: info["wgmma_serialized"] for role, info in report.kernels().items()}
    assert marked == {"a": True, "b": True, "c": False}


def test_called_functions_do_not_hide_the_kernels_spills():
    """ptxas lists a called (``__noinline__``) function's properties after its kernel's:
    the kernel keeps its own stack frame and spills, not the callee's."""
    log = "\n".join(
        [
            "ptxas info    : Compiling entry function 'k_a' for 'sm_90a'",
            "ptxas info    : Function properties for k_a",
            "ptxas         .     96 bytes stack frame, 120 bytes spill stores,"
            " 128 bytes spill loads",
            "ptxas info    : Used 168 registers, used 2 barriers, 96 bytes cumulative stack size",
            "ptxas info    : Function properties for callee_f",
            "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
            "ptxas info    : Compiling entry function 'k_b' for 'sm_90a'",
            "ptxas info    : Function properties for k_b",
            "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
            "ptxas info    : Used 128 registers, used 1 barriers",
        ]
    )
    variant = kernel_build.Variant(np.dtype(np.float16), 128, 90)
    report = kernel_build.CompileReport(variant, "sm_90a", log, b"", {"a": "k_a", "b": "k_b"})
    info = report.kernels()
    assert (info["a"]["stack"], info["a"]["spill_stores"], info["a"]["spill_loads"]) == (
        96,
        120,
        128,
    )
    assert info["a"]["registers"] == 168
    assert (info["b"]["spill_stores"], info["b"]["registers"]) == (0, 128)


def test_variants_cover_every_dtype_and_head_dim():
    variants = kernel_build.all_variants()
    assert len(variants) == 3 * 32
    assert {v.head_dim for v in variants} == set(range(8, 257, 8))


def test_source_is_self_contained():
    """Local includes are inlined, so CuPy's cache hash covers every kernel line."""
    src = kernel_build.module_source()
    assert '#include "' not in src
    for name in ("common/common.cuh", "simt/forward_general.cuh", "simt/backward_dq_general.cuh"):
        first_code_line = next(
            line
            for line in (kernel_build.KERNEL_DIR / name).read_text().splitlines()
            if line.startswith("template") or line.startswith("struct")
        )
        assert first_code_line in src


@pytest.mark.parametrize("sm, limit_kb", [(80, 163), (90, 227)])
def test_shared_memory_fits(sm, limit_kb):
    """Every kernel's shared memory, at every head_dim it serves, within what a block may
    opt into on that generation (sm_80: 163 KB; sm_90: 227 KB)."""
    for variant in kernel_build.all_variants(sm):
        for role in variant.kernel_names():
            assert variant.traits(role).shared_bytes <= limit_kb * 1024, (variant, role)


def test_every_head_dim_has_tensor_core_kernels():
    """16-bit calls have a tensor-core forward and backward at every head_dim on both
    generations; float32 has the float16-pieces kernels at every head_dim on Hopper, TF32
    ones with allow_tf32 (the backward up to 128)."""
    for dtype in registry.SIXTEEN_BIT_DTYPES:
        for d in kernel_build.HEAD_DIMS:
            for capability in (80, 86, 90):
                for direction in ("forward", "backward"):
                    spec = registry.choose(direction, dtype, d, capability)
                    assert spec.instruction == ("wgmma" if capability == 90 else "mma.sync")
    for d in kernel_build.HEAD_DIMS:
        for direction in ("forward", "backward"):
            spec = registry.choose(direction, np.float32, d, 90)
            assert spec.precision == "float32" and spec.instruction == "wgmma", (d, spec.name)
            tf32 = registry.choose(direction, np.float32, d, 80, allow_tf32=True)
            assert tf32.precision == ("tf32" if direction == "forward" or d <= 128 else "any")
    with pytest.raises(LookupError):
        registry.choose("forward", np.float64, 64, 90)


def test_every_chosen_kernel_is_in_its_variant():
    """The roles the dispatch can choose for calls without modifiers are compiled in the
    variant the GPU path loads (forward_wgmma only up to D = 64)."""
    for dtype in registry.SIXTEEN_BIT_DTYPES + (np.dtype(np.float32),):
        for head_dim in kernel_build.HEAD_DIMS:
            for capability in (80, 90):
                names = kernel_build.Variant(
                    dtype, head_dim, registry.generation(capability)
                ).kernel_names()
                for direction in ("forward", "backward"):
                    for tensor_cores in (True, False):
                        for keys in (None, 100):
                            spec = registry.choose(
                                direction,
                                dtype,
                                head_dim,
                                capability,
                                tensor_cores=tensor_cores,
                                keys_a_row_sees=keys,
                            )
                            assert spec.role() in names, (spec.name, dtype, head_dim)
    bf16 = registry.SIXTEEN_BIT_DTYPES[-1]
    small, large = (kernel_build.Variant(bf16, d, 90).kernel_names() for d in (64, 72))
    assert {"forward_wgmma_ws", "forward_wgmma_ws_modified"} <= set(small) & set(large)
    assert "forward_wgmma" in small and "forward_wgmma" not in large


def test_dispatch_order():
    bf16 = registry.SIXTEEN_BIT_DTYPES[-1]
    assert registry.choose("forward", bf16, 64, 90, tensor_cores=False).name == "forward_general"
    # the warp-specialized forward for every call but the short plain ones up to D = 64
    # (rows that see fewer than 768 keys on average), which take forward_wgmma at two
    # blocks an SM where it is not skipped
    for head_dim in (8, 32, 64, 72, 96, 128, 200, 256):
        assert registry.choose("forward", bf16, head_dim, 90).name == "forward_wgmma_ws"
        long = registry.choose("forward", bf16, head_dim, 90, keys_a_row_sees=768)
        assert long.name == "forward_wgmma_ws"
        short = registry.choose("forward", bf16, head_dim, 90, keys_a_row_sees=767.5)
        assert short.name == ("forward_wgmma" if head_dim <= 64 else "forward_wgmma_ws")
        short_modified = registry.choose(
            "forward", bf16, head_dim, 90, modified=True, keys_a_row_sees=10
        )
        assert short_modified.name == "forward_wgmma_ws"
    for head_dim in (8, 64):
        no_wgmma = frozenset({"forward_wgmma"})
        assert (
            registry.choose("forward", bf16, head_dim, 90, excluded=no_wgmma, keys_a_row_sees=10)
        ).name == "forward_wgmma_ws"
    for head_dim in (8, 64, 128, 256):
        assert (
            registry.choose("forward", bf16, head_dim, 90, modified=True).name == "forward_wgmma_ws"
        )
    # its plain calls whose rows see fewer than 2560 keys on average run its persistent
    # role (a block an SM), the others and every modified call a block a tile
    ws = registry.BY_NAME["forward_wgmma_ws"]
    assert ws.persists(False, 2559.5) and not ws.persists(False, 2560)
    assert not ws.persists(True, 10) and not ws.persists(False, None)
    assert not registry.BY_NAME["forward_wgmma"].persists(False, 10)
    assert ws.role(persistent=True) == "forward_wgmma_ws_persistent" in ws.roles()
    assert ws.name_expression("forward_wgmma_ws_persistent", bf16, 128).endswith(", false, true>")
    assert ws.name_expression("forward_wgmma_ws", bf16, 128).endswith(", false, false>")
    # the warp-specialized backward's persistent roles: compiled, chosen only by
    # CUFLASH_PERSISTENT=1 until a GPU run sets their line
    ws_bwd = registry.BY_NAME["backward_wgmma_ws"]
    assert ws_bwd.persistent_keys == 0 and not ws_bwd.persists(False, 1)
    persistent = ws_bwd.role(atomic_dq=True, persistent=True)
    assert persistent == "backward_wgmma_ws_atomic_dq_persistent" in ws_bwd.roles(128)
    # (ATOMIC_DQ, MODIFIED, PERSISTENT, ORDERED_DQ)
    assert ws_bwd.name_expression(persistent, bf16, 128).endswith(", true, false, true, false>")
    plain = ws_bwd.name_expression("backward_wgmma_ws", bf16, 128)
    assert plain.endswith(", false, false, false, false>")
    # and its ordered dQ (deterministic calls through the maps): dQ added as the atomic
    # role adds it, a block a tile
    ordered = ws_bwd.role(ordered_dq=True)
    assert ordered == "backward_wgmma_ws_ordered_dq" in ws_bwd.roles(128)
    assert ordered not in ws_bwd.roles(256)  # the 256 class: the dQ pass, faster there
    assert ws_bwd.name_expression(ordered, bf16, 128).endswith(", true, false, false, true>")
    assert registry.adds_dq(ordered) and not registry.adds_dq("backward_wgmma_ws")
    # and its roles for a user's mask alone: in modules compiled mask-only, a block a tile
    masked = ws_bwd.role(atomic_dq=True, modified=True)
    assert masked in ws_bwd.roles(128, with_masks=True) and masked not in ws_bwd.roles(128)
    assert ws_bwd.name_expression(masked, bf16, 128).endswith(", true, true, false, false>")
    for head_dim in (8, 64, 128, 136, 256):
        chosen = registry.choose("backward", bf16, head_dim, 90, modified=True, mask_only=True)
        assert chosen is ws_bwd
    assert registry.choose("backward", bf16, 256, 90, modified=True) is not ws_bwd
    assert registry.choose("backward", bf16, 64, 80).name == "backward_mma_sync"
    assert registry.choose("backward", bf16, 72, 80).name == "backward_mma_sync_split_d"
    skipped = {"forward_wgmma_ws", "forward_wgmma"}
    assert registry.choose("forward", bf16, 64, 90, excluded=skipped).name == "forward_mma_sync"


def test_dq_passes():
    """The Hopper 16-bit backwards add dQ by atomics (the warp-specialized one at every
    head dim, past 128 through the maps only; backward_wgmma up to 128) and take their
    wgmma dQ pass otherwise and for deterministic calls; before Hopper the
    16-bit backwards add dQ by atomics and their deterministic calls take the mma.sync dQ
    pass; the variants hold exactly the roles those paths launch."""
    bf16 = registry.SIXTEEN_BIT_DTYPES[-1]
    spec = registry.choose("backward", bf16, 128, 90)
    assert spec.name == "backward_wgmma_ws" and spec.dq_kernel == "backward_dq_wgmma"
    assert spec.atomic_dq(64) and spec.atomic_dq(128) and spec.atomic_dq(256)
    assert spec.atomic_dq_needs_maps(136) and not spec.atomic_dq_needs_maps(128)
    for head_dim in (8, 136, 256):
        assert registry.choose("backward", bf16, head_dim, 90).name == "backward_wgmma_ws"
    skipped = {"backward_wgmma_ws"}
    assert registry.choose("backward", bf16, 128, 90, excluded=skipped).name == "backward_wgmma"
    # the calls the warp-specialized backward leaves: score modifiers
    for head_dim, modified in ((64, True), (128, True), (256, True)):
        spec = registry.choose("backward", bf16, head_dim, 90, modified=modified)
        assert spec.name == "backward_wgmma" and spec.dq_kernel == "backward_dq_wgmma"
    assert spec.atomic_dq(128) and not spec.atomic_dq(136) and not spec.atomic_dq(256)
    for head_dim, atomic in ((64, True), (128, True), (136, False), (192, False)):
        roles = kernel_build.Variant(bf16, head_dim, 90).kernel_names()
        assert ("backward_wgmma_atomic_dq" in roles) == atomic, head_dim
        assert {"backward_wgmma", "backward_dq_wgmma", "backward_dq_wgmma_modified"} <= set(roles)
    for head_dim in (64, 72, 128, 256):
        spec = registry.choose("backward", bf16, head_dim, 80)
        assert spec.dq_kernel == "backward_dq_mma_sync" and spec.atomic_dq(head_dim)
        roles = kernel_build.Variant(bf16, head_dim, 80).kernel_names()
        assert {"backward_dq_mma_sync", "backward_dq_mma_sync_modified"} <= set(roles)
    # float32 (and a modified call past the mma.sync backward's head dims: the general
    # backward) take the CUDA-core dQ pass
    assert registry.choose("backward", np.dtype(np.float32), 64, 90).dq_kernel is None
    assert registry.choose("backward", bf16, 72, 80, modified=True).dq_kernel is None
    wide = registry.choose("backward", np.dtype(np.float32), 200, 90)
    assert wide.dq_kernel == "backward_dq_float32_pieces_wide" and not wide.atomic_dq(200)


SASS_JOBS = [
    ("bfloat16", 128, "sm_90a"),
    ("float16", 256, "sm_90a"),
    ("float32", 64, "sm_80"),
    ("float32", 128, "sm_90a"),
    ("bfloat16", 64, "sm_80"),
    ("float16", 64, "sm_90a"),
    ("bfloat16", 80, "sm_90a"),
    ("float16", 40, "sm_80"),
    ("bfloat16", 200, "sm_90a"),
    ("float32", 96, "sm_90a"),
    ("float16", 152, "sm_80"),
    ("float32", 200, "sm_90a"),
    ("float16", 192, "sm_90a"),
]


def expected_hgmma(role, head_dim):
    """The HGMMA instructions a wgmma kernel issues (each k16 step of each product once
    in the code; the warp-specialized forward issues S and P V in two places)."""
    spec = registry.BY_ROLE[role]
    fp8 = role.endswith(registry.FP8)
    traits = spec.traits_of(head_dim, role.endswith(registry.MODIFIED), fp8)
    if fp8:  # QGMMA: k32 steps over the head_dim and the keys, S and P V in two places
        return 2 * (-(-head_dim // 32) + traits.template_args[0] // 32)
    steps = -(-head_dim // 16)  # k16 steps over the head_dim, its exact width
    width = tile_traits.head_dim_class(head_dim)
    if spec.name.startswith("forward_wgmma"):
        keys = traits.template_args[0]
        return (2 if spec.name == "forward_wgmma_ws" else 1) * (steps + keys // 16)
    if spec.name == "forward_float32_pieces":  # three products each, on the class's width
        return 3 * (width + traits.template_args[0]) // 16
    if spec.name == "forward_float32_pieces_wide":  # a warpgroup's half of the steps of S
        return 3 * ((steps + 1) // 2 + 64 // 16)  # and P V over a 64-key tile
    if spec.name in ("backward_float32_pieces_wide", "backward_dq_float32_pieces_wide"):
        # S^T and dP^T (S and dP) over the exact steps in one code path; dV or dK over
        # the head dim's 64-column chunks (dQ: a warpgroup's two), 2 k16 steps each
        chunks = -(-head_dim // 64) if spec.direction == "backward" else 2
        return 3 * (steps + 2 * chunks)
    if spec.name == "backward_dq_wgmma":  # S and dP over the head_dim, dQ over the keys
        return 2 * steps + traits.template_args[0] // 16
    if spec.name == "backward_float32_pieces":  # S^T, dP^T: width / 16; dV or dK: 64 / 16;
        dq = 2 if registry.ATOMIC_DQ in role else 0  # dQ: 2 key steps
        return 3 * (2 * width // 16 + 64 // 16 + dq)
    if spec.name == "backward_wgmma_ws" and width == 256:
        # a copy of the step a consumer (its columns compiled in): S^T and dP^T over the
        # head_dim, dV and dK over the query rows, dQ (atomic, ordered) over 64 keys
        rows = traits.template_args[0]
        return 2 * (2 * steps + 2 * rows // 16 + (4 if registry.adds_dq(role) else 0))
    # backward_wgmma: S^T and dP^T over the head_dim, dV and dK over the query rows,
    # dQ (atomic, up to D = 128) in 8 16-key steps; in the 256 class below 256 columns
    # a copy of the loop a warpgroup
    rows = traits.template_args[0]
    dq = 8 if registry.adds_dq(role) else 0
    copies = 2 if width == 256 and 16 * steps < 256 else 1
    return copies * (2 * steps + 2 * rows // 16) + dq


@pytest.mark.slow
@pytest.mark.parametrize("dtype, head_dim, arch", SASS_JOBS, ids=lambda x: str(x))
def test_sass_has_the_matrix_instructions(dtype, head_dim, arch):
    """The tensor-core kernels issue HMMA (mma.sync) or HGMMA (wgmma) as the registry says,
    from registers only (no local memory); the CUDA-core kernels none."""
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
        spec = registry.BY_ROLE[role]
        matrix = ops["HMMA"] + ops["HGMMA"]
        if spec.instruction == "cuda cores":
            assert matrix == 0, (role, matrix)
            continue
        assert ops["LDL"] == ops["STL"] == 0, (role, ops["LDL"], ops["STL"])
        if role.endswith(registry.FP8):  # e4m3: QGMMA only, its copies by the copy engine
            assert ops["QGMMA"] == expected_hgmma(role, head_dim), (role, ops["QGMMA"])
            assert matrix == ops["LDGSTS"] == 0 and ops["UTMALDG"] > 0, (role, ops)
            continue
        if spec.instruction == "wgmma":
            assert ops["HGMMA"] == expected_hgmma(role, head_dim), (role, ops["HGMMA"])
            assert ops["HMMA"] == 0 and ops["QGMMA"] == 0, (role, ops)
        else:
            assert ops["HMMA"] > 0 and ops["HGMMA"] == 0, (role, ops)
        if spec.name in ("forward_wgmma_ws", "backward_wgmma_ws"):
            # the producer's copies, the stage barriers' arrivals and waits, and the
            # registers handed from the producer to the consumers
            assert ops["LDGSTS"] > 0 and ops["SYNCS"] > 0, (role, ops)
            assert ops["SETMAXREG"] + ops["USETMAXREG"] == 2, (role, ops)
        if spec.name == "forward_wgmma_ws":  # and the copy engine's boxes (use_tma)
            assert ops["UTMALDG"] > 0, (role, ops)


def test_precompile_job_list():
    """``python -m cuflash.precompile`` compiles every role of every variant asked for."""
    from cuflash import precompile

    jobs = precompile.jobs_for(["bfloat16", "float32"], [128, 136], sm=90)
    expected = sum(
        len(kernel_build.Variant(precompile.DTYPES_BY_NAME[n], d, 90).kernel_names())
        for n in ("bfloat16", "float32")
        for d in (128, 136)
    )
    assert len(jobs) == expected == len(set(jobs))
    assert {role for _, role in jobs} >= {
        "forward_general",
        "forward_mma_sync",
        "forward_wgmma_ws",
        "forward_wgmma_ws_modified",
        "forward_tf32",
        "forward_float32_pieces",
        "backward_wgmma_atomic_dq",
        "backward_mma_sync",
        "backward_mma_sync_split_d",
        "backward_float32_pieces",
        "backward_tf32",
        "backward_dq_wgmma",
        "backward_dq_wgmma_modified",
    }
    from cuflash import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="head_dim"):
        precompile.jobs_for(["float16"], [12], sm=80)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        precompile.jobs_for(["float64"], [64], sm=80)


# ---------------------------------------------------------------------------------------
# The kernels outside the variants: standalone.STANDALONE_KERNELS


def test_registry_kernels_are_their_headers():
    """Each registry kernel is the ``__global__`` template of its name in the header of its
    name, in the folder of its instruction (sm90/ wgmma, sm80/ mma.sync, simt/ the CUDA
    cores), which the module includes."""
    import re

    folders = {"wgmma": "sm90", "mma.sync": "sm80", "cuda cores": "simt"}
    module = (kernel_build.KERNEL_DIR / kernel_build.MODULE_FILE).read_text()
    for spec in registry.KERNELS:
        header = f"{folders[spec.instruction]}/{spec.name}.cuh"
        source = (kernel_build.KERNEL_DIR / header).read_text()
        assert re.search(rf"__global__[^;{{]*\b{spec.name}\(", source), spec.name
        assert f'#include "{header}"' in module, spec.name


def test_standalone_kernels_are_their_templates():
    """Each kernel outside the variants once, its registry name its C++ template's, which
    its source file defines as a ``__global__`` function with the registry's template
    parameters (none: not a template)."""
    import re

    names = [kernel.name for kernel in standalone.STANDALONE_KERNELS]
    assert len(names) == len(set(names)) == len(standalone.STANDALONE)
    assert not set(names) & set(registry.BY_NAME)
    for kernel in standalone.STANDALONE_KERNELS:
        source = kernel_build.module_source(kernel.source)
        found = re.search(rf"(template\s*<([^>]*)>\s*)?__global__[^;{{]*\b{kernel.name}\(", source)
        assert found is not None, kernel.name
        parameters = [p for p in (found.group(2) or "").split(",") if p.strip()]
        assert len(parameters) == len(kernel.parameters), (kernel.name, parameters)
        assert standalone.standalone_of(kernel.name_expression(**_arguments(kernel))) is kernel
    with pytest.raises(LookupError):
        standalone.standalone_of("cuflash::forward_general<float, 64, 64, 32>")
    with pytest.raises(TypeError):
        standalone.STANDALONE["ring_merge"].name_expression()


def _arguments(kernel):
    values = {"dtype": np.float32, "paged": False, "narrow": True}
    return {p: values.get(p, 16) for p in kernel.parameters}


def test_every_launched_standalone_kernel_is_in_the_registry():
    """Every name expression a path outside the variants can launch is one of the registry's
    STANDALONE_KERNELS: the KV cache's append, split-KV decode (over dtypes, head dims,
    packed query rows, paged or not, short or long sequences) and combine, the block-mask
    classification and the ring merge; and no module of the library names a kernel source
    file, a C++ kernel or a RawModule besides the registry (``registry.py``, its
    ``standalone.py``) and the kernel build."""
    from pathlib import Path

    from cuflash.core.kvcache_problem import kvcache_problem
    from cuflash.gpu import decode_kernels

    launched = set()
    for dtype in registry.CXX_TYPES:
        for head_dim in (8, 40, 64, 72, 128, 136, 256):
            for q_len, heads, kv_heads in ((1, 8, 8), (1, 32, 8), (2, 32, 8), (4, 32, 4)):
                for paged in (False, True):
                    for lengths in (10, np.array([10, 4000], np.int32)):
                        q = np.zeros((2, heads, q_len, head_dim), dtype)
                        shape = (
                            (16, kv_heads, 512, head_dim)
                            if paged
                            else (2, kv_heads, 4096, head_dim)
                        )
                        cache = np.zeros(shape, dtype)
                        table = np.arange(16, dtype=np.int32).reshape(2, 8) if paged else None
                        new = np.zeros((2, kv_heads, 1, head_dim), dtype)
                        config = AttentionConfig(heads, kv_heads, head_dim, True)
                        problem = kvcache_problem(q, cache, cache, config, lengths, new, new, table)
                        launched.add(decode_kernels.decode_kernel(problem)[0])
                        launched |= {
                            decode_kernels.append_name(problem),
                            decode_kernels.combine_name(problem),
                        }
    assert {standalone.standalone_of(name).name for name in launched} == {
        "kvcache_append",
        "kvcache_decode_tc",
        "kvcache_decode",
        "kvcache_combine",
    }
    assert any(name.endswith(", true, true>") for name in launched)  # paged and narrow
    for name in launched:
        kernel = standalone.standalone_of(name)
        arguments = name.split("<", 1)[1].rstrip(">").split(", ")
        assert len(arguments) == len(kernel.parameters), name
    assert standalone.standalone_of(standalone.STANDALONE["classify_mask_cells"].name_expression())
    for dtype in registry.CXX_TYPES:  # the ring merge of each dtype's output
        merge = standalone.STANDALONE["ring_merge"].name_expression(dtype=dtype)
        assert standalone.standalone_of(merge).source == "simt/ring_merge.cu"
    package = Path(kernel_build.__file__).parent.parent  # the whole cuflash package
    owners = {Path("gpu", name) for name in ("registry.py", "standalone.py", "kernel_build.py")}
    for path in package.rglob("*.py"):
        if path.relative_to(package) in owners:
            continue
        text = path.read_text()
        for pattern in ('.cu"', ".cu'", '"cuflash::', "RawModule(", "RawKernel(", "load_kernel("):
            assert pattern not in text, (path.relative_to(package), pattern)


# v narrower than q and k (head_dim_v): the Hopper forward's and backward's DV
# instantiations, MLA's (192, 128) first, each head-dim class of v below each of q/k's,
# DV = 16 j + 8.
VALUE_DIM_VARIANTS = [
    (registry.SIXTEEN_BIT_DTYPES[-1], 192, 128),
    (registry.SIXTEEN_BIT_DTYPES[0], 192, 128),
    (registry.SIXTEEN_BIT_DTYPES[-1], 256, 64),
    (registry.SIXTEEN_BIT_DTYPES[0], 128, 72),
    (registry.SIXTEEN_BIT_DTYPES[-1], 96, 40),
    (registry.SIXTEEN_BIT_DTYPES[0], 64, 8),
]


@pytest.mark.parametrize("dtype, head_dim, head_dim_v", VALUE_DIM_VARIANTS, ids=lambda x: str(x))
def test_value_dim_variants_compile_without_spills(dtype, head_dim, head_dim_v):
    """The variant of a call with v's own head dim holds the kernels that take it
    (forward_wgmma_ws: its plain, persistent, modified and FP8 roles; backward_wgmma
    where its warpgroups split dV's columns, and the dQ pass), instantiated with DV, and
    the helpers (Delta at DV columns; a packed call's zeroing as it is); the DV kernels
    compile for sm_90a with no spill, stack frame or serialized wgmma."""
    variant = kernel_build.Variant(dtype, head_dim, 90, head_dim_v)
    names = variant.kernel_names()
    forward = {"forward_wgmma_ws_modified", "forward_wgmma_ws", "forward_wgmma_ws_persistent"}
    if head_dim % 16 == 0 and head_dim_v % 16 == 0:  # e4m3 V^T in rows of 16
        forward.add("forward_wgmma_ws_fp8")
    dq = {"backward_dq_wgmma", "backward_dq_wgmma_modified"}
    dkdv = set()
    for name in ("backward_wgmma_ws", "backward_wgmma"):
        if registry.BY_NAME[name].takes_value_dims(head_dim, head_dim_v):
            dkdv |= set(registry.BY_NAME[name].roles(head_dim))
    native = forward | dq | dkdv
    helpers = {r for r in names if registry.BY_ROLE[r].direction == "helper"} - dq
    assert "packed_zero_outside" in helpers and set(names) == native | helpers
    assert all(names[role].endswith(f", {head_dim_v}>") for role in native | {"backward_delta"})
    assert (head_dim, head_dim_v) not in ((192, 128), (128, 72)) or dkdv  # MLA's natively
    assert (
        names["packed_zero_outside"]
        == kernel_build.Variant(dtype, head_dim, 90).kernel_names()["packed_zero_outside"]
    )
    native |= {"backward_delta"}
    report = kernel_build.compile_offline(variant, "sm_90a", roles=sorted(native))
    for role, info in report.kernels().items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (role, info)
        assert info["stack"] == 0, (role, info)
        assert 0 < info["registers"] <= 255, (role, info)
        assert not info["wgmma_serialized"], (role, info)
