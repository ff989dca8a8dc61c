// GLM local steps, gradients and evaluation on the GPU (DESIGN.md §3, §4).
//
// One thread block per model row r (client i = rows[r]) runs the row's whole loop in one
// launch. For local_steps, for s = 0..steps-1:
//   G = Σ_{t ∈ B_{r,s}} x_t ⊗ dℓ/dz(z_t, y_t),   z_t = x_t W (+ b)
//   W ← W − lr·( grad_scale[r]·G/|B_{r,s}| + l2·W + prox·(W − a_r) )
// gradients: out_r = G/|B_r| + l2·W; evaluate: loss_r = Σ_t ℓ(z_t, y_t), correct_r, count_r = n_i.
// The per-row loss and dℓ/dz are those of pflcore/glm.h (host+device, shared with the CPU).
//
// Layout of a block (kWarps warps): the rows of a batch are taken nt at a time (a chunk).
//  1. logits: warp w takes rows t = w, w + kWarps, ...; its lanes split the features of a row
//     (coalesced loads), accumulate kClassGroup logits at a time and finish them with
//     xor-shuffles; lane 0 stores z_t and then dz_t = dℓ/dz(z_t) in shared memory.
//  2. gradient: thread e owns parameters e, e + kThreads, ...: G[k, c] += Σ_{t<nt} x_t[k]·dz_t[c]
//     with t ascending, so every sum has a fixed order: no atomics, bitwise deterministic.
// W and G live in shared memory when 2·d values fit (loaded once, stored once); otherwise W is
// the row of theta itself (updated in place) and G a global scratch row of the block: scratch
// is [gridDim.x, d], block b uses row b for every model row it takes (grid stride), so the
// launch caps the grid at the blocks that can be resident at once and the scratch stays
// O(resident blocks · d), not O(R · d). Memory written by one phase and read by another is
// always separated by __syncthreads().

#include <cuda_runtime.h>

#include <cstdint>

#include "pflcore/glm.h"

namespace pflcore::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kMaxChunkRows = 32;                 // nt, rows per chunk
constexpr int kClassGroup = 8;                    // logits per pass over a row's features
constexpr int64_t kChunkScratchBytes = 16 * 1024; // z and dz of one chunk: 2·nt·C values at most
constexpr int64_t kDefaultSmem = 48 * 1024;       // above this a kernel must opt in
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxGrid = 0x7fffffff;        // gridDim.x limit

enum Mode : int { kLocalSteps = 0, kGradients = 1, kEvaluate = 2 };

template <typename T>
struct GlmArgs {
    int64_t p, C;              // features, outputs
    bool intercept;            // parameter row p multiplies an implicit 1
    T l2;
    const T* x;                // [N, p]
    const void* y;             // [N] T (least squares) or int64 labels
    const int64_t* offsets;    // [m + 1]
    const int64_t* rows;       // [R] client of each model row
    int64_t R;
    T* theta;                  // [R, d]; written only by local steps
    T* scratch;                // [gridDim.x, d] gradient sums of each block when W, G are not in shared memory
    T* out;                    // [R, d] gradients
    const int32_t* batches;    // [R, steps, B] (local steps) or [R, B] (gradients); null = full batch
    int64_t B;
    const T* anchor;           // [R, d] or [d] (anchor_shared) or null
    bool anchor_shared;
    const T* grad_scale;       // [R] or null (= 1)
    int64_t steps;
    T lr, prox;
    T* loss_sum;               // [R] evaluate
    int64_t* correct;          // [R] evaluate
    int64_t* count;            // [R] evaluate
    int nt;                    // rows per chunk, 1..kMaxChunkRows
    bool params_in_smem;
};

inline __host__ __device__ int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Byte offsets of the dynamic shared memory of a block.
struct SmemLayout {
    int64_t W, G, z, dz, loss, idx, hit, total;
    __host__ __device__ SmemLayout(int64_t d, int64_t C, int nt, bool params, int64_t tsize) {
        W = 0;
        G = params ? align16(d * tsize) : 0;
        z = params ? G + align16(d * tsize) : 0;
        dz = z + align16(nt * C * tsize);
        loss = dz + align16(nt * C * tsize);
        idx = loss + align16(nt * tsize);
        hit = idx + align16(nt * int64_t(sizeof(int64_t)));
        total = hit + align16(nt * int64_t(sizeof(int64_t)));
    }
};

