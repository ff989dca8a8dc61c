// k-means on the GPU: the assignment step (fused with its argmin) and the Lloyd update (a
// segmented reduction).
//
// Math, for every point i (rows of points [N, d], centroids [K, d]):
//   dist(i, k) = sum_j (points[i, j] - centroids[k, j])^2     (direct differences, NOT the
//                ||x||^2 + ||c||^2 - 2 x.c expansion, so equal centroids give equal bits)
//   sqdist[i]  = min_k dist(i, k)
//   labels[i]  = argmin_k dist(i, k), ties to the lowest k; a NaN distance wins like in
//                torch.argmin (the first k whose distance is NaN).
// The N x K distance matrix is never formed: the argmin is fused into the distance loop.
// The update: see kmeans_update below.
//
// Layout: a block is kWarps warps, each warp owns kRows consecutive points. Centroids are
// taken kTile at a time; for each such tile the d axis is walked in chunks of kChunk dims,
// the chunk centroids[k0:k0+kTile, j0:j0+kChunk] is staged in shared memory (16 KiB) and
// read by all warps of the block. Lane l accumulates, for its kRows x kTile (point, centroid)
// pairs, the dims j = l, l+32, l+64, ...; xor-shuffles finish the sums (every lane ends with
// the same bits, and the summation order depends on j only, never on k), then every lane
// updates the running (min, argmin) with k ascending. Float accumulates in float, double in
// double.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace pflcore::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarps = 8;                      // warps per block
constexpr int kThreads = kWarps * kWarpSize;   // threads per block
constexpr int kRows = 4;                       // points per warp
constexpr int kBlockRows = kWarps * kRows;     // points per block
constexpr int kChunk = 256;                    // dims per shared-memory chunk
template <typename T>
constexpr int kTile = sizeof(T) == 4 ? 16 : 8; // centroids per tile: kTile*kChunk*sizeof(T) = 16 KiB

template <typename T>
__global__ void __launch_bounds__(kThreads)
kmeans_assign_kernel(const T* __restrict__ points,     // [N, d]
                     const T* __restrict__ centroids,  // [K, d]
                     int64_t* __restrict__ labels,     // [N]
                     T* __restrict__ sqdist,           // [N]
                     int64_t N,                        // >= 1
                     int64_t K,                        // >= 1
                     int64_t d)                        // >= 1
{
    constexpr int KT = kTile<T>;
    __shared__ T tile[KT][kChunk];  // centroids[k0 + kk, j0 + jj]; rows k >= K are zero

    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int64_t n_block_tiles = (N + kBlockRows - 1) / kBlockRows;

    for (int64_t bt = blockIdx.x; bt < n_block_tiles; bt += gridDim.x) {
        const int64_t row0 = bt * kBlockRows + int64_t(warp) * kRows;  // first point of this warp

        // Rows past N are clamped to N - 1: computed redundantly, never written.
        const T* prow[kRows];
#pragma unroll
        for (int p = 0; p < kRows; ++p) {
            const int64_t r = row0 + p < N ? row0 + p : N - 1;
            prow[p] = points + r * d;
        }

        T best[kRows];
        int64_t arg[kRows];
#pragma unroll
        for (int p = 0; p < kRows; ++p) {
            best[p] = static_cast<T>(INFINITY);
            arg[p] = 0;
        }

        for (int64_t k0 = 0; k0 < K; k0 += KT) {
            T acc[kRows][KT];
#pragma unroll
            for (int p = 0; p < kRows; ++p)
#pragma unroll
                for (int kk = 0; kk < KT; ++kk) acc[p][kk] = T(0);

            for (int64_t j0 = 0; j0 < d; j0 += kChunk) {
                const int len = static_cast<int>(d - j0 < kChunk ? d - j0 : kChunk);

                __syncthreads();  // every warp is done with the previous chunk
                for (int idx = threadIdx.x; idx < KT * len; idx += kThreads) {
                    const int kk = idx / len;
                    const int jj = idx - kk * len;
                    const int64_t k = k0 + kk;
                    tile[kk][jj] = k < K ? centroids[k * d + j0 + jj] : T(0);
                }
                __syncthreads();

                for (int jj = lane; jj < len; jj += kWarpSize) {
                    T x[kRows];
#pragma unroll
                    for (int p = 0; p < kRows; ++p) x[p] = prow[p][j0 + jj];
#pragma unroll
                    for (int kk = 0; kk < KT; ++kk) {
                        const T c = tile[kk][jj];
#pragma unroll
                        for (int p = 0; p < kRows; ++p) {
                            const T diff = x[p] - c;
                            acc[p][kk] = fma(diff, diff, acc[p][kk]);
                        }
                    }
                }
            }

            // Finish the sums across the warp and fold them into the running argmin.
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) {
                const int64_t k = k0 + kk;
                if (k >= K) break;  // uniform across the block
#pragma unroll
                for (int p = 0; p < kRows; ++p) {
                    T s = acc[p][kk];
#pragma unroll
                    for (int off = kWarpSize / 2; off > 0; off >>= 1)
                        s += __shfl_xor_sync(0xffffffffu, s, off);
                    // k ascends, so strict < keeps the lowest k on ties; NaN sticks once seen.
                    if (!isnan(best[p]) && (isnan(s) || s < best[p])) {
                        best[p] = s;
                        arg[p] = k;
                    }
                }
            }
        }

#pragma unroll
        for (int p = 0; p < kRows; ++p) {
            if (lane == p && row0 + p < N) {
                labels[row0 + p] = arg[p];
                sqdist[row0 + p] = best[p];
            }
        }
    }
}

