"""Property-based tests: random valid configurations against the float64 oracle,
random invalid ones against the validation (CPU path in CI, more on the GPU)."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import DTYPES, Case, cupy, run_and_check

import cuflash

# Draws are a fixed sequence (reproducible CI) unless CUFLASH_FUZZ_RANDOM is set.
FUZZ = settings(
    deadline=None,
    derandomize=not os.environ.get("CUFLASH_FUZZ_RANDOM"),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def cases(draw, max_len=96):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 4]))
    kv_len = draw(st.integers(1, max_len))
    window = draw(
        st.one_of(
            st.just(0),
            st.integers(1, max_len + 8),
            st.tuples(st.integers(-1, max_len), st.integers(-1, max_len)),
        )
    )
    return Case(
        dtype=draw(st.sampled_from(list(DTYPES))),
        batch=draw(st.integers(1, 2)),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        q_len=draw(st.integers(1, max_len)),
        kv_len=kv_len,
        head_dim=8 * draw(st.integers(1, 32)),
        causal=draw(st.booleans()),
        window=window,
        kv_seq_len=draw(st.one_of(st.none(), st.integers(0, kv_len))),
        bshd=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(-2.0, 2.0).filter(lambda x: abs(x) > 1e-3))),
    )


@settings(FUZZ, max_examples=int(os.environ.get("CUFLASH_CPU_FUZZ_EXAMPLES", 60)))
@given(case=cases(), seed=st.integers(0, 2**32 - 1))
def test_cpu_fuzz_against_oracle(case, seed):
    run_and_check(case, np, np.random.default_rng(seed))


@pytest.mark.gpu
# Its draws compile kernels for head dims no other test uses: alone it takes about
# 35 s, beside 14 other workers compiling too it outran the GPU runs' 150 s a test.
@pytest.mark.timeout(600)
@settings(FUZZ, max_examples=int(os.environ.get("CUFLASH_GPU_FUZZ_EXAMPLES", 300)))
@given(
    case=cases(max_len=300),
    seed=st.integers(0, 2**32 - 1),
    deterministic=st.booleans(),
    path=st.sampled_from(["auto", "general"]),
    allow_tf32=st.booleans(),
)
def test_gpu_fuzz_against_oracle(case, seed, deterministic, path, allow_tf32):
    with cuflash.kernel_path(path):
        run_and_check(
            case,
            cupy,
            np.random.default_rng(seed),
            deterministic=deterministic,
            allow_tf32=allow_tf32,
        )


BAD_CHANGES = {
    "num_heads": st.sampled_from([0.5, -1, 3, "4"]),
    "num_kv_heads": st.sampled_from([0, -2, 3, 1.0]),
    "head_dim": st.sampled_from([0, 7, 12, 264, 512]),
    "window_size": st.sampled_from([-3, (-2, 0), (0, -5), (1, 2, 3), 1.5]),
    "kv_seq_len": st.sampled_from([-1, 10**6]),
    "softmax_scale": st.sampled_from([float("nan"), float("inf"), "x"]),
    "causal": st.sampled_from(["yes", None]),
    "allow_tf32": st.sampled_from([1, "true", None]),
    "q_rank": st.just(3),
    "kv_len_mismatch": st.just(1),
    "dtype": st.sampled_from([np.float64, np.int8, np.complex64]),
}


@settings(FUZZ, max_examples=80)
@given(change=st.sampled_from(sorted(BAD_CHANGES)), data=st.data())
def test_invalid_inputs_raise_and_write_nothing(change, data):
    rng = np.random.default_rng(0)
    b, h, hk, s, d = 1, 4, 2, 9, 16
    q = rng.standard_normal((b, h, s, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, s, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, s, d)).astype(np.float32)
    kwargs = dict(
        num_heads=h,
        num_kv_heads=hk,
        head_dim=d,
        causal=False,
        window_size=0,
        kv_seq_len=None,
        softmax_scale=None,
        allow_tf32=False,
    )
    value = data.draw(BAD_CHANGES[change])
    if change == "q_rank":
        q = q[0]
    elif change == "kv_len_mismatch":
        v = v[:, :, :-1]
    elif change == "dtype":
        q, k, v = (a.astype(value) for a in (q, k, v))
    else:
        kwargs[change] = value
    before = [a.copy() for a in (q, k, v)]
    keywords = {name: kwargs.pop(name) for name in ("softmax_scale", "allow_tf32")}
    with pytest.raises(cuflash.InvalidArgumentError):
        cuflash.flash_attention_fwd(q, k, v, *kwargs.values(), **keywords)
    assert all(np.array_equal(a, b_) for a, b_ in zip((q, k, v), before))
