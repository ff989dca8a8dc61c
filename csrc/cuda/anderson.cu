// Anderson mixing on the GPU (DESIGN.md §4): the incremental Gram update as a batched dot
// product fused with storing the new pair, the Gram matrix of anderson_weights, and the mixing
// pass. The small regularized solve for π runs on the host (pflcore/ops/anderson.py): the k ≤
// memory + 1 new Gram entries are copied back anyway to test the safeguard, and a k × k
// Cholesky is far below a kernel launch's cost.
//
// push:  r = tu − u;  R_hist[slot] ← r;  TU_hist[slot] ← tu;  dots[j] = Σ_e R_hist[slots[j], e]·r_e
// gram:  G[a, b] = Σ_e V[a, e]·V[b, e]; for k <= 8 in one pass over V (each thread keeps the
//        k(k+1)/2 sums of its entries), else as k batched dot products
// mix:   out_e = Σ_j π_j·TU_hist[slots[j], e]
// All sums in float64. A block reduces kBlockElems entries to one partial per j (fixed
// shuffle/shared-memory tree); a second kernel sums the partials over blocks in a fixed order,
// so the dots are bitwise deterministic (no atomics).

#include <cuda_runtime.h>

#include <cstdint>

namespace pflcore::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kPerThread = 8;                                      // entries per thread
constexpr int64_t kBlockElems = int64_t(kThreads) * kPerThread;   // entries per block
constexpr unsigned kFullMask = 0xffffffffu;

// Sum of v over the block, the same tree every time; the result is valid in thread 0.
__device__ double block_sum(double v, double* warp_sums /*[kWarps] shared*/) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0)
        for (int w = 0; w < kWarps; ++w) s += warp_sums[w];
    __syncthreads();  // warp_sums may be reused by the next call
    return s;
}

// STORE: r = tu − u is stored in R_hist[slot] (and tu in TU_hist[slot]); else r = u.
// partial[blockIdx.x, j] = Σ_{e in this block} R_hist[slots[j], e]·r_e (slots null: j).
template <typename T, bool STORE>
__global__ void __launch_bounds__(kThreads)
dots_kernel(const T* __restrict__ u,      // [D] STORE: the point; else the vector r
            const T* __restrict__ tu,     // [D] STORE: its image; else unused
            T* R_hist,                    // [H, D] residual history
            T* TU_hist,                   // [H, D] image history (STORE)
            int64_t D, int64_t slot,
            const int64_t* __restrict__ slots,  // [k] rows of R_hist, or null for 0..k-1
            int64_t k,
            double* __restrict__ partial)       // [gridDim.x, k]
{
    __shared__ double warp_sums[kWarps];
    const int64_t base = int64_t(blockIdx.x) * kBlockElems + threadIdx.x;
    T r[kPerThread];
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
        const int64_t e = base + int64_t(q) * kThreads;  // consecutive threads, consecutive e
        r[q] = T(0);
        if (e < D) {
            if (STORE) {
                const T tv = tu[e];
                r[q] = tv - u[e];
                R_hist[slot * D + e] = r[q];
                TU_hist[slot * D + e] = tv;
            } else {
                r[q] = u[e];
            }
        }
    }
    for (int64_t j = 0; j < k; ++j) {
        const int64_t sj = slots ? slots[j] : j;
        double acc = 0.0;
#pragma unroll
        for (int q = 0; q < kPerThread; ++q) {
            const int64_t e = base + int64_t(q) * kThreads;
            if (e < D) {
                // the row just stored is read from registers, not back from memory
                const T v = (STORE && sj == slot) ? r[q] : R_hist[sj * D + e];
                acc += double(v) * double(r[q]);
            }
        }
        const double s = block_sum(acc, warp_sums);
        if (threadIdx.x == 0) partial[int64_t(blockIdx.x) * k + j] = s;
    }
}