template <Family F, typename T, int M>
__global__ void __launch_bounds__(kThreads) glm_kernel(const GlmArgs<T> a) {
    using Y = label_t<F, T>;
    extern __shared__ __align__(16) unsigned char smem[];
    const int64_t p = a.p, C = a.C, P = p + (a.intercept ? 1 : 0), d = P * C;
    const SmemLayout L(d, C, a.nt, a.params_in_smem, sizeof(T));
    T* zs = reinterpret_cast<T*>(smem + L.z);            // [nt, C] logits
    T* dzs = reinterpret_cast<T*>(smem + L.dz);          // [nt, C] d loss / d logits
    T* row_loss = reinterpret_cast<T*>(smem + L.loss);   // [nt]
    int64_t* ridx = reinterpret_cast<int64_t*>(smem + L.idx);  // [nt] absolute row indices
    int64_t* row_hit = reinterpret_cast<int64_t*>(smem + L.hit);  // [nt]
    const Y* y = static_cast<const Y*>(a.y);
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;

    for (int64_t r = blockIdx.x; r < a.R; r += gridDim.x) {
        const int64_t client = a.rows[r];
        const int64_t lo = a.offsets[client], n = a.offsets[client + 1] - lo;
        const int64_t nb = a.batches ? a.B : n;
        T* theta_r = a.theta + r * d;
        T* W = theta_r;  // read-only unless M == kLocalSteps
        T* G = M == kGradients ? a.out + r * d : (a.scratch ? a.scratch + int64_t(blockIdx.x) * d : nullptr);
        if (a.params_in_smem) {
            W = reinterpret_cast<T*>(smem + L.W);
            G = reinterpret_cast<T*>(smem + L.G);
            for (int64_t e = tid; e < d; e += kThreads) W[e] = theta_r[e];
        }
        T loss_acc = T(0);   // evaluate, thread 0
        int64_t hit_acc = 0;
        const int64_t steps = M == kLocalSteps ? a.steps : 1;
        for (int64_t s = 0; s < steps; ++s) {
            if (M != kEvaluate)
                for (int64_t e = tid; e < d; e += kThreads) G[e] = T(0);
            __syncthreads();  // W loaded, G cleared
            for (int64_t t0 = 0; t0 < nb; t0 += a.nt) {
                const int nt = static_cast<int>(nb - t0 < a.nt ? nb - t0 : a.nt);
                for (int t = tid; t < nt; t += kThreads)
                    ridx[t] = a.batches ? static_cast<int64_t>(a.batches[(r * steps + s) * a.B + t0 + t])
                                        : lo + t0 + t;
                __syncthreads();

                // 1. logits and dz of the chunk's rows, one warp per row
                for (int t = warp; t < nt; t += kWarps) {  // warp-uniform: full-mask shuffles are safe
                    const T* xr = a.x + ridx[t] * p;
                    for (int64_t c0 = 0; c0 < C; c0 += kClassGroup) {
                        T acc[kClassGroup];
#pragma unroll
                        for (int q = 0; q < kClassGroup; ++q) acc[q] = T(0);
                        for (int64_t k = lane; k < P; k += kWarpSize) {
                            const T xv = k < p ? xr[k] : T(1);
                            const T* wk = W + k * C + c0;
#pragma unroll
                            for (int q = 0; q < kClassGroup; ++q)
                                if (c0 + q < C) acc[q] += xv * wk[q];
                        }
#pragma unroll
                        for (int q = 0; q < kClassGroup; ++q) {
                            T v = acc[q];
#pragma unroll
                            for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
                            if (lane == 0 && c0 + q < C) zs[t * C + c0 + q] = v;
                        }
                    }
                    if (lane == 0) {  // the lane that wrote z_t reads it: no sync needed
                        const Y label = y[ridx[t]];
                        row_loss[t] = loss_grad<F, T>(zs + t * C, C, label, dzs + t * C);
                        row_hit[t] = M == kEvaluate ? is_correct<F, T>(zs + t * C, C, label) : 0;
                    }
                }
                __syncthreads();  // dz of every row of the chunk is in shared memory

                if (M == kEvaluate) {
                    if (tid == 0)
                        for (int t = 0; t < nt; ++t) {  // row order: deterministic
                            loss_acc += row_loss[t];
                            hit_acc += row_hit[t];
                        }
                } else {
                    // 2. G[k, c] += Σ_t x_t[k]·dz_t[c], t ascending
                    for (int64_t e = tid; e < d; e += kThreads) {
                        const int64_t k = e / C, c = e - k * C;
                        T g = T(0);
                        for (int t = 0; t < nt; ++t) {
                            const T xv = k < p ? a.x[ridx[t] * p + k] : T(1);
                            g += xv * dzs[t * C + c];
                        }
                        G[e] += g;
                    }
                }
                __syncthreads();  // ridx, zs, dzs are rewritten by the next chunk
            }
            if (M == kLocalSteps) {
                const T scale = (a.grad_scale ? a.grad_scale[r] : T(1)) / static_cast<T>(nb);
                const T* anc = a.anchor ? a.anchor + (a.anchor_shared ? 0 : r * d) : nullptr;
                for (int64_t e = tid; e < d; e += kThreads) {
                    const T w = W[e];
                    const T av = anc ? anc[e] : T(0);
                    W[e] = w - a.lr * (scale * G[e] + a.l2 * w + a.prox * (w - av));
                }
                __syncthreads();  // the next step's logits read the new W
            }
        }
        if (M == kLocalSteps && a.params_in_smem)
            for (int64_t e = tid; e < d; e += kThreads) theta_r[e] = W[e];
        if (M == kGradients) {
            T* out_r = a.out + r * d;
            for (int64_t e = tid; e < d; e += kThreads) out_r[e] = G[e] / static_cast<T>(nb) + a.l2 * W[e];
        }
        if (M == kEvaluate && tid == 0) {
            a.loss_sum[r] = loss_acc;
            a.correct[r] = hit_acc;
            a.count[r] = n;
        }
        __syncthreads();  // the next row (grid stride) reuses shared memory
    }
}

