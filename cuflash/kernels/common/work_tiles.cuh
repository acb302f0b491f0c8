// The work tiles of the Hopper kernels' blocks (sm90/forward_wgmma_ws.cuh, whose
// record has the design, and sm90/backward_wgmma_ws.cuh): one a block, or a
// persistent grid's walk over every tile of the launch.
#pragma once

namespace cuflash {

// A work tile: tile `tile` (of query rows forward, of keys backward) of head h (the
// forward's query head, the backward's KV head) of batch entry or sequence z.
struct WorkTile {
    int tile, h, z;
};

// The block's work tile of round `round`; false past the last. One round a block
// (the grid's x, y and z), or PERSISTENT: round r's block i takes tile r * gridDim.x
// + i of tiles_per_head * heads * entries, i counted from the grid's end every other
// round (a causal head's long tiles and short ones alternate on a block, and the
// blocks of a round read the same heads). Within a head the longest tiles first under
// a causal mask: the last query tiles (forward), the first key tiles (ASCENDING,
// backward).
// PERSISTENT with a `schedule` (the plan's, cuflash/gpu/schedules.py; null: the walk
// above): block i takes tiles schedule[gridDim.x + 1 + schedule[i] + round] while
// schedule[i] + round < schedule[i + 1], each the linear index (entry * heads + h) *
// tiles_per_head + tile, the tile itself (the plan has put each block's longest
// first). An index or offset outside the launch's tiles ends the block's walk.
template <bool PERSISTENT, bool ASCENDING>
__device__ __forceinline__ bool work_tile(int round, int tiles_per_head, int work_tiles, int heads,
                                          WorkTile& w, const int* schedule = nullptr) {
    if (PERSISTENT && schedule != nullptr) {
        const int first = schedule[blockIdx.x], last = schedule[blockIdx.x + 1];
        if (first < 0 || last > work_tiles || first + round >= last) return false;
        const int index = schedule[gridDim.x + 1 + first + round];
        if (index < 0 || index >= work_tiles) return false;
        const int head_entry = index / tiles_per_head;
        w = {index - head_entry * tiles_per_head, head_entry % heads, head_entry / heads};
        return true;
    }
    if constexpr (!PERSISTENT) {
        w = {static_cast<int>(ASCENDING ? blockIdx.x : gridDim.x - 1 - blockIdx.x),
             static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
        return round == 0;
    } else {
        const int slot = round & 1 ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
        const long long i = static_cast<long long>(round) * gridDim.x + slot;
        if (i >= work_tiles) return false;
        const int index = static_cast<int>(i), head_entry = index / tiles_per_head;
        const int within = index - head_entry * tiles_per_head;
        w = {ASCENDING ? within : tiles_per_head - 1 - within, head_entry % heads,
             head_entry / heads};
        return true;
    }
}

}  // namespace cuflash
