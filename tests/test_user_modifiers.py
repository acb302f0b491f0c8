"""User-defined score and mask modifiers (cuflash.modifiers; the semantics page,
section 'User-defined score and mask functions'), without a GPU.

* The NumPy evaluators of every factory and of hand-written functions agree with
  the function itself called on Python scalars, element by element; the float32
  evaluator stays within float32 rounding of the float64 one.
* The symbolic derivative agrees with central finite differences (float64).
* The generated C++ compiles with NVRTC for sm_80 and sm_90a in a kernel that
  calls operator() and grad(); built for the host with g++ (when there is one),
  it computes what the NumPy evaluator computes, clamping value-derived indices
  where the evaluator raises.
* Cache keys depend on the code, constants and array dtypes and ranks, not on
  array contents; bad modifiers raise InvalidArgumentError naming the problem.
"""

import ctypes
import inspect
import itertools
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
from support import cupy

from cuflash import modifiers
from cuflash.errors import InvalidArgumentError
from cuflash.modifiers import MaskMod, ScoreMod, abs, exp, log, maximum, minimum, sqrt, tanh, where

B, H, SQ, SK = 2, 3, 7, 9
WINDOW = 3
SHIFT = 2

# ------------------------------------------------------------------------- cases
# Each builder makes one modifier from random arrays; functions are defined here
# (in a file) so that their source can be read.


def _weird_score(rng):
    table = rng.standard_normal((H, 4)).astype(np.float32)

    def weird(score, b, h, q_idx, kv_idx):
        """Locals, if/else, // and % of negatives, ** and every function."""
        grown = abs(score) * exp(-0.1 * minimum(score, 2.0))
        steps = (q_idx - 5) // 3 - (kv_idx - 7) % 4 + SHIFT
        if grown > 3.0:
            grown = sqrt(grown) + log(1.0 + grown)
        else:
            grown += maximum(score, -1.0) ** 2
        return grown + steps * table[h, kv_idx % 4] - float(b) ** 2

    return ScoreMod(weird)


def _masked_tanh_score(rng):
    offsets = rng.integers(-3, 3, size=(B,)).astype(np.int64)
    big = 3_000_000_000  # an int64 constant

    def masked_tanh(score, b, h, q_idx, kv_idx):
        if kv_idx > q_idx + offsets[b] and big > 0:
            return -math.inf
        return where(h == 1, 4.0 * tanh(score / 4.0), score * (h + 1)) / 2

    return ScoreMod(masked_tanh)


def _keyword_score(rng):
    def biased(score, b, h, q_idx, kv_idx):
        return score + scale * bias[b, h] * (q_idx - kv_idx)  # noqa: F821 - bound below

    bias = rng.standard_normal((B, H)).astype(np.float32)
    scale = np.array(rng.uniform(0.5, 2.0), dtype=np.float32)  # a 0-d array
    return ScoreMod(biased, bias=bias, scale=scale)


def _lambda_score(rng):
    return ScoreMod(
        lambda score, b, h, q_idx, kv_idx: where(q_idx >= kv_idx, score * 0.5, float("-inf"))
    )


def _constants_score(rng):
    def constants(score, b, h, q_idx, kv_idx):
        tiny = 1e-45 * score  # a float32 subnormal
        if q_idx > -2147483648 and kv_idx > -9223372036854775808:
            return score * 0.1 + tiny + -0.0 - 3.4028235e38 / 1e38 + -(kv_idx - 2)
        return -math.inf

    return ScoreMod(constants)


def _sliding_mask(rng):
    def sliding(b, h, q_idx, kv_idx):
        return 0 <= q_idx - kv_idx < WINDOW or (h == 2 and not kv_idx % 2 == 1)

    return MaskMod(sliding)


def _flag_mask(rng):
    flags = rng.random((H, SK)) < 0.6  # a bool array
    return MaskMod(lambda b, h, q_idx, kv_idx: flags[h][kv_idx] != (q_idx < kv_idx))


def _document_causal(rng):
    ids = np.sort(rng.integers(0, 3, size=(B, SK))).astype(np.int32)  # queries and keys
    return modifiers.and_masks(modifiers.document_mask(ids), modifiers.causal_mask(offset=SK - SQ))


CASES = {
    "weird": _weird_score,
    "masked_tanh": _masked_tanh_score,
    "keyword": _keyword_score,
    "lambda": _lambda_score,
    "constants": _constants_score,
    "sliding": _sliding_mask,
    "flags": _flag_mask,
    "document_causal": _document_causal,
    "document": lambda rng: modifiers.document_mask(
        rng.integers(0, 3, SQ).astype(np.int64), rng.integers(0, 3, SK).astype(np.int64)
    ),
    "prefix_lm": lambda rng: modifiers.prefix_lm_mask(4, offset=1),
    "prefix_lm_batch": lambda rng: modifiers.prefix_lm_mask(
        rng.integers(1, SK, size=B).astype(np.int32)
    ),
    "chunked": lambda rng: modifiers.chunked_mask(3, offset=-1),
    "chunked_bidirectional": lambda rng: modifiers.chunked_mask(4, causal=False),
    "or_masks": lambda rng: modifiers.or_masks(
        modifiers.chunked_mask(4), modifiers.prefix_lm_mask(2)
    ),
    "softcap": lambda rng: modifiers.softcap_score(2.5),
    "alibi": lambda rng: modifiers.alibi_score(
        rng.uniform(0.1, 1, H).astype(np.float32), offset=SK - SQ
    ),
    "alibi_batch": lambda rng: modifiers.alibi_score(
        rng.uniform(0.1, 1, (B, H)).astype(np.float32)
    ),
    "relative_bias": lambda rng: modifiers.relative_bias_score(
        rng.standard_normal((H, 7)).astype(np.float32), offset=1
    ),
}
SCORE_CASES = [
    name
    for name in CASES
    if name
    not in (
        "sliding",
        "flags",
        "document_causal",
        "document",
        "prefix_lm",
        "prefix_lm_batch",
        "chunked",
        "chunked_bidirectional",
        "or_masks",
    )
]


