"""Write cuflash/kernels/common/wgmma_ops.cuh: the wgmma.mma_async wrappers.

Each wrapper lists every accumulator register as an asm operand, which C++
cannot generate; this script writes them out. Run it after changing the
shapes below: python scripts/gen_wgmma_ops.py
"""

from pathlib import Path

TYPES = {"bf16_t": "bf16", "half_t": "f16"}
N_SS = (32, 64, 128, 176)  # S = Q K^T: N = keys per tile (32: half a backward query tile;
# 176: the forward's plain 128 class, sm90/forward_wgmma_ws.cuh)
N_RS = tuple(range(16, 257, 16))  # O += P V, dV += P^T dO, dK += dS^T Q: N = head_dim
# rounded up to 16 (every head_dim on its exact width)
N_SS_MN = (64, 128)  # dQ = dS K in the backward: N = 64 or 128 columns of head_dim
N_SS_NB = (16, 32, 48, 64, 80, 96, 112, 128, 144)  # dV, dK from P^T, dS^T in shared memory:
# N = a warpgroup's columns past head_dim 128 (sm90/backward_wgmma.cuh's best_split), or
# dK's head dim in backward_wgmma_ws (16: D <= 16)
# e4m3 (FP8) operands, both K-major (the instruction takes no transposes), k32 a step:
N_FP8_SS = (128,)  # S = Q K^T: keys per tile (sm90/forward_wgmma_ws.cuh's FP8 roles)
N_FP8_RS = tuple(range(16, 257, 16))  # O += P V^T: N = v's head dim rounded up to 16
OUT = Path(__file__).resolve().parent.parent / "cuflash" / "kernels" / "common" / "wgmma_ops.cuh"


def operands(n):
    return ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(n // 2))


def regs(first, count):
    return ", ".join(f"%{first + i}" for i in range(count))


def ss(ptx_type, n):
    acc = n // 2
    return f"""    // D (64 x {n}) += A (64 x 16, shared memory) B (16 x {n}, shared memory), both K-major.
    static __device__ __forceinline__ void ss(float (&d)[{n // 8}][4], unsigned long long a,
                                              unsigned long long b, int accumulate) {{
        asm volatile(
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} "
            "{{{regs(0, acc)}}}, %{acc}, %{acc + 1}, p, 1, 1, 0, 0;\\n}}\\n"
            : {operands(n)}
            : "l"(a), "l"(b), "r"(accumulate));
    }}
"""


def ss_mn(ptx_type, n):
    acc = n // 2
    return f"""    // D (64 x {n}) += A (64 x 16, shared memory, M-major) B (16 x {n}, shared memory,
    // N-major): both operands transposed against ::ss.
    static __device__ __forceinline__ void ss_mn(float (&d)[{n // 8}][4], unsigned long long a,
                                                 unsigned long long b, int accumulate) {{
        asm volatile(
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} "
            "{{{regs(0, acc)}}}, %{acc}, %{acc + 1}, p, 1, 1, 1, 1;\\n}}\\n"
            : {operands(n)}
            : "l"(a), "l"(b), "r"(accumulate));
    }}
"""


def ss_nb(ptx_type, n):
    acc = n // 2
    return f"""    // D (64 x {n}) += A (64 x 16, shared memory, K-major) B (16 x {n}, shared memory,
    // N-major).
    static __device__ __forceinline__ void ss_nb(float (&d)[{n // 8}][4], unsigned long long a,
                                                 unsigned long long b, int accumulate) {{
        asm volatile(
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} "
            "{{{regs(0, acc)}}}, %{acc}, %{acc + 1}, p, 1, 1, 0, 1;\\n}}\\n"
            : {operands(n)}
            : "l"(a), "l"(b), "r"(accumulate));
    }}
"""


def rs(ptx_type, n):
    acc = n // 2
    return f"""    // D (64 x {n}) += A (64 x 16, registers) B (16 x {n}, shared memory, N-major).
    static __device__ __forceinline__ void rs(float (&d)[{n // 8}][4], const unsigned (&a)[4],
                                              unsigned long long b, int accumulate) {{
        asm volatile(
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 5}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} "
            "{{{regs(0, acc)}}}, {{{regs(acc, 4)}}}, %{acc + 4}, p, 1, 1, 1;\\n}}\\n"
            : {operands(n)}
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    }}
"""


def fp8_ss(n):
    acc = n // 2
    return f"""    // D (64 x {n}) += A (64 x 32, shared memory) B (32 x {n}, shared memory), both K-major.
    static __device__ __forceinline__ void ss(float (&d)[{n // 8}][4], unsigned long long a,
                                              unsigned long long b, int accumulate) {{
        asm volatile(
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 2}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 "
            "{{{regs(0, acc)}}}, %{acc}, %{acc + 1}, p, 1, 1;\\n}}\\n"
            : {operands(n)}
            : "l"(a), "l"(b), "r"(accumulate));
    }}
"""


def fp8_rs(n):
    acc = n // 2
    return f"""    // D (64 x {n}) += A (64 x 32, registers: four e4m3 a register) B (32 x {n}, shared
    // memory, K-major).
    static __device__ __forceinline__ void rs(float (&d)[{n // 8}][4], const unsigned (&a)[4],
                                              unsigned long long b, int accumulate) {{
        asm volatile(
            "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc + 5}, 0;\\n"
            "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 "
            "{{{regs(0, acc)}}}, {{{regs(acc, 4)}}}, %{acc + 4}, p, 1, 1;\\n}}\\n"
            : {operands(n)}
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    }}
"""


def main():
    parts = [
        """// Generated by scripts/gen_wgmma_ops.py: do not edit by hand.
//
// wgmma.mma_async (sm_90a) with float32 accumulators for one warpgroup:
// Wgmma<T, N>::ss takes A and B from shared memory through matrix
// descriptors (both K-major), ::ss_mn the same with A M-major and B N-major,
// ::ss_nb with A K-major and B N-major; ::rs takes A from registers (the
// mma.sync m16n8k16 A layout, per warp) and B N-major. Wgmma<e4m3_t, N>: k32
// steps, both operands K-major (::rs: A in the mma.sync m16n8k32 8-bit layout,
// four elements a register, the lowest k in the low byte). The accumulator
// d[j][e] is n8 tile j in the mma.sync C layout (e = 0, 1: row g; e = 2, 3:
// row g + 8).
// `accumulate` = 0 overwrites d.
#pragma once
#include "common/common.cuh"

namespace cuflash {

template <typename T, int N> struct Wgmma;
"""
    ]
    for cxx, ptx_type in TYPES.items():
        for n in sorted(set(N_SS) | set(N_RS) | set(N_SS_MN) | set(N_SS_NB)):
            body = (
                (ss(ptx_type, n) if n in N_SS else "")
                + (ss_mn(ptx_type, n) if n in N_SS_MN else "")
                + (ss_nb(ptx_type, n) if n in N_SS_NB else "")
                + (rs(ptx_type, n) if n in N_RS else "")
            )
            parts.append(f"\ntemplate <> struct Wgmma<{cxx}, {n}> {{\n{body}}};\n")
    for n in sorted(set(N_FP8_SS) | set(N_FP8_RS)):
        body = (fp8_ss(n) if n in N_FP8_SS else "") + (fp8_rs(n) if n in N_FP8_RS else "")
        parts.append(f"\ntemplate <> struct Wgmma<e4m3_t, {n}> {{\n{body}}};\n")
    parts.append("\n}  // namespace cuflash\n")
    OUT.write_text("".join(parts))


if __name__ == "__main__":
    main()