template <typename T>
cudaError_t launch_kmeans_assign(const T* points, const T* centroids, int64_t* labels, T* sqdist,
                                 int64_t N, int64_t K, int64_t d, cudaStream_t stream) {
    if (N < 0 || K < 1 || d < 1) return cudaErrorInvalidValue;
    if (N == 0) return cudaSuccess;
    const int64_t n_block_tiles = (N + kBlockRows - 1) / kBlockRows;
    const int64_t max_grid = 0x7fffffff;  // gridDim.x limit; the kernel grid-strides past it
    const unsigned grid = static_cast<unsigned>(n_block_tiles < max_grid ? n_block_tiles : max_grid);
    kmeans_assign_kernel<T><<<grid, kThreads, 0, stream>>>(points, centroids, labels, sqdist, N, K, d);
    return cudaGetLastError();
}

// Lloyd update as a segmented reduction split across blocks. Python sorts the point indices by
// label (stable): order [N], and seg [K + 1] holds the start of each cluster's run in order.
// Each run is cut into chunks of L consecutive entries (the last one shorter), numbered run by
// run: cluster k owns chunks cstart[k] .. cstart[k + 1] - 1, in run order. Then
//   pass 0 (one block):  cstart[k + 1] = Σ_{k' <= k} ceil(len_k' / L)   (device-side: no sync)
//   pass 1, block (b, jt): partial[b, j] = Σ_{t in chunk b} w_t·x_{t, j},  pw[b] = Σ w_t
//                          for the features j = jt·kThreads + tid, t ascending
//   pass 2, block (jt, k): wsum[k] = Σ_b pw[b], centroids[k, j] = Σ_b partial[b, j] / wsum[k]
//                          (kept when wsum[k] = 0), b ascending over the cluster's chunks
// Every sum is float64 in a fixed order and nothing is atomic: bitwise identical run to run.
// A cluster of 10^5 points is ~100 chunks, so a few clusters still fill the device; one chunk's
// indices and weights are staged in shared memory 256 at a time (one load each, not one per
// feature), then consecutive threads read consecutive features of each point: coalesced.
// L depends on N only (not on the device), so the sums' grouping is the same on every GPU.
constexpr int64_t kTargetChunks = 1024;  // about this many chunks over all clusters (plus one per cluster)
constexpr int64_t kMinChunk = 256;       // shortest chunk: below it the partials cost more than they save

int64_t chunk_length(int64_t N) {
    const int64_t L = (N + kTargetChunks - 1) / kTargetChunks;
    return L > kMinChunk ? L : kMinChunk;
}

// Chunks of all clusters together, at most: Σ_k ceil(len_k / L) <= ceil(N / L) + K.
int64_t chunk_bound(int64_t N, int64_t K) { return (N + chunk_length(N) - 1) / chunk_length(N) + K; }

