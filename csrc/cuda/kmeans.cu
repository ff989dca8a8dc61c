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

// Lloyd update as a segmented reduction. Python sorts the point indices by label (stable):
// order [N], and seg [K + 1] holds the start of each cluster's run in order. Block (k, jt)
// owns cluster k and the features j = jt·kThreads + threadIdx.x; it walks the cluster's run in
// order, so every sum has a fixed order (float64, no atomics):
//   wsum[k] = Σ_t w_t,   centroids[k, j] = Σ_t w_t·x_{t, j} / wsum[k]   (kept when wsum[k] = 0)
// Consecutive threads read consecutive features of a point: coalesced.
template <typename T>
__global__ void __launch_bounds__(kThreads)
kmeans_update_kernel(const T* __restrict__ points,        // [N, d]
                     const int64_t* __restrict__ order,   // [N] point indices sorted by label
                     const int64_t* __restrict__ seg,     // [K + 1] runs of the clusters in order
                     const T* __restrict__ weights,       // [N] or null (all 1)
                     T* __restrict__ centroids,           // [K, d]
                     double* __restrict__ wsum,           // [K]
                     int64_t d)
{
    const int64_t k = blockIdx.x;
    const int64_t j = int64_t(blockIdx.y) * kThreads + threadIdx.x;
    const int64_t s0 = seg[k], s1 = seg[k + 1];
    double acc = 0.0, wacc = 0.0;  // every thread sums the weights too: same loads, no sync
    for (int64_t t = s0; t < s1; ++t) {
        const int64_t idx = order[t];
        const double w = weights ? double(weights[idx]) : 1.0;
        wacc += w;
        if (j < d) acc += w * double(points[idx * d + j]);
    }
    if (blockIdx.y == 0 && threadIdx.x == 0) wsum[k] = wacc;
    if (j < d && wacc > 0.0) centroids[k * d + j] = T(acc / wacc);
}

template <typename T>
cudaError_t launch_kmeans_update(const T* points, const int64_t* order, const int64_t* seg, const T* weights,
                                 T* centroids, double* wsum, int64_t N, int64_t K, int64_t d,
                                 cudaStream_t stream) {
    if (N < 0 || K < 1 || d < 1) return cudaErrorInvalidValue;
    const int64_t col_tiles = (d + kThreads - 1) / kThreads;
    if (K > 0x7fffffff || col_tiles > 65535) return cudaErrorInvalidValue;  // gridDim limits
    const dim3 grid(static_cast<unsigned>(K), static_cast<unsigned>(col_tiles));
    kmeans_update_kernel<T><<<grid, kThreads, 0, stream>>>(points, order, seg, weights, centroids, wsum, d);
    return cudaGetLastError();
}

}  // namespace

cudaError_t kmeans_update(const float* points, const int64_t* order, const int64_t* seg, const float* weights,
                          float* centroids, double* wsum, int64_t N, int64_t K, int64_t d, cudaStream_t stream) {
    return launch_kmeans_update<float>(points, order, seg, weights, centroids, wsum, N, K, d, stream);
}

cudaError_t kmeans_update(const double* points, const int64_t* order, const int64_t* seg, const double* weights,
                          double* centroids, double* wsum, int64_t N, int64_t K, int64_t d, cudaStream_t stream) {
    return launch_kmeans_update<double>(points, order, seg, weights, centroids, wsum, N, K, d, stream);
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
