// Weighted mean of model rows on the GPU (the projection P_H of DESIGN.md §4/§5):
//   out[j] = Σ_r w[i_r]·θ[i_r, j] / wsum,  i_r = rows[r] (or r),  sums in float64.
// Memory-bound: every selected row of θ is read once. Two passes, no atomics, so the result is
// bitwise deterministic:
//   1. partial[c, j] = Σ_{r in chunk c} w[i_r]·θ[i_r, j], rows in order: grid (column tiles of
//      kAvgThreads columns) × (chunks of chunk_rows rows), one column per thread (consecutive
//      threads read consecutive θ[i, j]: coalesced), several rows' loads in flight per thread.
//   2. out[j] = (Σ_c partial[c, j], a fixed split over kSumLanes lanes summed in lane order) / wsum.
// The chunk size depends on R only, never on the device, so the summation order is fixed.
// The caller (pflcore/backends/cuda.py) checks the values: rows are clamped into [0, M) before
// the launch, the weights and wsum > 0 are screened on the device, and a NaN or inf in a
// selected row shows as a non-finite output.
// average_fused (PFLCORE_CUDA_AVERAGE=fused) does that screen in the two kernels instead of in
// ~8 torch ops before them: pass 1 clamps the raw rows and flags one out of range, flags a
// negative or non-finite weight, and (column tile 0) sums each chunk's weights in row order into
// wpart[chunk]; pass 2 sums wpart in a fixed tree (the divisor), flags wsum <= 0 (or NaN) and a
// non-finite mean. One int32 flag, read back once: the adapter's exact checks run only when set.
// On an H100 the kernels took 119.5 µs at 10⁵ × 610 (69% of the copy bandwidth), the torch
// screen and check around them 327 µs.

#include <cuda_runtime.h>

#include <cstdint>