// cstart [K + 1] <- 0, then the running sum of each cluster's chunk count (a block-wide
// inclusive scan, kThreads clusters at a time, carried across tiles).
__global__ void __launch_bounds__(kThreads)
chunk_starts_kernel(const int64_t* __restrict__ seg,  // [K + 1]
                    int64_t K, int64_t L,
                    int64_t* __restrict__ cstart)     // [K + 1]
{
    __shared__ int64_t warp_total[kWarps];
    __shared__ int64_t carry;  // chunks of the clusters before this tile
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    if (tid == 0) {
        carry = 0;
        cstart[0] = 0;
    }
    __syncthreads();
    for (int64_t k0 = 0; k0 < K; k0 += kThreads) {
        const int64_t k = k0 + tid;
        int64_t v = k < K ? (seg[k + 1] - seg[k] + L - 1) / L : 0;
#pragma unroll
        for (int off = 1; off < kWarpSize; off <<= 1) {
            const int64_t u = __shfl_up_sync(0xffffffffu, v, off);
            if (lane >= off) v += u;
        }
        if (lane == kWarpSize - 1) warp_total[warp] = v;
        __syncthreads();
        int64_t before = carry;
        for (int w = 0; w < warp; ++w) before += warp_total[w];
        if (k < K) cstart[k + 1] = before + v;
        __syncthreads();  // every thread has read carry and warp_total
        if (tid == kThreads - 1) carry = before + v;  // the tile's total (clusters past K add 0)
        __syncthreads();
    }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
chunk_sums_kernel(const T* __restrict__ points,        // [N, d]
                  const int64_t* __restrict__ order,   // [N] point indices sorted by label
                  const int64_t* __restrict__ seg,     // [K + 1] runs of the clusters in order
                  const int64_t* __restrict__ cstart,  // [K + 1] first chunk of each cluster
                  const T* __restrict__ weights,       // [N] or null (all 1)
                  int64_t K, int64_t d, int64_t L,
                  double* __restrict__ partial,        // [bound, d] chunk sums
                  double* __restrict__ pw)             // [bound] chunk weight sums
{
    __shared__ int64_t sidx[kThreads];  // a tile of the chunk's point indices
    __shared__ double sw[kThreads];     // and their weights
    const int tid = threadIdx.x;
    const int64_t b = blockIdx.x;
    if (b >= cstart[K]) return;  // the grid is a bound on the chunks; uniform over the block
    // the cluster of chunk b: cstart[k] <= b < cstart[k + 1] (clusters without chunks are skipped)
    int64_t lo = 0, hi = K;  // cstart[lo] <= b < cstart[hi]
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (cstart[mid] <= b) lo = mid; else hi = mid;
    }
    const int64_t t_begin = seg[lo] + (b - cstart[lo]) * L;
    const int64_t t_end = t_begin + L < seg[lo + 1] ? t_begin + L : seg[lo + 1];
    const int64_t col_tiles = (d + kThreads - 1) / kThreads;
    for (int64_t jt = blockIdx.y; jt < col_tiles; jt += gridDim.y) {  // gridDim.y <= 65,535: stride past it
        const int64_t j = jt * kThreads + tid;
        double acc = 0.0, wacc = 0.0;
        for (int64_t t0 = t_begin; t0 < t_end; t0 += kThreads) {
            const int n = static_cast<int>(t_end - t0 < kThreads ? t_end - t0 : kThreads);
            __syncthreads();  // the previous tile is consumed
            if (tid < n) {
                const int64_t idx = order[t0 + tid];
                sidx[tid] = idx;
                sw[tid] = weights ? double(weights[idx]) : 1.0;
            }
            __syncthreads();
            for (int q = 0; q < n; ++q) {
                const double w = sw[q];
                wacc += w;
                if (j < d) acc += w * double(points[sidx[q] * d + j]);
            }
        }
        if (j < d) partial[b * d + j] = acc;
        if (jt == 0 && tid == 0) pw[b] = wacc;
    }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
combine_chunks_kernel(const double* __restrict__ partial,  // [bound, d]
                      const double* __restrict__ pw,       // [bound]
                      const int64_t* __restrict__ cstart,  // [K + 1]
                      int64_t K, int64_t d,
                      T* __restrict__ centroids,           // [K, d]
                      double* __restrict__ wsum)           // [K]
{
    const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;
    for (int64_t k = blockIdx.y; k < K; k += gridDim.y) {  // gridDim.y <= 65,535: stride past it
        const int64_t b0 = cstart[k], b1 = cstart[k + 1];
        double acc = 0.0, wacc = 0.0;  // every thread sums the weights too: same loads, no sync
        for (int64_t b = b0; b < b1; ++b) {
            wacc += pw[b];
            if (j < d) acc += partial[b * d + j];
        }
        if (blockIdx.x == 0 && threadIdx.x == 0) wsum[k] = wacc;
        if (j < d && wacc > 0.0) centroids[k * d + j] = T(acc / wacc);
    }
}

// float64 values of the scratch a kmeans_update of this shape needs: partial [bound, d], pw
// [bound] and cstart [K + 1] (int64, stored in the same 8-byte slots).
int64_t update_scratch(int64_t N, int64_t K, int64_t d) {
    const int64_t bound = chunk_bound(N, K);
    return bound * d + bound + K + 1;
}

template <typename T>
cudaError_t launch_kmeans_update(const T* points, const int64_t* order, const int64_t* seg, const T* weights,
                                 T* centroids, double* wsum, int64_t N, int64_t K, int64_t d, double* scratch,
                                 cudaStream_t stream) {
    if (N < 0 || K < 1 || d < 1 || !scratch) return cudaErrorInvalidValue;
    const int64_t L = chunk_length(N), bound = chunk_bound(N, K);
    const int64_t col_tiles = (d + kThreads - 1) / kThreads;
    const int64_t max_x = 0x7fffffff, max_yz = 65535;  // gridDim limits
    if (bound > max_x || col_tiles > max_x) return cudaErrorInvalidValue;
    double* partial = scratch;                                        // [bound, d]
    double* pw = scratch + bound * d;                                 // [bound]
    int64_t* cstart = reinterpret_cast<int64_t*>(pw + bound);         // [K + 1]
    chunk_starts_kernel<<<1, kThreads, 0, stream>>>(seg, K, L, cstart);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const dim3 grid1(static_cast<unsigned>(bound), static_cast<unsigned>(col_tiles < max_yz ? col_tiles : max_yz));
    chunk_sums_kernel<T><<<grid1, kThreads, 0, stream>>>(points, order, seg, cstart, weights, K, d, L, partial, pw);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const dim3 grid2(static_cast<unsigned>(col_tiles), static_cast<unsigned>(K < max_yz ? K : max_yz));
    combine_chunks_kernel<T><<<grid2, kThreads, 0, stream>>>(partial, pw, cstart, K, d, centroids, wsum);
    return cudaGetLastError();
}

}  // namespace