template <Family F, typename T, int M>
cudaError_t launch_family(GlmArgs<T> a, cudaStream_t stream) {
    const int64_t P = a.p + (a.intercept ? 1 : 0), d = P * a.C;
    int device = 0, optin = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;

    const int64_t tsize = sizeof(T);
    const int64_t per_row = 2 * a.C * tsize;  // z and dz of one row
    if (per_row > kChunkScratchBytes) return cudaErrorInvalidValue;  // C too large (checked in the binding)
    a.nt = static_cast<int>(kChunkScratchBytes / per_row < kMaxChunkRows ? kChunkScratchBytes / per_row
                                                                          : kMaxChunkRows);
    a.params_in_smem = SmemLayout(d, a.C, a.nt, true, tsize).total <= optin;
    const int64_t smem = SmemLayout(d, a.C, a.nt, a.params_in_smem, tsize).total;
    if (smem > optin) return cudaErrorInvalidValue;  // cannot happen for C within the limit above
    if (smem > kDefaultSmem) {
        err = cudaFuncSetAttribute(glm_kernel<F, T, M>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(smem));
        if (err != cudaSuccess) return err;
    }
    int64_t grid = a.R < kMaxGrid ? a.R : kMaxGrid;  // gridDim.x limit; the kernel grid-strides past it
    a.scratch = nullptr;
    if (M == kLocalSteps && !a.params_in_smem) {  // G in a global scratch [grid, d], stream-ordered
        // One scratch row per block: the grid is capped at the blocks resident at once (more
        // would only queue), so the scratch is bounded by the device, not by R.
        int sms = 0, per_sm = 0;
        err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        if (err != cudaSuccess) return err;
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, glm_kernel<F, T, M>, kThreads,
                                                            static_cast<size_t>(smem));
        if (err != cudaSuccess) return err;
        const int64_t resident = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
        if (grid > resident) grid = resident;
        void* buf = nullptr;
        err = cudaMallocAsync(&buf, static_cast<size_t>(grid * d * tsize), stream);
        if (err != cudaSuccess) return err;
        a.scratch = static_cast<T*>(buf);
    }
    glm_kernel<F, T, M><<<static_cast<unsigned>(grid), kThreads, static_cast<size_t>(smem), stream>>>(a);
    err = cudaGetLastError();
    if (a.scratch) {
        const cudaError_t free_err = cudaFreeAsync(a.scratch, stream);
        if (err == cudaSuccess) err = free_err;
    }
    return err;
}