// dots[j] = Σ_b partial[b, j]: block j, thread t sums b = t, t + kThreads, ... in order.
__global__ void __launch_bounds__(kThreads)
sum_partials_kernel(const double* __restrict__ partial,  // [nblk, k]
                    int64_t nblk, int64_t k,
                    double* __restrict__ dots)          // [k]
{
    __shared__ double warp_sums[kWarps];
    const int64_t j = blockIdx.x;
    double acc = 0.0;
    for (int64_t b = threadIdx.x; b < nblk; b += kThreads) acc += partial[b * k + j];
    const double s = block_sum(acc, warp_sums);
    if (threadIdx.x == 0) dots[j] = s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
mix_kernel(const T* __restrict__ TU_hist,     // [H, D]
           int64_t D,
           const int64_t* __restrict__ slots, // [k]
           const double* __restrict__ pi,     // [k]
           int64_t k,
           T* __restrict__ out)               // [D]
{
    for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < D; e += int64_t(gridDim.x) * kThreads) {
        double acc = 0.0;
        for (int64_t j = 0; j < k; ++j) acc += pi[j] * double(TU_hist[slots[j] * D + e]);
        out[e] = T(acc);
    }
}

// ---- the one-pass Gram matrix (k <= kGramMaxK) ----------------------------------------------
// The row-by-row path reads V k times (k launches of dots_kernel); this one reads each V[a, e]
// once and keeps the k(k+1)/2 upper-triangle sums of a thread in float64 registers.

constexpr int kGramMaxK = 8;             // k = Anderson memory + 1 is 6 by default
constexpr int kGramUnroll = 4;           // entries (each k loads) a thread has in flight at once
constexpr int64_t kGramMaxBlocks = 1024; // partials per pair: bounds the second pass and the scratch

__host__ __device__ constexpr int gram_pairs(int k) { return k * (k + 1) / 2; }

// Blocks of the one-pass Gram kernel for D entries: a function of D only (the summation order
// must not depend on the device), at most kGramMaxBlocks, none idle.
int64_t gram_blocks(int64_t D) {
    const int64_t want = (D + int64_t(kThreads) * kGramUnroll - 1) / (int64_t(kThreads) * kGramUnroll);
    return want < kGramMaxBlocks ? want : kGramMaxBlocks;
}

// partial[blockIdx.x, p] = Σ_{e of this block} V[a, e]·V[b, e] for the pairs p = (a, b), a <= b,
// in the order (0,0), (0,1), .., (0,K-1), (1,1), ... Thread t of block b takes the entries
// e = b·kThreads + t + i·gridDim.x·kThreads (consecutive threads, consecutive e), kGramUnroll
// of them at a time: their K loads each go out before any product.
template <typename T, int K>
__global__ void __launch_bounds__(kThreads)
gram_partial_kernel(const T* __restrict__ V,          // [K, D]
                    int64_t D,
                    double* __restrict__ partial)     // [gridDim.x, K(K+1)/2]
{
    constexpr int kPairs = gram_pairs(K);
    __shared__ double warp_sums[kWarps];
    double acc[kPairs];
#pragma unroll
    for (int p = 0; p < kPairs; ++p) acc[p] = 0.0;
    const int64_t stride = int64_t(gridDim.x) * kThreads;
    int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x;
    for (; e + (kGramUnroll - 1) * stride < D; e += kGramUnroll * stride) {
        T v[kGramUnroll][K];
#pragma unroll
        for (int u = 0; u < kGramUnroll; ++u)
#pragma unroll
            for (int a = 0; a < K; ++a) v[u][a] = V[a * D + e + u * stride];
#pragma unroll
        for (int u = 0; u < kGramUnroll; ++u) {
            int p = 0;
#pragma unroll
            for (int a = 0; a < K; ++a)
#pragma unroll
                for (int b = a; b < K; ++b) acc[p++] += double(v[u][a]) * double(v[u][b]);
        }
    }
    for (; e < D; e += stride) {  // the last entries, fewer than kGramUnroll per thread
        T v[K];
#pragma unroll
        for (int a = 0; a < K; ++a) v[a] = V[a * D + e];
        int p = 0;
#pragma unroll
        for (int a = 0; a < K; ++a)
#pragma unroll
            for (int b = a; b < K; ++b) acc[p++] += double(v[a]) * double(v[b]);
    }
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
        const double s = block_sum(acc[p], warp_sums);
        if (threadIdx.x == 0) partial[int64_t(blockIdx.x) * kPairs + p] = s;
    }
}