int64_t kmeans_update_scratch(int64_t N, int64_t K, int64_t d) { return update_scratch(N, K, d); }

cudaError_t kmeans_update(const float* points, const int64_t* order, const int64_t* seg, const float* weights,
                          float* centroids, double* wsum, int64_t N, int64_t K, int64_t d, double* scratch,
                          cudaStream_t stream) {
    return launch_kmeans_update<float>(points, order, seg, weights, centroids, wsum, N, K, d, scratch, stream);
}

cudaError_t kmeans_update(const double* points, const int64_t* order, const int64_t* seg, const double* weights,
                          double* centroids, double* wsum, int64_t N, int64_t K, int64_t d, double* scratch,
                          cudaStream_t stream) {
    return launch_kmeans_update<double>(points, order, seg, weights, centroids, wsum, N, K, d, scratch, stream);
}

cudaError_t kmeans_assign(const float* points, const float* centroids, int64_t* labels,
                          float* sqdist, int64_t N, int64_t K, int64_t d, cudaStream_t stream) {
    return launch_kmeans_assign<float>(points, centroids, labels, sqdist, N, K, d, stream);
}

cudaError_t kmeans_assign(const double* points, const double* centroids, int64_t* labels,
                          double* sqdist, int64_t N, int64_t K, int64_t d, cudaStream_t stream) {
    return launch_kmeans_assign<double>(points, centroids, labels, sqdist, N, K, d, stream);
}

}  // namespace pflcore::cuda