template <typename T, int M>
cudaError_t launch(int family, const GlmArgs<T>& a, cudaStream_t stream) {
    if (a.R == 0 || (M == kLocalSteps && a.steps == 0)) return cudaSuccess;
    switch (family) {
        case 0: return launch_family<Family::LeastSquares, T, M>(a, stream);
        case 1: return launch_family<Family::Logistic, T, M>(a, stream);
        case 2: return launch_family<Family::Softmax, T, M>(a, stream);
        default: return cudaErrorInvalidValue;
    }
}

template <typename T>
GlmArgs<T> make_args(int64_t p, int64_t C, bool intercept, double l2, const void* x, const void* y,
                     const int64_t* offsets, const int64_t* rows, int64_t R, void* theta) {
    GlmArgs<T> a{};
    a.p = p;
    a.C = C;
    a.intercept = intercept;
    a.l2 = static_cast<T>(l2);
    a.x = static_cast<const T*>(x);
    a.y = y;
    a.offsets = offsets;
    a.rows = rows;
    a.R = R;
    a.theta = static_cast<T*>(theta);
    a.steps = 1;
    return a;
}

}  // namespace

// Largest C the kernels take: z and dz of one row must fit the chunk's shared scratch.
int64_t glm_max_classes(bool f64) { return kChunkScratchBytes / (2 * (f64 ? 8 : 4)); }

template <typename T>
cudaError_t glm_local_steps(int family, int64_t p, int64_t C, bool intercept, double l2, void* theta,
                            const void* x, const void* y, const int64_t* offsets, const int64_t* rows,
                            int64_t R, const int32_t* batches, int64_t B, const void* anchor,
                            bool anchor_shared, const void* grad_scale, int64_t steps, double lr, double prox,
                            cudaStream_t stream) {
    GlmArgs<T> a = make_args<T>(p, C, intercept, l2, x, y, offsets, rows, R, theta);
    a.batches = batches;
    a.B = B;
    a.anchor = static_cast<const T*>(anchor);
    a.anchor_shared = anchor_shared;
    a.grad_scale = static_cast<const T*>(grad_scale);
    a.steps = steps;
    a.lr = static_cast<T>(lr);
    a.prox = static_cast<T>(prox);
    return launch<T, kLocalSteps>(family, a, stream);
}

template <typename T>
cudaError_t glm_gradients(int family, int64_t p, int64_t C, bool intercept, double l2, const void* theta,
                          const void* x, const void* y, const int64_t* offsets, const int64_t* rows, int64_t R,
                          const int32_t* batches, int64_t B, void* out, cudaStream_t stream) {
    GlmArgs<T> a = make_args<T>(p, C, intercept, l2, x, y, offsets, rows, R, const_cast<void*>(theta));
    a.batches = batches;
    a.B = B;
    a.out = static_cast<T*>(out);
    return launch<T, kGradients>(family, a, stream);
}

template <typename T>
cudaError_t glm_evaluate(int family, int64_t p, int64_t C, bool intercept, double l2, const void* theta,
                         const void* x, const void* y, const int64_t* offsets, const int64_t* rows, int64_t R,
                         void* loss_sum, int64_t* correct, int64_t* count, cudaStream_t stream) {
    GlmArgs<T> a = make_args<T>(p, C, intercept, l2, x, y, offsets, rows, R, const_cast<void*>(theta));
    a.loss_sum = static_cast<T*>(loss_sum);
    a.correct = correct;
    a.count = count;
    return launch<T, kEvaluate>(family, a, stream);
}

#define PFL_INSTANTIATE(T)                                                                               \
    template cudaError_t glm_local_steps<T>(int, int64_t, int64_t, bool, double, void*, const void*,    \
                                            const void*, const int64_t*, const int64_t*, int64_t,         \
                                            const int32_t*, int64_t, const void*, bool, const void*,      \
                                            int64_t, double, double, cudaStream_t);                       \
    template cudaError_t glm_gradients<T>(int, int64_t, int64_t, bool, double, const void*, const void*, \
                                          const void*, const int64_t*, const int64_t*, int64_t,           \
                                          const int32_t*, int64_t, void*, cudaStream_t);                  \
    template cudaError_t glm_evaluate<T>(int, int64_t, int64_t, bool, double, const void*, const void*,  \
                                         const void*, const int64_t*, const int64_t*, int64_t, void*,     \
                                         int64_t*, int64_t*, cudaStream_t);
PFL_INSTANTIATE(float)
PFL_INSTANTIATE(double)
#undef PFL_INSTANTIATE

}  // namespace pflcore::cuda