def _scores(rng, dtype=np.float32):
    return (rng.standard_normal((B, H, SQ, SK)) * 3).astype(dtype)


def _python_loop(mod, score=None):
    """The function itself on Python scalars, element by element (float64)."""
    out = np.empty((B, H, SQ, SK), dtype=np.float64 if mod.kind == "score" else bool)
    for index in itertools.product(range(B), range(H), range(SQ), range(SK)):
        ints = tuple(int(position) for position in index)
        args = ((float(score[index]),) if mod.kind == "score" else ()) + ints
        out[index] = mod(*args)
    return out


def _evaluate(mod, score=None, dtype=np.float32):
    grids = modifiers.index_grids(B, H, SQ, SK)
    if mod.kind == "mask":
        return mod.numpy_mask(*grids)
    return mod.numpy_scores(score, *grids, dtype=dtype)


def _assert_scores_close(got, want, rtol, name):
    assert not np.isnan(want).any(), f"{name}: the reference has NaN"
    assert not np.isnan(got).any(), f"{name}: NaN"
    assert np.array_equal(np.isinf(got), np.isinf(want)), f"{name}: infinities differ"
    assert np.array_equal(got[np.isinf(got)], want[np.isinf(want)]), name
    finite = np.isfinite(want)
    assert finite.sum() > want.size // 4, f"{name}: too few finite entries to test"
    error = np.abs(got[finite] - want[finite]) / (1 + np.abs(want[finite]))
    assert error.max() <= rtol, f"{name}: error {error.max():.3g} > {rtol:.3g}"


# ------------------------------------------------------------- evaluators agree


@pytest.mark.parametrize("name", CASES)
def test_numpy_matches_python(name, rng):
    mod = CASES[name](rng)
    mod.check_bounds(B, H, SQ, SK)
    if mod.kind == "mask":
        got, want = _evaluate(mod), _python_loop(mod)
        assert got.dtype == bool and got.shape == (B, H, SQ, SK)
        assert np.array_equal(got, want)
        assert 0 < got.sum() < got.size, "the mask shows everything or nothing"
        return
    score = _scores(rng)
    want = _python_loop(mod, score)
    wide = _evaluate(mod, score.astype(np.float64), dtype=np.float64)
    narrow = _evaluate(mod, score)
    assert wide.dtype == np.float64 and narrow.dtype == np.float32
    # Python on scalars multiplies a float32 array element by an int in float32 (NEP 50)
    reads_floats = any(array.dtype == np.float32 for array in mod.arrays.values())
    _assert_scores_close(wide, want, 1e-6 if reads_floats else 1e-12, f"{name} float64")
    _assert_scores_close(narrow, want, 2e-5, f"{name} float32")
    assert not np.array_equal(wide, score), "the modifier changed nothing"


@pytest.mark.parametrize("name", SCORE_CASES)
def test_derivative_matches_finite_differences(name, rng):
    mod = CASES[name](rng)
    grids = modifiers.index_grids(B, H, SQ, SK)
    score = _scores(rng, np.float64)
    step = 1e-6

    def value(points):
        return mod.numpy_scores(points, *grids, dtype=np.float64)

    center = value(score)
    with np.errstate(invalid="ignore"):  # -inf - -inf where masked
        ahead = (value(score + step) - center) / step
        behind = (center - value(score - step)) / step
        central = (value(score + step) - value(score - step)) / (2 * step)
    grad = mod.numpy_grad(score, *grids, dtype=np.float64)
    assert grad.shape == score.shape and not np.isnan(grad).any()
    masked = center == -np.inf
    assert np.all(grad[masked] == 0), "the derivative must be 0 where the score is masked"
    smooth = ~masked & (np.abs(ahead - behind) <= 1e-4 * (1 + np.abs(central)))
    assert smooth.sum() > score.size // 4, "too few smooth points to test"
    error = np.abs(grad[smooth] - central[smooth]) / (1 + np.abs(central[smooth]))
    assert error.max() <= 1e-6, f"derivative error {error.max():.3g}"
    narrow = mod.numpy_grad(score.astype(np.float32), *grids)
    assert narrow.dtype == np.float32
    assert np.allclose(narrow[smooth], grad[smooth], rtol=1e-4, atol=1e-4)


def test_index_grids_broadcast():
    b, h, q_idx, kv_idx = modifiers.index_grids(2, 3, 4, 5)
    assert (b.shape, h.shape, q_idx.shape, kv_idx.shape) == (
        (2, 1, 1, 1),
        (1, 3, 1, 1),
        (1, 1, 4, 1),
        (1, 1, 1, 5),
    )
    assert np.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape) == (2, 3, 4, 5)


