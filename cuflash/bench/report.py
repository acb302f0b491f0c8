"""The Markdown report printed on stdout: the environment line, the method, every table."""

from .cases import DIRECTIONS
from .decode import format_decode
from .dense import format_throughput_table
from .first_call import format_first_call
from .fp8 import format_fp8
from .head_dims import format_head_dim_sweep
from .memory import format_memory
from .mla_decode import format_mla_decode
from .small_calls import format_small_calls
from .value_dims import format_value_dims
from .varlen import format_varlen

METHOD_LINE = (
    "Median GPU time (CUDA events) of calls rotating among input sets larger than "
    "the L2 cache; TFLOP/s = FLOPs / median, forward 4*B*H*S*S*D (halved when "
    "causal), backward 2.5x forward."
)


def format_environment(env):
    """One Markdown line naming the GPU and the versions that matter."""
    return (
        f"GPU: {env.get('gpu')} (driver {env.get('driver')}, CUDA runtime "
        f"{env.get('cuda_runtime')}); cuflash {env.get('cuflash')}, CuPy {env.get('cupy')}, "
        f"torch {env.get('torch')}, cuDNN {env.get('cudnn')}"
    )


def format_report(report, measurements):
    """The whole Markdown report printed on stdout."""
    parts = ["## cuflash benchmark", "", format_environment(report["environment"]), "", METHOD_LINE]
    if report.get("settings", {}).get("allow_tf32"):
        parts += ["", "cuflash ran with `allow_tf32=True`: float32 products in TF32."]
    for dtype in dict.fromkeys(m.case.dtype for m in measurements):
        for direction in DIRECTIONS:
            parts += ["", format_throughput_table(measurements, dtype, direction)]
    if report.get("small_calls"):
        parts += ["", format_small_calls(report["small_calls"])]
    if report.get("decode"):
        parts += ["", format_decode(report["decode"])]
    if report.get("varlen"):
        parts += ["", format_varlen(report["varlen"])]
    if report.get("head_dim_sweep"):
        parts += ["", format_head_dim_sweep(report["head_dim_sweep"])]
    if report.get("head_dim_v"):
        parts += ["", format_value_dims(report["head_dim_v"])]
    if report.get("mla_decode"):
        parts += ["", format_mla_decode(report["mla_decode"])]
    if report.get("fp8"):
        parts += ["", format_fp8(report["fp8"])]
    if report.get("first_call"):
        parts += ["", format_first_call(report["first_call"])]
    if report.get("memory"):
        parts += ["", format_memory(report["memory"])]
    return "\n".join(parts)
