// The classification pass of a block mask (cuflash.block_mask): for every
// cell of 16 query rows x 16 keys of one (batch entry, head), whether the
// user's mask function (CUFLASH_USER_MASK_MOD, compiled in before this file)
// is true on any element of the cell inside the sequence, and whether on all
// of them. The kernels' tiles are whole cells; the host folds the cells into
// each kernel's tiles.
#include "common/common.cuh"

namespace cuflash {

constexpr int kMaskCell = 16;
constexpr int kCellsPerBlock = 8;  // along the keys

// grid: (ceil(kv_cells / 8), q_cells, batch entries x heads); 256 threads, one
// element of the cell each. any_visible, all_visible: [entries x heads,
// q_cells, kv_cells] bytes.
__global__ void __launch_bounds__(256)
    classify_mask_cells(const ModifierArrays arrays, unsigned char* __restrict__ any_visible,
                        unsigned char* __restrict__ all_visible, int heads, int q_len, int kv_len,
                        int q_cells, int kv_cells) {
    const int entry = blockIdx.z, b = entry / heads, h = entry - b * heads;
    const int i = blockIdx.y * kMaskCell + threadIdx.x / kMaskCell;
    const CUFLASH_USER_MASK_MOD mask_mod{};
    for (int cell = 0; cell < kCellsPerBlock; ++cell) {
        const int kv_cell = blockIdx.x * kCellsPerBlock + cell;
        if (kv_cell >= kv_cells) break;  // uniform over the block
        const int j = kv_cell * kMaskCell + threadIdx.x % kMaskCell;
        const bool inside = i < q_len && j < kv_len;
        const bool seen = inside && mask_mod(b, h, i, j, arrays);
        const int any = __syncthreads_or(seen);
        const int all = __syncthreads_and(!inside || seen);
        if (threadIdx.x == 0) {
            const long long at =
                (static_cast<long long>(entry) * q_cells + blockIdx.y) * kv_cells + kv_cell;
            any_visible[at] = static_cast<unsigned char>(any != 0);
            all_visible[at] = static_cast<unsigned char>(all != 0);
        }
    }
}

}  // namespace cuflash