def test_factories_mean_what_they_say(rng):
    b, h, q_idx, kv_idx = modifiers.index_grids(B, H, SQ, SK)
    ids = rng.integers(0, 3, size=SQ).astype(np.int32)
    keys = rng.integers(0, 3, size=SK).astype(np.int32)
    got = modifiers.document_mask(ids, keys).numpy_mask(b, h, q_idx, kv_idx)
    assert np.array_equal(got, np.broadcast_to(ids[:, None] == keys[None, :], got.shape))
    got = modifiers.chunked_mask(3, offset=2).numpy_mask(b, h, q_idx, kv_idx)
    position = q_idx + 2
    assert np.array_equal(
        got, np.broadcast_to((position // 3 == kv_idx // 3) & (kv_idx <= position), got.shape)
    )
    score = _scores(rng)
    slopes = rng.uniform(0.1, 1, H).astype(np.float32)
    got = modifiers.alibi_score(slopes, offset=SK - SQ).numpy_scores(
        score, b, h, q_idx, kv_idx, dtype=np.float64
    )
    want = score - slopes[None, :, None, None].astype(np.float64) * np.abs(q_idx + SK - SQ - kv_idx)
    assert np.allclose(got, want, rtol=1e-12, atol=0)
    table = rng.standard_normal((H, 5)).astype(np.float32)
    got = modifiers.relative_bias_score(table).numpy_scores(score, b, h, q_idx, kv_idx)
    distance = np.clip(kv_idx - q_idx, -2, 2)
    assert np.array_equal(got, score + table[h, distance + 2])
    got = modifiers.softcap_score(2.5).numpy_scores(score, b, h, q_idx, kv_idx, np.float64)
    assert np.allclose(got, 2.5 * np.tanh(score.astype(np.float64) / 2.5), rtol=1e-12, atol=0)


# ------------------------------------------------------------------ generated C++


def _all_cases(rng):
    return [CASES[name](rng) for name in CASES]


def _device_kernel(index, mod):
    call = (
        "mod(score[i], b, h, q, k, arrays)"
        if mod.kind == "score"
        else "(mod(b, h, q, k, arrays) ? 1.0f : 0.0f)"
    )
    grad = "grad[i] = mod.grad(score[i], b, h, q, k, arrays);" if mod.kind == "score" else ""
    return f"""
extern "C" __global__ void evaluate_{index}(const float* score, float* out, float* grad,
                                           int B, int H, int Sq, int Sk, ModifierArrays arrays) {{
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)B * H * Sq * Sk) return;
    const int k = i % Sk, q = (i / Sk) % Sq, h = (i / Sk / Sq) % H, b = i / Sk / Sq / H;
    const {mod.struct_name} mod;
    out[i] = {call};
    {grad}
}}
"""


def _nvrtc():
    """CuPy's NVRTC binding (it compiles without a GPU; missing is a failure, not a skip)."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover - a broken install
        pytest.fail(f"NVRTC is not usable: {exc}")
    return nvrtc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_cxx_compiles_with_nvrtc(arch, rng):
    nvrtc = _nvrtc()
    mods = _all_cases(rng)
    source = modifiers.MODIFIER_PRELUDE + "".join(mod.cxx_source for mod in mods)
    source += "".join(_device_kernel(index, mod) for index, mod in enumerate(mods))
    assert "#include" not in source.split("#else")[0], "NVRTC gets no header"
    program = nvrtc.createProgram(source, "user_modifiers.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, ("-std=c++17", f"-arch={arch}"))
        except nvrtc.NVRTCError:
            pytest.fail(f"NVRTC failed:\n{nvrtc.getProgramLog(program)}")
        assert len(nvrtc.getCUBIN(program)) > 1000
    finally:
        nvrtc.destroyProgram(program)


def test_bad_cxx_is_reported_by_nvrtc():
    """The harness above does catch a failing compile (a sanity check of the check)."""
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(
        modifiers.MODIFIER_PRELUDE + "struct X { int y = z; };", "bad.cu", (), ()
    )
    try:
        with pytest.raises(nvrtc.NVRTCError):
            nvrtc.compileProgram(program, ("-std=c++17", "-arch=sm_80"))
        assert "z" in nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def _host_function(index, mod):
    call = (
        "mod(score[i], b, h, q, k, *arrays)"
        if mod.kind == "score"
        else "(mod(b, h, q, k, *arrays) ? 1.0f : 0.0f)"
    )
    grad = "grad[i] = mod.grad(score[i], b, h, q, k, *arrays);" if mod.kind == "score" else ""
    return f"""
extern "C" void evaluate_{index}(const float* score, float* out, float* grad, int B, int H,
                                int Sq, int Sk, const ModifierArrays* arrays) {{
    const {mod.struct_name} mod;
    long long i = 0;
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h)
        for (int q = 0; q < Sq; ++q) for (int k = 0; k < Sk; ++k, ++i) {{
            out[i] = {call};
            {grad}
        }}
}}
"""


def _build_host(mods, tmp_path):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to build the functors as host code")
    source = modifiers.MODIFIER_PRELUDE + "".join(mod.cxx_source for mod in mods)
    source += "".join(_host_function(index, mod) for index, mod in enumerate(mods))
    (tmp_path / "mods.cpp").write_text(source)
    library = tmp_path / "mods.so"
    done = subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-o",
            str(library),
            str(tmp_path / "mods.cpp"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(library))


def _run_host(library, index, mod, score):
    out, grad = np.empty_like(score), np.empty_like(score)
    record = np.array(mod.kernel_arguments(np)[0])  # keep the buffer alive for the call
    floats = ctypes.POINTER(ctypes.c_float)
    getattr(library, f"evaluate_{index}")(
        score.ctypes.data_as(floats),
        out.ctypes.data_as(floats),
        grad.ctypes.data_as(floats),
        B,
        H,
        SQ,
        SK,
        ctypes.c_void_p(record.ctypes.data),
    )
    return out, grad


def test_host_cxx_matches_numpy(rng, tmp_path):
    mods = _all_cases(rng)
    library = _build_host(mods, tmp_path)
    grids = modifiers.index_grids(B, H, SQ, SK)
    score = _scores(rng)
    for index, mod in enumerate(mods):
        out, grad = _run_host(library, index, mod, score)
        if mod.kind == "mask":
            assert np.array_equal(out.astype(bool), mod.numpy_mask(*grids)), mod.name
            continue
        _assert_scores_close(out, mod.numpy_scores(score, *grids), 4e-6, mod.name)
        want = mod.numpy_grad(score, *grids)
        assert not np.isnan(grad).any(), mod.name
        assert np.allclose(grad, want, rtol=4e-6, atol=4e-6), mod.name


def test_value_derived_indices_clamp_in_cxx_and_raise_in_numpy(rng, tmp_path):
    bias = rng.standard_normal(5).astype(np.float32)
    slot = rng.integers(-3, 9, size=SQ).astype(np.int32)  # some values outside [0, 5)
    slot[0], slot[1] = -2, 7

    def by_slot(score, b, h, q_idx, kv_idx):
        return score + bias[slot[q_idx]]

    mod = ScoreMod(by_slot)
    mod.check_bounds(B, H, SQ, SK)  # slot[q_idx] is in range; bias[...] is not checkable
    grids = modifiers.index_grids(B, H, SQ, SK)
    score = _scores(rng)
    with pytest.raises(InvalidArgumentError, match=r"axis 0 of bias ranges over \[-\d+, \d+\]"):
        mod.numpy_scores(score, *grids)
    library = _build_host([mod], tmp_path)
    out, grad = _run_host(library, 0, mod, score)
    clamped = bias[np.clip(slot, 0, 4)]
    assert np.array_equal(out, score + clamped[None, None, :, None])
    assert np.all(grad == 1)


# --------------------------------------------------------------------- cache keys


def _softcap_like(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    return ScoreMod(softcap)


def test_cache_key_follows_code_constants_and_dtypes(rng):
    first, again = _softcap_like(30.0), _softcap_like(30.0)
    assert first is not again and first.cache_key == again.cache_key
    assert first.struct_name == again.struct_name and first.cxx_source == again.cxx_source
    assert first.struct_name.startswith("UserScoreMod_") and len(first.struct_name) == 25
    assert _softcap_like(20.0).cache_key != first.cache_key
    assert modifiers.softcap_score(30.0).cache_key == modifiers.softcap_score(30).cache_key

    ids = rng.integers(0, 4, 16).astype(np.int32)
    other = (ids + 1 + rng.integers(0, 4, 16)).astype(np.int32)
    same = modifiers.document_mask(ids)
    assert modifiers.document_mask(other).cache_key == same.cache_key
    assert modifiers.document_mask(ids[:9]).cache_key == same.cache_key  # shape is a value
    assert modifiers.document_mask(ids[::2]).cache_key == same.cache_key  # so are strides
    assert modifiers.document_mask(ids.astype(np.int64)).cache_key != same.cache_key
    assert modifiers.document_mask(ids.reshape(2, 8)).cache_key != same.cache_key
    assert same.struct_name.startswith("UserMaskMod_")
    assert len(same.cache_key) == 64 and int(same.cache_key, 16) >= 0

    table = rng.standard_normal((H, 5)).astype(np.float32)
    assert (
        modifiers.relative_bias_score(table).cache_key
        == modifiers.relative_bias_score(table + 1).cache_key
    )
    assert (
        modifiers.relative_bias_score(table).cache_key
        != modifiers.relative_bias_score(table, offset=1).cache_key
    )


def test_cache_key_is_stable_across_processes():
    code = (
        "from cuflash import modifiers; import numpy as np; "
        "print(modifiers.softcap_score(30.0).cache_key, "
        "modifiers.document_mask(np.arange(3, dtype=np.int32)).cache_key)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ids = np.arange(5, dtype=np.int32) + 2
    assert done.stdout.split() == [
        modifiers.softcap_score(30.0).cache_key,
        modifiers.document_mask(ids).cache_key,
    ]


def test_runtime_scalar_is_not_part_of_the_key(rng):
    def scaled(score, b, h, q_idx, kv_idx):
        return score * factor

    factor = np.array(1.5, dtype=np.float32)
    first = ScoreMod(scaled)
    factor = np.array(-0.25, dtype=np.float32)
    second = ScoreMod(scaled)
    assert first.cache_key == second.cache_key
    score = _scores(rng)
    grids = modifiers.index_grids(B, H, SQ, SK)
    assert np.array_equal(second.numpy_scores(score, *grids), score * np.float32(-0.25))
    assert np.array_equal(first.numpy_scores(score, *grids), score * np.float32(1.5))


# -------------------------------------------------------------------- static bounds


def test_check_bounds_rejects_reads_outside_an_array(rng):
    table = rng.standard_normal((H, 2 * SQ - 1)).astype(np.float32)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + SQ - 1]

    mod = ScoreMod(relative)
    mod.check_bounds(B, H, SQ, SQ)
    mod.check_bounds(0, H, 10**6, 10**6)  # an empty problem evaluates nothing
    with pytest.raises(
        InvalidArgumentError,
        match=(
            r"^score_mod: .*relative reads table\[h, q_idx - kv_idx \+ SQ - 1\] with axis-1 "
            r"indices in \[-2, 12\] for batch=2, heads=3, q_len=7, kv_len=9, but table has "
            r"13 entries on axis 1 \(indices never wrap\)$"
        ),
    ):
        mod.check_bounds(B, H, SQ, SK)
    with pytest.raises(InvalidArgumentError, match=r"axis-0 indices in \[0, 3\].*has 3 entries"):
        mod.check_bounds(B, H + 1, SQ, SQ)
    with pytest.raises(InvalidArgumentError, match="q_len: expected an int >= 0"):
        mod.check_bounds(B, H, -1, SQ)

    def negative(score, b, h, q_idx, kv_idx):
        return score + table[h, -1]  # no wrap-around

    with pytest.raises(InvalidArgumentError, match=r"axis-1 indices in \[-1, -1\]"):
        ScoreMod(negative).check_bounds(1, 1, 1, 1)


def test_check_bounds_interval_rules(rng):
    table = rng.standard_normal(9).astype(np.float32)

    def folded(b, h, q_idx, kv_idx):
        # % 8 keeps any index in range; (q - k) // 4 of q, k < 32 lies in [-8, 7]
        return table[(q_idx * 5 - kv_idx) % 8] > 0 and table[abs((q_idx - kv_idx) // 4)] > 0

    mod = MaskMod(folded)
    mod.check_bounds(4, 4, 32, 32)
    with pytest.raises(InvalidArgumentError, match=r"axis-0 indices in \[0, 9\]"):
        mod.check_bounds(4, 4, 40, 32)

    def branches(b, h, q_idx, kv_idx):
        return table[q_idx if q_idx < 8 else 0] > 0  # both branches count

    with pytest.raises(InvalidArgumentError, match=r"axis-0 indices in \[0, 19\]"):
        MaskMod(branches).check_bounds(1, 1, 20, 4)
    MaskMod(branches).check_bounds(1, 1, 8, 4)

    def overflowing(b, h, q_idx, kv_idx):
        return q_idx * kv_idx * 1000 > 7

    MaskMod(overflowing).check_bounds(1, 1, 1000, 1000)
    with pytest.raises(InvalidArgumentError, match="int32 arithmetic may overflow"):
        MaskMod(overflowing).check_bounds(1, 1, 100_000, 100_000)

    def widened(b, h, q_idx, kv_idx):
        return 3_000_000_000 * q_idx * kv_idx > 7  # int64 from the constant on

    MaskMod(widened).check_bounds(1, 1, 100_000, 100_000)

    def widened_late(b, h, q_idx, kv_idx):
        return q_idx * kv_idx * 3_000_000_000 > 7  # q_idx * kv_idx is still int32

    with pytest.raises(InvalidArgumentError, match=r"ranges over \[0, 9999800001\]"):
        MaskMod(widened_late).check_bounds(1, 1, 100_000, 100_000)


# ---------------------------------------------------------------- arrays and calls


def test_kernel_arguments_record_the_arrays(rng):
    base = rng.standard_normal((6, 10)).astype(np.float32)
    view = base[::2, ::-3]  # strided, negative stride
    ids = rng.integers(0, 3, size=7).astype(np.int64)

    def read_both(score, b, h, q_idx, kv_idx):
        return score + view[h, kv_idx % 4] * ids[q_idx]

    mod = ScoreMod(read_both)
    assert list(mod.arrays) == ["view", "ids"]
    (record,) = mod.kernel_arguments(np)
    assert record.dtype == modifiers.MODIFIER_ARRAYS_DTYPE and record.dtype.itemsize == 288
    assert record["data"][0] == view.__array_interface__["data"][0]
    assert record["data"][1] == ids.ctypes.data and record["data"][2] == 0
    assert list(record["stride"][0][:2]) == [20, -3] and list(record["shape"][0][:2]) == [3, 4]
    assert record["stride"][1][0] == 1 and record["shape"][1][0] == 7
    grids = modifiers.index_grids(1, 3, 7, 5)
    score = _scores(rng)[:1, :, :, :5]
    want = score + view[grids[1], grids[3] % 4] * ids[grids[2]].astype(np.float32)
    assert np.allclose(mod.numpy_scores(score, *grids), want, rtol=1e-6, atol=1e-6)
    if cupy is not None:
        with pytest.raises(
            InvalidArgumentError,
            match=r"array view is a numpy array; the GPU "
            r"kernels need a cupy array \(make the "
            r"modifier with cupy.asarray\)",
        ):
            mod.kernel_arguments(cupy)


@pytest.mark.gpu
def test_kernel_arguments_on_the_gpu(rng):
    table = cupy.asarray(rng.standard_normal((4, 6)).astype(np.float32))[:, 1::2]

    def read(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx]

    mod = ScoreMod(read)
    (record,) = mod.kernel_arguments()
    assert record["data"][0] == table.data.ptr
    assert list(record["stride"][0][:2]) == [6, 2]
    with pytest.raises(
        InvalidArgumentError, match="array table is a cupy array; host code needs a numpy array"
    ):
        mod.kernel_arguments(np)
    grids = modifiers.index_grids(1, 4, 2, 3)
    score = rng.standard_normal((1, 4, 2, 3)).astype(np.float32)
    want = score + cupy.asnumpy(table)[grids[1], grids[3]]
    assert np.array_equal(mod.numpy_scores(score, *grids), want)  # CuPy arrays copied


def test_python_calls_see_keyword_bindings(rng):
    mod = _keyword_score(rng)
    bias, scale = mod.arrays["bias"], mod.arrays["scale"]
    got = mod(1.25, 1, 2, 5, 3)
    assert got == pytest.approx(1.25 + float(scale) * float(bias[1, 2]) * 2)


def test_modifiers_call_modifiers(rng):
    ids = rng.integers(0, 2, size=SQ).astype(np.int32)
    document, causal = modifiers.document_mask(ids), modifiers.causal_mask()
    softcap = modifiers.softcap_score(3.0)

    def document_causal_softcap(score, b, h, q_idx, kv_idx):
        visible = document(b, h, q_idx, kv_idx) and causal(b, h, q_idx, kv_idx)
        return softcap(score, b, h, q_idx, kv_idx) if visible else -math.inf

    mod = ScoreMod(document_causal_softcap)
    assert list(mod.arrays) == ["query_ids"]
    grids = modifiers.index_grids(B, H, SQ, SQ)
    score = _scores(rng)[..., :SQ]
    visible = modifiers.and_masks(document, causal).numpy_mask(*grids)
    want = np.where(visible, softcap.numpy_scores(score, *grids), -np.inf)
    assert np.array_equal(mod.numpy_scores(score, *grids), want)
    assert np.array_equal(mod.numpy_grad(score, *grids) == 0, ~visible)


def test_numpy_evaluators_check_their_inputs(rng):
    mod = modifiers.softcap_score(2.0)
    with pytest.raises(InvalidArgumentError, match="dtype: expected float32 or float64"):
        mod.numpy_scores(_scores(rng), 0, 0, 0, 0, dtype=np.float16)
    with pytest.raises(InvalidArgumentError, match="q_idx: expected integer indices"):
        mod.numpy_scores(_scores(rng), 0, 0, 0.5, 0)


# --------------------------------------------------------------------------- errors


def _line_of(fn, text):
    lines, first = inspect.getsourcelines(fn)
    return first + next(number for number, line in enumerate(lines) if text in line)


def _error(make, *args, **kwargs):
    with pytest.raises(InvalidArgumentError) as info:
        make(*args, **kwargs)
    return str(info.value)


def test_unsupported_syntax_names_the_line():
    def looping(score, b, h, q_idx, kv_idx):
        total = score
        for step in range(3):
            total = total + step
        return total

    message = _error(ScoreMod, looping)
    assert message.startswith("score_mod: ")
    assert "unsupported syntax: a for loop" in message
    assert f"line {_line_of(looping, 'for step')})" in message

    def comprehension(b, h, q_idx, kv_idx):
        return q_idx in [kv_idx for _ in range(2)]

    assert "unsupported syntax: a list comprehension ([kv_idx for _ in range(2)])" in _error(
        MaskMod, comprehension
    )

    def listing(score, b, h, q_idx, kv_idx):
        return sum([score, 1.0])

    message = _error(ScoreMod, listing)
    assert "unsupported function sum" in message
    assert f"line {_line_of(listing, 'return sum')})" in message


@pytest.mark.parametrize(
    "body, problem",
    [
        ("return score", "expected exactly 4 positional parameters (b, h, q_idx, kv_idx)"),
        ("return q_idx + kv_idx", "a mask modifier must return a bool (a condition), got a int32"),
        ("return (q_idx > kv_idx) + 1", "+ takes numbers, got a bool"),
        ("return kv_idx // 0 == 1", "// by the constant 0"),
        (
            "return True if q_idx > 2 else 1.5",
            "the branches have different types (bool and float32)",
        ),
        ("return q_idx // 2.0 == 1", "// takes integers, got a float32 operand"),
        ("return q_idx ** kv_idx > 1", "** takes a constant integer exponent from 0 to 8"),
        ("return q_idx and kv_idx", "and takes conditions (comparisons or bools), got a int32"),
        ("return undefined_name > 1", "name 'undefined_name' is not defined"),
        ("return np.sin(q_idx) > 0", "unsupported function np.sin"),
        ("return where(q_idx > 1, True) ", "where takes 3 arguments here, got 2"),
        ("return maximum(q_idx, kv_idx, 3) > 1", "maximum takes 2 arguments here, got 3"),
        ("return float('pi') > 1", "float('pi') is not a number"),
        ("x = 1", "the function can end without a return"),
        ("return", "return needs a value"),
        ("return q_idx is kv_idx", "unsupported comparison"),
        ("return 'text' == q_idx", "unsupported constant 'text'"),
        ("a, c = 1, 2\n    return True", "unsupported syntax: assignment to (a, c)"),
    ],
)
def test_bad_mask_functions(body, problem, tmp_path):
    source = "import numpy as np\nfrom cuflash.modifiers import where, maximum\n"
    signature = "score, b, h, q_idx, kv_idx" if "positional" in problem else "b, h, q_idx, kv_idx"
    source += f"def bad({signature}):\n    {body}\n"
    path = tmp_path / "bad_module.py"
    path.write_text(source)
    namespace = {"__name__": "bad_module"}
    exec(compile(source, str(path), "exec"), namespace)
    message = _error(MaskMod, namespace["bad"])
    assert message.startswith("mask_mod: bad (bad_module.py, line ")
    assert problem in message, message


def test_bad_score_functions():
    def returns_bool(score, b, h, q_idx, kv_idx):
        return score > 0

    assert "a score modifier must return a number (the new score), got a bool" in _error(
        ScoreMod, returns_bool
    )

    def float_index(score, b, h, q_idx, kv_idx):
        return score + TABLE[h, score]

    assert "array indices must be integers: score is a float32" in _error(ScoreMod, float_index)

    def too_few(score, b, h, q_idx, kv_idx):
        return score + TABLE[h]

    assert "array TABLE is 2-D but TABLE[h] gives 1 indices" in _error(ScoreMod, too_few)

    def unindexed(score, b, h, q_idx, kv_idx):
        return score + TABLE

    assert "array TABLE is 2-D: index it with 2 indices" in _error(ScoreMod, unindexed)

    def from_list(score, b, h, q_idx, kv_idx):
        return score + LISTED[h]

    assert "LISTED is a list, not an array" in _error(ScoreMod, from_list)

    def from_module(score, b, h, q_idx, kv_idx):
        return score + np

    assert "np is a module; a modifier uses numbers, arrays" in _error(ScoreMod, from_module)


TABLE = np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(3, 4)
LISTED = [1.0, 2.0]


@pytest.mark.parametrize(
    "array, problem",
    [
        (
            np.linspace(1, 2, 5),
            "array values: unsupported dtype float64; expected int32, int64, float32 or bool",
        ),
        (np.arange(1, 6, dtype=np.uint8), "unsupported dtype uint8"),
        (np.ones((1, 1, 1, 1, 5), np.float32), "array values is 5-D; at most 4-D"),
        (np.ones((0,), np.float32), "array values is empty"),
        (
            np.lib.stride_tricks.as_strided(
                np.arange(1, 41, dtype=np.uint8)[:4].view(np.int32), shape=(5,), strides=(6,)
            ),
            "array values: the stride of axis 0 (6 bytes) is not a multiple of its itemsize (4)",
        ),
    ],
)
def test_bad_arrays(array, problem):
    def read_1d(score, b, h, q_idx, kv_idx):
        return score + values[q_idx]  # noqa: F821 - bound by keyword

    def read_5d(score, b, h, q_idx, kv_idx):
        return score + values[q_idx, q_idx, q_idx, q_idx, q_idx]  # noqa: F821

    message = _error(ScoreMod, read_5d if array.ndim == 5 else read_1d, values=array)
    assert problem in message, message


def test_too_many_arrays(rng):
    first, second, third, fourth, fifth = (
        rng.standard_normal(4).astype(np.float32) for _ in range(5)
    )

    def five(score, b, h, q_idx, kv_idx):
        return score + first[0] + second[1] + third[2] + fourth[3] + fifth[0]

    assert "reads more than 4 arrays (first, second, third, fourth, fifth)" in _error(
        ScoreMod, five
    )

    def same_array_twice(score, b, h, q_idx, kv_idx):
        return score + first[0] + first[1] + second[0] + third[0] + fourth[0]

    assert len(ScoreMod(same_array_twice).arrays) == 4


def test_functions_without_source():
    namespace = {}
    exec(compile("fn = lambda score, b, h, q_idx, kv_idx: score\n", "<stdin>", "exec"), namespace)
    message = _error(ScoreMod, namespace["fn"])
    assert message.startswith("score_mod: cannot read the source of <lambda>")
    assert "not at an interactive prompt or through exec" in message
    assert "expected a Python function (def or lambda), got ufunc" in _error(ScoreMod, np.tanh)
    assert "expected a Python function" in _error(MaskMod, modifiers.causal_mask())


def test_lambdas_on_one_line():
    first, second = MaskMod(lambda b, h, q, k: q >= k), ScoreMod(lambda s, b, h, q, k: s * 2)
    grids = modifiers.index_grids(1, 1, 3, 3)
    assert first.numpy_mask(*grids).sum() == 6
    assert second.numpy_scores(np.float32(1.5), *grids)[0, 0, 0, 0] == 3.0
    twins = (lambda b, h, q, k: q >= k, lambda b, h, q, k: q < k)
    message = _error(MaskMod, twins[0])
    assert "line" in message and "has several lambdas with its parameters" in message


def test_keyword_bindings_must_name_free_variables():
    def reads_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]  # noqa: F821

    assert "does not read a variable named 'table'" in _error(
        ScoreMod, reads_bias, table=np.ones(3, np.float32)
    )
    assert "does not read a variable named 'score'" in _error(
        ScoreMod, reads_bias, score=np.ones(3, np.float32)
    )
    assert "name 'bias' is not defined" in _error(ScoreMod, reads_bias)


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: modifiers.softcap_score(0.0), "cap: expected a finite number > 0, got 0.0"),
        (lambda: modifiers.softcap_score(math.inf), "cap: expected a finite number > 0"),
        (lambda: modifiers.alibi_score(np.ones(3)), "slopes: expected dtype float32, got float64"),
        (
            lambda: modifiers.alibi_score(np.ones((1, 2, 3), np.float32)),
            "slopes: expected 1-D or 2-D, got 3-D",
        ),
        (
            lambda: modifiers.relative_bias_score(np.ones((2, 4), np.float32)),
            "table: expected an odd number of distances (2 R + 1), got 4",
        ),
        (
            lambda: modifiers.document_mask([0, 1]),
            "doc_ids: expected a numpy or cupy array, got list",
        ),
        (
            lambda: modifiers.document_mask(np.ones(3, np.int32), np.ones((1, 3), np.int32)),
            "kv_doc_ids: expected 1-D, got 2-D",
        ),
        (lambda: modifiers.chunked_mask(0), "chunk: expected an int >= 1, got 0"),
        (lambda: modifiers.chunked_mask(4, causal=1), "causal: expected a bool, got int"),
        (lambda: modifiers.prefix_lm_mask(-1), "prefix_len: expected an int >= 0, got -1"),
        (lambda: modifiers.and_masks(), "masks: expected one or more MaskMod objects"),
        (lambda: modifiers.or_masks(modifiers.softcap_score(1.0)), "masks: expected one or more"),
    ],
)
def test_bad_factory_arguments(make, problem):
    assert problem in _error(make)


def test_helpers_run_on_scalars_and_arrays():
    assert where(True, 1.0, 2.0) == 1.0 and np.isscalar(where(False, 1.0, 2.0))
    assert np.array_equal(where(np.array([True, False]), 1, 2), [1, 2])
    assert tanh(0.5) == pytest.approx(math.tanh(0.5)) and exp(1.0) == pytest.approx(math.e)
    assert log(math.e) == pytest.approx(1.0) and sqrt(2.25) == 1.5
    assert abs(-3) == 3 and minimum(2.0, math.nan) == 2.0 and maximum(math.nan, 3.0) == 3.0


# ------------------------------------------------------------------ in the attention calls


def _attention_inputs(rng, batch=2, heads=4, kv_heads=2, q_len=37, kv_len=45, head_dim=16):
    q = rng.standard_normal((batch, heads, q_len, head_dim)).astype(np.float32)
    k, v = (
        rng.standard_normal((batch, kv_heads, kv_len, head_dim)).astype(np.float32) for _ in "kv"
    )
    dout = rng.standard_normal(q.shape).astype(np.float32)
    return q, k, v, dout


def _cpu_and_oracle(q, k, v, dout, causal=False, **mods):
    import cuflash
    from cuflash.reference import attention_reference, attention_reference_grad

    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    out, vjp = cuflash.flash_attention_vjp(q, k, v, heads, kv_heads, head_dim, causal, **mods)
    grads = vjp(dout)
    host = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = attention_reference(*host[:3], causal, **mods)
    ref_grads = attention_reference_grad(host[3], *host[:3], causal, **mods)
    return (out, vjp.lse, *grads), (ref_out, ref_lse, *ref_grads)


def _assert_close(got, want, bound=2e-5):
    for g, w in zip(got, want):
        assert np.all(np.isfinite(g) | np.isneginf(w)), "NaN or inf where the oracle is finite"
        live = np.isfinite(w)
        err = np.linalg.norm((g[live] - w[live]).astype(np.float64)) / max(
            np.linalg.norm(w[live]), 1e-30
        )
        assert err <= bound, err


@pytest.mark.parametrize("causal", [False, True])
def test_user_softcap_and_alibi_equal_the_built_ins(causal, rng):
    """The same functions written as user modifiers give the built-ins' results."""
    import cuflash

    q, k, v, dout = _attention_inputs(rng)
    slopes = rng.uniform(0.1, 1.0, 4).astype(np.float32)
    offset = k.shape[2] - q.shape[2]
    for built_in, mod in (
        (dict(softcap=2.0), modifiers.softcap_score(2.0)),
        (dict(alibi_slopes=slopes), modifiers.alibi_score(slopes, offset)),
    ):
        args = (q, k, v, 4, 2, 16, causal)
        want_out, want_lse = cuflash.flash_attention_fwd(*args, **built_in)
        got_out, got_lse = cuflash.flash_attention_fwd(*args, score_mod=mod)
        np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5)
        want = cuflash.flash_attention_bwd(
            dout, *args[:3], want_out, want_lse, *args[3:], **built_in
        )
        got = cuflash.flash_attention_bwd(
            dout, *args[:3], got_out, got_lse, *args[3:], score_mod=mod
        )
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_document_mask_is_each_document_alone(rng):
    """Causal attention inside each of the packed documents equals one causal call per
    document; the CPU path and the oracle agree, gradients too."""
    from cuflash.reference import attention_reference

    lengths = [9, 1, 17, 13]
    doc = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    total = doc.size
    q, k, v, dout = _attention_inputs(rng, batch=1, q_len=total, kv_len=total)
    mask = modifiers.and_masks(modifiers.document_mask(doc), modifiers.causal_mask())
    got, want = _cpu_and_oracle(q, k, v, dout, mask_mod=mask)
    _assert_close(got, want)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        alone, _ = attention_reference(*(x[:, :, rows].astype(np.float64) for x in (q, k, v)), True)
        np.testing.assert_allclose(want[0][:, :, rows], alone, rtol=1e-12, atol=1e-12)
        start += length


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: dict(mask_mod=modifiers.prefix_lm_mask(11)),
        lambda rng: dict(mask_mod=modifiers.chunked_mask(8)),
        lambda rng: dict(
            score_mod=modifiers.relative_bias_score(rng.standard_normal((4, 9)).astype(np.float32))
        ),
        lambda rng: dict(
            score_mod=modifiers.softcap_score(3.0),
            mask_mod=modifiers.chunked_mask(16, causal=False),
        ),
    ],
    ids=["prefix-lm", "chunked", "relative-bias", "softcap-chunked"],
)
def test_cpu_path_matches_the_oracle(make, rng):
    q, k, v, dout = _attention_inputs(rng, q_len=40, kv_len=40)
    got, want = _cpu_and_oracle(q, k, v, dout, **make(rng))
    _assert_close(got, want)


