// Counter-based minibatch sampling on the GPU (DESIGN.md §4): the hash of pflcore/hash.h, the
// same function the native core and the torch reference compute, so a draw is bitwise the same
// on every backend. One thread per drawn index; nothing is read but the clients' offsets.
//
// out[r, s, j] = offsets[i] + (sample_hash(seed, counter, first_id + i, s, j) · n_i) >> 32,
// i = clients[r] (r when clients is null), n_i = offsets[i + 1] − offsets[i].
// The adapter guarantees valid clients and offsets (n_i >= 1) before the launch.

#include <cuda_runtime.h>

#include <cstdint>

#include "pflcore/hash.h"

namespace pflcore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535LL * 16;  // grid-stride beyond ~2.7e8 draws

__global__ void __launch_bounds__(kThreads)
sample_batches_kernel(const int64_t* __restrict__ offsets,  // [m + 1] the clients' row ranges
                      const int64_t* __restrict__ clients,  // [R] local client of each output row, or null: r
                      int64_t first_id,                     // global id of local client 0
                      int64_t R, int64_t steps, int64_t B,
                      uint32_t seed, uint32_t counter,
                      int32_t* __restrict__ out)            // [R, steps, B] absolute row indices
{
    const int64_t total = R * steps * B;
    for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < total; e += int64_t(gridDim.x) * kThreads) {
        const int64_t j = e % B;
        const int64_t rs = e / B;
        const int64_t s = rs % steps;
        const int64_t r = rs / steps;
        const int64_t i = clients ? clients[r] : r;
        const int64_t lo = offsets[i];
        const int64_t n = offsets[i + 1] - lo;
        const uint32_t h = sample_hash(seed, counter, static_cast<uint32_t>(first_id + i), static_cast<uint32_t>(s),
                                       static_cast<uint32_t>(j));
        out[e] = static_cast<int32_t>(lo + scale_to(h, n));
    }
}

}  // namespace

cudaError_t sample_batches(const int64_t* offsets, const int64_t* clients, int64_t first_id, int64_t R,
                           int64_t steps, int64_t B, uint32_t seed, uint32_t counter, int32_t* out,
                           cudaStream_t stream) {
    const int64_t total = R * steps * B;
    if (total == 0) return cudaSuccess;
    int64_t grid = (total + kThreads - 1) / kThreads;
    if (grid > kMaxBlocks) grid = kMaxBlocks;
    sample_batches_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(offsets, clients, first_id, R, steps,
                                                                                B, seed, counter, out);
    return cudaGetLastError();
}

}  // namespace pflcore::cuda