// G[a, b] = G[b, a] = Σ_blk partial[blk, p] for pair p = blockIdx.x: thread t sums blk = t,
// t + kThreads, ... in order, then the block's fixed tree. Both entries get the same value:
// G is symmetric bit for bit.
__global__ void __launch_bounds__(kThreads)
gram_finish_kernel(const double* __restrict__ partial,  // [nblk, k(k+1)/2]
                   int64_t nblk, int k,
                   double* __restrict__ G)              // [k, k]
{
    __shared__ double warp_sums[kWarps];
    const int pairs = gram_pairs(k), p = blockIdx.x;
    double acc = 0.0;
    for (int64_t b = threadIdx.x; b < nblk; b += kThreads) acc += partial[b * pairs + p];
    const double s = block_sum(acc, warp_sums);
    if (threadIdx.x == 0) {
        int a = 0, first = 0;  // pair p is (a, a + p - first), first = the index of (a, a)
        while (p - first >= k - a) {
            first += k - a;
            ++a;
        }
        const int b = a + (p - first);
        G[a * k + b] = s;
        G[b * k + a] = s;
    }
}

template <typename T, int K>
cudaError_t gram_one_pass(const T* V, int64_t D, double* G, double* partial, cudaStream_t stream) {
    const int64_t nblk = gram_blocks(D);
    gram_partial_kernel<T, K><<<static_cast<unsigned>(nblk), kThreads, 0, stream>>>(V, D, partial);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    gram_finish_kernel<<<gram_pairs(K), kThreads, 0, stream>>>(partial, nblk, K, G);
    return cudaGetLastError();
}

int64_t num_blocks(int64_t D) { return (D + kBlockElems - 1) / kBlockElems; }

// dots [k] (device) of r with rows of R_hist; the partial sums [nblk, k] go to the caller's
// scratch (allocated by torch's caching allocator on this stream: reused in stream order; the
// runtime's default cudaMallocAsync pool has a release threshold of 0 and hands its memory back
// at every synchronization, so each call would map fresh memory).
template <typename T, bool STORE>
cudaError_t dots(const T* u, const T* tu, T* R_hist, T* TU_hist, int64_t D, int64_t slot,
                 const int64_t* slots, int64_t k, double* out, double* partial, cudaStream_t stream) {
    if (k == 0 || D == 0) return k == 0 ? cudaSuccess : cudaMemsetAsync(out, 0, k * sizeof(double), stream);
    const int64_t nblk = num_blocks(D);
    if (nblk > 0x7fffffff || k > 0x7fffffff || !partial) return cudaErrorInvalidValue;
    dots_kernel<T, STORE><<<static_cast<unsigned>(nblk), kThreads, 0, stream>>>(u, tu, R_hist, TU_hist, D, slot,
                                                                                slots, k, partial);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    sum_partials_kernel<<<static_cast<unsigned>(k), kThreads, 0, stream>>>(partial, nblk, k, out);
    return cudaGetLastError();
}

}  // namespace

// float64 values of the scratch of anderson_push for D entries and k dots.
int64_t anderson_scratch(int64_t D, int64_t k) { return num_blocks(D) * k; }

// float64 values of the scratch of anderson_gram for k rows of D entries.
int64_t gram_scratch(int64_t D, int64_t k) {
    if (k >= 1 && k <= kGramMaxK) return gram_blocks(D) * gram_pairs(static_cast<int>(k));
    return anderson_scratch(D, k);
}

