"""Every head_dim class on the tensor cores: the multiples of 8 off the 64/128/256 grid,
16-bit forward and backward (atomic and deterministic) on the default kernels and on the
mma.sync ones, and float32 on the float16 pieces, against the float64 oracle."""

import pytest
from support import Case, cupy, random_inputs, run_and_check

from cuflash import AttentionConfig, dispatch
from cuflash.core import problem
from cuflash.gpu import launch as gpu

pytestmark = pytest.mark.gpu

# Each class's edges and insides (64, 128, 256 are covered by the main grid).
OFF_GRID = (
    8,
    16,
    24,
    32,
    48,
    56,
    72,
    80,
    88,
    104,
    112,
    120,
    136,
    144,
    160,
    176,
    192,
    200,
    224,
    248,
)
# Options rotate over the head dims, so every class meets each of them.
OPTIONS = [
    dict(causal=True),
    dict(heads=8, kv_heads=2, q_len=150, kv_len=97),
    dict(window=(20, 7), q_len=130, kv_len=160),
    dict(kv_seq_len=70, kv_len=100, causal=True),
    dict(bshd=True, heads=4, kv_heads=1, causal=True, q_len=129, kv_len=129),
    dict(q_len=1, kv_len=300),
    dict(window=16, causal=True, q_len=200, kv_len=200),
]


def _cases(dtypes, head_dims):
    return [
        Case(dtype=dtype, head_dim=d, **OPTIONS[(i + j) % len(OPTIONS)])
        for i, d in enumerate(head_dims)
        for j, dtype in enumerate(dtypes)
    ]


SIXTEEN_BIT = _cases(("bfloat16", "float16"), OFF_GRID)
FLOAT32 = _cases(("float32",), (8, 24, 40, 56, 72, 88, 104, 120))
FLOAT32_WIDE = _cases(("float32",), (136, 152, 168, 184, 200, 232, 248))


def _hopper():
    return int(cupy.cuda.Device().compute_capability) == 90


@pytest.mark.parametrize("case", SIXTEEN_BIT, ids=str)
def test_every_head_dim_on_tensor_cores(case, rng, poisoned):
    q, k, v, dout = random_inputs(case, rng, cupy)
    p = problem.forward_problem(q, k, v, AttentionConfig(*case.args, case.kv_seq_len))
    for direction in ("forward", "backward"):
        assert gpu.choose(p, direction, True).instruction in ("wgmma", "mma.sync")
    run_and_check(case, cupy, rng)


@pytest.mark.parametrize("case", SIXTEEN_BIT[::2], ids=str)
def test_every_head_dim_deterministic(case, rng, poisoned):
    run_and_check(case, cupy, rng, deterministic=True)


@pytest.mark.parametrize("case", SIXTEEN_BIT[1::3], ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_every_head_dim_on_mma_sync(case, deterministic, rng, poisoned):
    """The kernels of A100-class GPUs (on an H100/H200 the wgmma ones serve by default)."""
    with dispatch.skip_kernels(
        "forward_wgmma_ws", "forward_wgmma", "backward_wgmma_ws", "backward_wgmma"
    ):
        run_and_check(case, cupy, rng, deterministic=deterministic)


@pytest.mark.parametrize("case", [c for c in SIXTEEN_BIT[::4]], ids=str)
def test_every_head_dim_split_d_backward(case, rng, poisoned):
    with dispatch.skip_kernels("backward_wgmma_ws", "backward_wgmma", "backward_mma_sync"):
        run_and_check(case, cupy, rng)


@pytest.mark.parametrize("case", FLOAT32 + FLOAT32_WIDE, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_float32_every_head_dim_on_pieces(case, deterministic, rng, poisoned):
    """float32 at float32 accuracy on the 16-bit wgmma: up to head_dim 128 the pieces
    kernels, at 136-256 the wide forward and the wide backward (dK and dV, then dQ by its
    own kernel)."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    q, k, v, _ = random_inputs(case, rng, cupy)
    p = problem.forward_problem(q, k, v, AttentionConfig(*case.args, case.kv_seq_len))
    wide = "_wide" if case.head_dim > 128 else ""
    assert gpu.choose(p, "forward", True).name == "forward_float32_pieces" + wide
    assert gpu.choose(p, "backward", True).name == "backward_float32_pieces" + wide
    run_and_check(case, cupy, rng, deterministic=deterministic)
