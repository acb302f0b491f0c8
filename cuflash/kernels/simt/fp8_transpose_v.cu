// The FP8 forward's V^T (the FP8 page): an e4m3 wgmma reads both operands K-major,
// so P V needs v's keys along the rows of shared memory. This pass writes
// vt[b, h, d, p] = v[b, h, key(p), d] for every key position p < keys (zeros at keys
// past kv_len and at rows past head_dim_v), where within each 16 keys
// key(4 t + i) = 2 t + i for i < 2 and 8 + 2 t + i - 2 for i >= 2: the columns of
// an S accumulator a thread holds (2 t, 2 t + 1 of two n8 tiles) are then the four
// consecutive k of the e4m3 A operand it passes to P V (sm90/forward_wgmma_ws.cuh).
// A block moves 64 keys by 64 rows through shared memory: 16-byte loads along
// v's rows, 4-byte stores along vt's.
#include "common/params.cuh"

namespace cuflash {

// The key (within its 16) whose column lands at position r of vt.
__device__ __forceinline__ int fp8_permuted_key(int r) {
    const int t = r >> 2, i = r & 3;
    return i < 2 ? 2 * t + i : 8 + 2 * t + i - 2;
}

__global__ void __launch_bounds__(256)
    fp8_transpose_v(CUFLASH_PARAMETERS(CUFLASH_FP8_TRANSPOSE_V_PARAMS, e4m3_t)) {
    constexpr int TILE = 64, PITCH = TILE + 16;  // bytes a row of the tile (16-byte aligned)
    __shared__ uint4 tile_chunks[TILE * PITCH / 16];
    unsigned char* const tile = reinterpret_cast<unsigned char*>(tile_chunks);
    CUFLASH_STRIDES_OF(v);
    const int n0 = blockIdx.x * TILE, d0 = blockIdx.y * TILE;
    const int b = blockIdx.z / kv_heads, h = blockIdx.z % kv_heads;
    {  // tile[key][column]: v's rows n0 .. n0 + 63, columns d0 .. d0 + 63
        const int key = threadIdx.x >> 2, column = d0 + (threadIdx.x & 3) * 16;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (n0 + key < kv_len && column < head_dim_v)
            x = *reinterpret_cast<const uint4*>(v + offset_of(v_st, b, h, n0 + key) + column);
        *reinterpret_cast<uint4*>(tile + key * PITCH + (threadIdx.x & 3) * 16) = x;
    }
    __syncthreads();
    e4m3_t* const head = vt + (static_cast<long long>(b) * kv_heads + h) * rows * keys;
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {  // 64 rows of 16 words each
        const int w = threadIdx.x + 256 * pass, row = w >> 4, p = (w & 15) * 4;
        if (d0 + row >= rows || n0 + p >= keys) continue;
        unsigned word = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = ((p + i) & ~15) + fp8_permuted_key((p + i) & 15);
            word |= static_cast<unsigned>(tile[key * PITCH + row]) << (8 * i);
        }
        *reinterpret_cast<unsigned*>(head + static_cast<long long>(d0 + row) * keys + n0 + p) =
            word;
    }
}

}  // namespace cuflash