def test_oracle_gradients_follow_finite_differences(rng):
    """The oracle's gradient with a score function (its derivative chained in) against
    central differences of its forward, in float64."""
    from cuflash.reference import attention_reference, attention_reference_grad

    table = rng.standard_normal((2, 11)).astype(np.float32)

    def capped_with_bias(score, b, h, q_idx, kv_idx):
        return 3.0 * modifiers.tanh(score / 3.0) + table[h, q_idx - kv_idx + 5]

    mod = modifiers.ScoreMod(capped_with_bias)
    q, k, v, dout = (
        x.astype(np.float64)
        for x in _attention_inputs(rng, batch=1, heads=2, kv_heads=2, q_len=6, kv_len=6, head_dim=4)
    )
    grads = attention_reference_grad(dout, q, k, v, score_mod=mod)
    step = 1e-6
    for which, grad in zip(range(3), grads):
        arrays = [q, k, v]
        index = tuple(rng.integers(0, s) for s in arrays[which].shape)
        plus, minus = ([a.copy() for a in arrays] for _ in "pm")
        plus[which][index] += step
        minus[which][index] -= step
        numeric = (
            (
                attention_reference(*plus, score_mod=mod)[0]
                - attention_reference(*minus, score_mod=mod)[0]
            )
            * dout
        ).sum() / (2 * step)
        assert abs(numeric - grad[index]) <= 1e-6 * max(1.0, abs(numeric)), (which, index)


def test_modifier_arguments_are_checked(rng):
    import cuflash

    q, k, v, _ = _attention_inputs(rng)
    with pytest.raises(
        InvalidArgumentError, match="score_mod: expected a cuflash.modifiers.ScoreMod, got MaskMod"
    ):
        cuflash.flash_attention_fwd(q, k, v, 4, 2, 16, score_mod=modifiers.causal_mask())
    narrow = rng.standard_normal((4, 3)).astype(np.float32)

    def too_narrow(score, b, h, q_idx, kv_idx):
        return score + narrow[h, kv_idx]

    with pytest.raises(InvalidArgumentError, match="indices never wrap"):
        cuflash.flash_attention_fwd(q, k, v, 4, 2, 16, score_mod=modifiers.ScoreMod(too_narrow))