template <typename T>
cudaError_t anderson_push(const void* u, const void* tu, void* R_hist, void* TU_hist, int64_t D, int64_t slot,
                          const int64_t* slots, int64_t k, double* dots_out, double* scratch, cudaStream_t stream) {
    if (D == 0) return k == 0 ? cudaSuccess : cudaMemsetAsync(dots_out, 0, k * sizeof(double), stream);
    return dots<T, true>(static_cast<const T*>(u), static_cast<const T*>(tu), static_cast<T*>(R_hist),
                         static_cast<T*>(TU_hist), D, slot, slots, k, dots_out, scratch, stream);
}

template <typename T>
cudaError_t anderson_gram(const void* vecs, int64_t k, int64_t D, double* G, double* scratch, cudaStream_t stream) {
    const T* v = static_cast<const T*>(vecs);
    if (k >= 1 && k <= kGramMaxK) {
        // One pass over V (scratch: gram_scratch(D, k) values).
        if (D == 0) return cudaMemsetAsync(G, 0, k * k * sizeof(double), stream);
        if (!scratch) return cudaErrorInvalidValue;
        switch (k) {
            case 1: return gram_one_pass<T, 1>(v, D, G, scratch, stream);
            case 2: return gram_one_pass<T, 2>(v, D, G, scratch, stream);
            case 3: return gram_one_pass<T, 3>(v, D, G, scratch, stream);
            case 4: return gram_one_pass<T, 4>(v, D, G, scratch, stream);
            case 5: return gram_one_pass<T, 5>(v, D, G, scratch, stream);
            case 6: return gram_one_pass<T, 6>(v, D, G, scratch, stream);
            case 7: return gram_one_pass<T, 7>(v, D, G, scratch, stream);
            default: return gram_one_pass<T, 8>(v, D, G, scratch, stream);
        }
    }
    // k > kGramMaxK: row a of G is the dots of vecs[a] with every row (k passes over V). G is
    // symmetric bit for bit: each entry is the same products summed in the same order. The rows
    // reuse one scratch: their launches are ordered on the stream.
    for (int64_t a = 0; a < k; ++a) {
        const cudaError_t err = dots<T, false>(v + a * D, nullptr, const_cast<T*>(v), nullptr, D, 0, nullptr, k,
                                               G + a * k, scratch, stream);
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}

template <typename T>
cudaError_t anderson_mix(const void* TU_hist, int64_t D, const int64_t* slots, const double* pi, int64_t k,
                         void* out, cudaStream_t stream) {
    if (D == 0) return cudaSuccess;
    int64_t grid = (D + kThreads - 1) / kThreads;
    if (grid > 65535 * 16) grid = 65535 * 16;  // grid-stride beyond ~2.7e8 entries
    mix_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(static_cast<const T*>(TU_hist), D, slots,
                                                                        pi, k, static_cast<T*>(out));
    return cudaGetLastError();
}

template cudaError_t anderson_push<float>(const void*, const void*, void*, void*, int64_t, int64_t,
                                          const int64_t*, int64_t, double*, double*, cudaStream_t);
template cudaError_t anderson_push<double>(const void*, const void*, void*, void*, int64_t, int64_t,
                                           const int64_t*, int64_t, double*, double*, cudaStream_t);
template cudaError_t anderson_gram<float>(const void*, int64_t, int64_t, double*, double*, cudaStream_t);
template cudaError_t anderson_gram<double>(const void*, int64_t, int64_t, double*, double*, cudaStream_t);
template cudaError_t anderson_mix<float>(const void*, int64_t, const int64_t*, const double*, int64_t, void*,
                                         cudaStream_t);
template cudaError_t anderson_mix<double>(const void*, int64_t, const int64_t*, const double*, int64_t, void*,
                                          cudaStream_t);

}  // namespace pflcore::cuda