namespace pflcore::cuda {
namespace {

constexpr int kAvgThreads = 128;        // columns of a block tile; rows staged per step
constexpr int kAvgUnroll = 8;           // rows whose loads a thread has in flight at once
constexpr int64_t kChunkRows = 128;     // rows of a chunk while there are at most kMaxChunks
constexpr int64_t kMaxChunks = 2048;    // bounds pass 2's work and the scratch: R·d/chunk doubles
constexpr int kSumCols = 32;            // pass 2: columns of a block (one warp wide)
constexpr int kSumLanes = 32;           // pass 2: threads that split one column's chunks (1,024 a block)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of a chunk for R rows: kChunkRows (several thousand blocks at R = 1e5, d = 610), more
// when that would make more than kMaxChunks chunks.
int64_t chunk_rows_of(int64_t R) {
    const int64_t rows = ceil_div(R, kMaxChunks);
    return rows > kChunkRows ? rows : kChunkRows;
}

int64_t num_chunks(int64_t R) { return R > 0 ? ceil_div(R, chunk_rows_of(R)) : 0; }

// partial[blockIdx.y, j] = Σ_{r in chunk blockIdx.y} w[i_r]·θ[i_r, j] for the block's columns.
template <typename T>
__global__ void __launch_bounds__(kAvgThreads)
average_partial_kernel(const T* __restrict__ theta,        // [M, d]
                       const T* __restrict__ weights,      // [M]
                       const int64_t* __restrict__ rows,   // [R] indices in [0, M) (screened: any), or null: r
                       int64_t R, int64_t d, int64_t chunk_rows,
                       double* __restrict__ partial,       // [gridDim.y, d]
                       int64_t M,                          // screened only: rows of theta
                       double* __restrict__ wpart,         // [gridDim.y] the chunk's weight sum, or null: no screen
                       int32_t* __restrict__ flag)         // [1] ORed with 1 on a fault (screened only)
{
    // The rows of one step and their weights, loaded once per block (not once per thread): the
    // address of a θ load then needs no dependent global load of rows[r].
    __shared__ int64_t row_of[kAvgThreads];
    __shared__ double weight_of[kAvgThreads];
    const int64_t j = int64_t(blockIdx.x) * kAvgThreads + threadIdx.x;
    const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
    const int64_t r1 = r0 + chunk_rows < R ? r0 + chunk_rows : R;
    const bool screen = wpart != nullptr && blockIdx.x == 0;  // one column tile screens each chunk
    double acc = 0.0, wacc = 0.0;  // wacc: thread 0 of a screening block
    bool bad = false;
    for (int64_t s = r0; s < r1; s += kAvgThreads) {
        const int n = r1 - s < kAvgThreads ? int(r1 - s) : kAvgThreads;  // rows of this step
        if (threadIdx.x < n) {
            int64_t i = rows ? rows[s + threadIdx.x] : s + threadIdx.x;
            if (wpart) {  // raw rows: clamped, so that a bad index reads a valid row (and is flagged)
                bad |= i < 0 || i >= M;
                i = i < 0 ? 0 : i >= M ? M - 1 : i;
            }
            row_of[threadIdx.x] = i;
            const T w = weights[i];
            weight_of[threadIdx.x] = double(w);
            if (screen) bad |= !(w >= T(0)) || !isfinite(w);  // NaN fails w >= 0
        }
        __syncthreads();
        if (screen && threadIdx.x == 0)
            for (int q = 0; q < n; ++q) wacc += weight_of[q];  // row order: a fixed sum
        if (j < d) {
            int q = 0;
            for (; q + kAvgUnroll <= n; q += kAvgUnroll) {
                T v[kAvgUnroll];  // all loads first, then the adds in row order
#pragma unroll
                for (int u = 0; u < kAvgUnroll; ++u) v[u] = theta[row_of[q + u] * d + j];
#pragma unroll
                for (int u = 0; u < kAvgUnroll; ++u) acc += weight_of[q + u] * double(v[u]);
            }
            for (; q < n; ++q) acc += weight_of[q] * double(theta[row_of[q] * d + j]);
        }
        __syncthreads();  // row_of / weight_of are rewritten by the next step
    }
    if (j < d) partial[int64_t(blockIdx.y) * d + j] = acc;
    if (screen && threadIdx.x == 0) wpart[blockIdx.y] = wacc;
    if (wpart && __syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

// out[j] = Σ_c partial[c, j] / wsum: thread (x, y) sums chunks c = y, y + kSumLanes, ... of
// column j in order, then lane y = 0 adds the lanes' sums in lane order.
template <typename T>
__global__ void __launch_bounds__(kSumCols * kSumLanes)
average_finish_kernel(const double* __restrict__ partial,  // [nchunks, d]
                      int64_t nchunks, int64_t d,
                      const double* __restrict__ wsum,     // [1] Σ of the selected weights, or null: from wpart
                      T* __restrict__ out,                 // [d]
                      const double* __restrict__ wpart,    // [nchunks] chunks' weight sums (screened), or null
                      int32_t* __restrict__ flag)          // [1] ORed with 1: wsum <= 0, a non-finite mean
{
    __shared__ double lane_sums[kSumLanes][kSumCols];
    __shared__ double divisor;
    if (wpart) {
        // warp 0 (threadIdx.y == 0) sums the chunks' weights: lane x takes chunks x, x + 32, ... in
        // order, then a fixed xor tree; every block gets the same bits
        if (threadIdx.y == 0) {
            double w = 0.0;
            for (int64_t c = threadIdx.x; c < nchunks; c += kSumCols) w += wpart[c];
#pragma unroll
            for (int off = kSumCols / 2; off > 0; off >>= 1) w += __shfl_xor_sync(0xffffffffu, w, off);
            if (threadIdx.x == 0) divisor = w;
        }
    } else if (threadIdx.x == 0 && threadIdx.y == 0) {
        divisor = wsum[0];
    }
    const int64_t j = int64_t(blockIdx.x) * kSumCols + threadIdx.x;
    double acc = 0.0;
    if (j < d) {
#pragma unroll 4
        for (int64_t c = threadIdx.y; c < nchunks; c += kSumLanes) acc += partial[c * d + j];
    }
    lane_sums[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    bool bad = false;
    if (threadIdx.y == 0 && j < d) {
        double s = 0.0;
        for (int y = 0; y < kSumLanes; ++y) s += lane_sums[y][threadIdx.x];
        const T v = T(s / divisor);
        out[j] = v;
        bad = !isfinite(v) || !(divisor > 0.0);  // NaN fails divisor > 0
    }
    if (wpart && threadIdx.y == 0 && __any_sync(0xffffffffu, bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

}  // namespace

// float64 values of average's scratch (the chunks' partial sums) for R rows of d columns.
int64_t average_scratch(int64_t R, int64_t d) { return num_chunks(R) * d; }

// *host <- *flag after the work queued on `stream` (csrc/cuda/screen.cu).
cudaError_t read_flag(const int32_t* flag, int* host, cudaStream_t stream);

// float64 values of average_fused's scratch: the partial sums and each chunk's weight sum.
int64_t average_fused_scratch(int64_t R, int64_t d) { return num_chunks(R) * (d + 1); }

namespace {
template <typename T>
cudaError_t launch_average(const void* theta, const void* weights, const int64_t* rows, int64_t M, int64_t R,
                           int64_t d, const double* wsum, void* out, double* scratch, double* wpart, int32_t* flag,
                           cudaStream_t stream) {
    const int64_t chunk_rows = chunk_rows_of(R);
    const int64_t nchunks = num_chunks(R);  // <= kMaxChunks: within gridDim.y's 65535
    const int64_t tiles = ceil_div(d, kAvgThreads);
    const int64_t sum_blocks = ceil_div(d, kSumCols);
    if (tiles > 0x7fffffff || sum_blocks > 0x7fffffff || nchunks > 65535) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(nchunks));
    average_partial_kernel<T><<<grid, kAvgThreads, 0, stream>>>(static_cast<const T*>(theta),
                                                                 static_cast<const T*>(weights), rows, R, d,
                                                                 chunk_rows, scratch, M, wpart, flag);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    average_finish_kernel<T><<<static_cast<unsigned>(sum_blocks), dim3(kSumCols, kSumLanes), 0, stream>>>(
        scratch, nchunks, d, wsum, static_cast<T*>(out), wpart, flag);
    return cudaGetLastError();
}
}  // namespace

template <typename T>
cudaError_t average(const void* theta, const void* weights, const int64_t* rows, int64_t R, int64_t d,
                    const double* wsum, void* out, double* scratch, cudaStream_t stream) {
    if (R <= 0 || d <= 0 || !scratch || !wsum) return cudaErrorInvalidValue;  // the adapter never launches these
    return launch_average<T>(theta, weights, rows, 0, R, d, wsum, out, scratch, nullptr, nullptr, stream);
}

// The screened average: *host_flag <- nonzero when the call may hold a fault. rows: raw indices
// (or null with R = M); scratch: average_fused_scratch(R, d) values; flag: [1] int32 device
// memory. Queues a memset, the two kernels and a copy, then waits for the stream.
template <typename T>
cudaError_t average_fused(const void* theta, const void* weights, const int64_t* rows, int64_t M, int64_t R,
                          int64_t d, void* out, double* scratch, int32_t* flag, int* host_flag, cudaStream_t stream) {
    if (R <= 0 || d <= 0 || M <= 0 || !scratch || !flag) return cudaErrorInvalidValue;
    cudaError_t err = cudaMemsetAsync(flag, 0, sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
    double* wpart = scratch + num_chunks(R) * d;
    err = launch_average<T>(theta, weights, rows, M, R, d, nullptr, out, scratch, wpart, flag, stream);
    if (err != cudaSuccess) return err;
    return read_flag(flag, host_flag, stream);
}

template cudaError_t average<float>(const void*, const void*, const int64_t*, int64_t, int64_t, const double*,
                                    void*, double*, cudaStream_t);
template cudaError_t average<double>(const void*, const void*, const int64_t*, int64_t, int64_t, const double*,
                                     void*, double*, cudaStream_t);
template cudaError_t average_fused<float>(const void*, const void*, const int64_t*, int64_t, int64_t, int64_t, void*,
                                          double*, int32_t*, int*, cudaStream_t);
template cudaError_t average_fused<double>(const void*, const void*, const int64_t*, int64_t, int64_t, int64_t,
                                           void*, double*, int32_t*, int*, cudaStream_t);

}  // namespace pflcore::cuda
