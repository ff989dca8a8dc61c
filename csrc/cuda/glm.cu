// GLM local steps, gradients and evaluation on the GPU (DESIGN.md §3, §4).
//
// One thread block per model row r (client i = rows[r]) runs the row's whole loop in one
// launch. For local_steps, for s = 0..steps-1:
//   G = Σ_{t ∈ B_{r,s}} x_t ⊗ dℓ/dz(z_t, y_t),   z_t = x_t W (+ b)
//   W ← W − lr·( grad_scale[r]·G/|B_{r,s}| + l2·W + prox·(W − a_r) )
// gradients: out_r = G/|B_r| + l2·W; evaluate: loss_r = Σ_{t ∈ B_r} ℓ(z_t, y_t), correct_r, count_r = |B_r|,
// where B_r = batches[r] ([R, B]: a sample of the client's rows) or all n_i rows of client i.
// gradients and evaluate also take one model [d] for every row (theta_stride = 0): no [R, d] copy.
// The per-row loss and dℓ/dz are those of pflcore/glm.h (host+device, shared with the CPU).
//
// Layout of a block (kWarps warps): the rows of a batch are taken nt at a time (a chunk).
//  1. logits: warp w takes rows t = w, w + kWarps, ...; its lanes split the features of a row
//     (coalesced loads), accumulate kClassGroup logits at a time and finish them with
//     xor-shuffles; lane 0 stores z_t and then dz_t = dℓ/dz(z_t) in shared memory.
//  2. gradient: thread e owns parameters e, e + kThreads, ...: G[k, c] += Σ_{t<nt} x_t[k]·dz_t[c]
//     with t ascending, so every sum has a fixed order: no atomics, bitwise deterministic.
// W and G live in shared memory when they fit (loaded once, stored once; evaluate has no G);
// otherwise W is the row of theta itself (updated in place) and G a global scratch row of the
// block: scratch is [gridDim.x, d], block b uses row b for every model row it takes (grid
// stride), so the launch caps the grid at the blocks that can be resident at once and the
// scratch stays O(resident blocks · d), not O(R · d). The caller allocates it (torch's caching
// allocator: see glm_scratch_rows). Memory written by one phase and read by another is always
// separated by __syncthreads().
// Shared-memory W and G are [P, ws] with ws = C rounded up to an odd number: in the logits phase
// lane l reads W[(l + 32j)·ws + c], and an odd row stride puts the 32 lanes (float) or each
// half-warp (double) on distinct banks; with ws = C = 16 they hit 2 banks (16-way conflicts).
// The padding moves values, never changes a sum, so results are the same bits as unpadded.

#include <cuda_pipeline.h>  // glm_warp.cuh: cp.async (warp_fast); included here, outside the namespace
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

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
    const int64_t* rows;       // [R] client of each model row, or null: row r is client r
    int64_t R;
    T* theta;                  // [R, d], or [d] for every row (theta_stride 0); written only by local steps
    int64_t theta_stride;      // d, or 0: one shared model (gradients, evaluate)
    T* scratch;                // [scratch_rows, d] gradient sums of each block when W, G are not in shared memory
    int64_t scratch_rows;      // the grid is capped at it
    T* out;                    // [R, d] gradients
    const int32_t* batches;    // [R, steps, B] (local steps) or [R, B] (gradients, evaluate); null = full batch
    int64_t B;
    const T* anchor;           // [R, d] or [d] (anchor_shared) or null
    bool anchor_shared;
    const T* grad_scale;       // [R] or null (= 1)
    int64_t steps;
    T lr, prox;
    T* loss_sum;               // [R] evaluate
    int64_t* correct;          // [R] evaluate
    int64_t* count;            // [R] evaluate
    const int32_t* skip_if;    // [1] or null: a set flag (the value screen queued before) makes the launch a no-op
    int nt;                    // rows per chunk, 1..kMaxChunkRows
    int64_t ws;                // row stride of W and G: C, or C + 1 (odd) in shared memory
    bool params_in_smem;
};

inline __host__ __device__ int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Byte offsets of the dynamic shared memory of a block. Wn = P·ws values for W (and for G when
// with_G: evaluate has no gradient and reserves none).
struct SmemLayout {
    int64_t W, G, z, dz, loss, idx, hit, total;
    __host__ __device__ SmemLayout(int64_t Wn, int64_t C, int nt, bool params, bool with_G, int64_t tsize) {
        W = 0;
        G = params ? align16(Wn * tsize) : 0;
        z = params ? G + (with_G ? align16(Wn * tsize) : 0) : 0;
        dz = z + align16(nt * C * tsize);
        loss = dz + align16(nt * C * tsize);
        idx = loss + align16(nt * tsize);
        hit = idx + align16(nt * int64_t(sizeof(int64_t)));
        total = hit + align16(nt * int64_t(sizeof(int64_t)));
    }
};

// The parameters e = tid, tid + kThreads, ... of a thread with e = k·C + c: kThreads = dk·C + dc,
// so each step adds (dk, dc) and carries c into k, exact and division-free (C <= 2048 < 2^31).
struct Walk {
    int64_t e, k, c, dk, dc;
    __device__ Walk(int tid, int64_t C)
        : e(tid), k(tid / static_cast<int>(C)), c(tid % static_cast<int>(C)),
          dk(kThreads / static_cast<int>(C)), dc(kThreads % static_cast<int>(C)) {}
    __device__ void next(int64_t C) {
        e += kThreads;
        k += dk;
        c += dc;
        if (c >= C) {  // dc < C, so one carry at most
            c -= C;
            ++k;
        }
    }
};

// Blocks per SM the register budget must allow: 3 (at most 80 registers a thread), but 2 (128)
// for softmax local steps in float64, which spills 44-52 bytes within 80. With the bound on
// threads alone ptxas chose 48-80 registers and spilled up to 40 bytes (nvcc -Xptxas -v); with
// these budgets no variant spills, on sm_80 or sm_90.
template <Family F, typename T, int M>
constexpr int kMinBlocks = (F == Family::Softmax && sizeof(T) == 8 && M == kLocalSteps) ? 2 : 3;

template <Family F, typename T, int M>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<F, T, M>)) glm_kernel(const GlmArgs<T> a) {
    using Y = label_t<F, T>;
    extern __shared__ __align__(16) unsigned char smem[];
    const int64_t p = a.p, C = a.C, P = p + (a.intercept ? 1 : 0), d = P * C;
    const int64_t ws = a.ws;  // == C unless W, G are padded rows in shared memory
    const SmemLayout L(P * ws, C, a.nt, a.params_in_smem, M != kEvaluate, sizeof(T));
    T* zs = reinterpret_cast<T*>(smem + L.z);            // [nt, C] logits
    T* dzs = reinterpret_cast<T*>(smem + L.dz);          // [nt, C] d loss / d logits
    T* row_loss = reinterpret_cast<T*>(smem + L.loss);   // [nt]
    int64_t* ridx = reinterpret_cast<int64_t*>(smem + L.idx);  // [nt] absolute row indices
    int64_t* row_hit = reinterpret_cast<int64_t*>(smem + L.hit);  // [nt]
    const Y* y = static_cast<const Y*>(a.y);
    if (a.skip_if && *a.skip_if) return;  // the whole block, before any barrier: a fault was screened
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    // parameter e = k·C + c of a model row lives at k·ws + c in W and G; Walk gives (k, c)
    // without a 64-bit division per parameter (a long emulated sequence on the GPU)

    for (int64_t r = blockIdx.x; r < a.R; r += gridDim.x) {
        // null rows: model row r is client r. (Written with the address first: `a.rows ? a.rows[r]
        // : r` made sm_80's float64 least-squares and logistic local steps spill 28 bytes.)
        const int64_t* const row_of = a.rows ? a.rows + r : nullptr;
        const int64_t client = row_of ? *row_of : r;
        const int64_t lo = a.offsets[client], n = a.offsets[client + 1] - lo;
        const int64_t nb = a.batches ? a.B : n;
        T* theta_r = a.theta + r * a.theta_stride;  // [d]
        T* W = theta_r;  // read-only unless M == kLocalSteps
        T* G = M == kGradients ? a.out + r * d : (a.scratch ? a.scratch + int64_t(blockIdx.x) * d : nullptr);
        if (a.params_in_smem) {
            W = reinterpret_cast<T*>(smem + L.W);
            G = M == kEvaluate ? nullptr : reinterpret_cast<T*>(smem + L.G);
            // a shared model is never written: a block loads it for its first row only
            if (a.theta_stride != 0 || r == blockIdx.x)
                for (Walk w(tid, C); w.e < d; w.next(C)) W[w.k * ws + w.c] = theta_r[w.e];
        }
        T loss_acc = T(0);   // evaluate, thread 0
        int64_t hit_acc = 0;
        const int64_t steps = M == kLocalSteps ? a.steps : 1;
        for (int64_t s = 0; s < steps; ++s) {
            if (M != kEvaluate)
                for (Walk w(tid, C); w.e < d; w.next(C)) G[w.k * ws + w.c] = T(0);
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
                            const T* wk = W + k * ws + c0;  // odd ws: lanes on distinct banks
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
                    for (Walk w(tid, C); w.e < d; w.next(C)) {
                        const int64_t k = w.k, c = w.c;
                        T g = T(0);
                        for (int t = 0; t < nt; ++t) {
                            const T xv = k < p ? a.x[ridx[t] * p + k] : T(1);
                            g += xv * dzs[t * C + c];
                        }
                        G[k * ws + c] += g;
                    }
                }
                __syncthreads();  // ridx, zs, dzs are rewritten by the next chunk
            }
            if (M == kLocalSteps) {
                const T scale = (a.grad_scale ? a.grad_scale[r] : T(1)) / static_cast<T>(nb);
                const T* anc = a.anchor ? a.anchor + (a.anchor_shared ? 0 : r * d) : nullptr;
                for (Walk it(tid, C); it.e < d; it.next(C)) {
                    const int64_t i = it.k * ws + it.c;
                    const T w = W[i];
                    const T av = anc ? anc[it.e] : T(0);
                    W[i] = w - a.lr * (scale * G[i] + a.l2 * w + a.prox * (w - av));
                }
                __syncthreads();  // the next step's logits read the new W
            }
        }
        if (M == kLocalSteps && a.params_in_smem)
            for (Walk w(tid, C); w.e < d; w.next(C)) theta_r[w.e] = W[w.k * ws + w.c];
        if (M == kGradients) {
            T* out_r = a.out + r * d;  // G is out_r itself when not in shared memory: same e, same thread
            for (Walk w(tid, C); w.e < d; w.next(C)) {
                const int64_t i = w.k * ws + w.c;
                out_r[w.e] = G[i] / static_cast<T>(nb) + a.l2 * W[i];
            }
        }
        if (M == kEvaluate && tid == 0) {
            a.loss_sum[r] = loss_acc;
            a.correct[r] = hit_acc;
            a.count[r] = nb;  // the batch's rows, or all of the client's
        }
        __syncthreads();  // the next row (grid stride) reuses shared memory
    }
}

// How a launch lays out a block: rows per chunk, the row stride of W and G, whether they fit
// shared memory, and the dynamic shared memory. A function of the problem's shape and the
// device only: glm_scratch_rows and the launch agree on it.
struct Plan {
    int nt;
    int64_t ws;
    bool params_in_smem;
    int64_t smem;
};

template <typename T, int M>
cudaError_t make_plan(int64_t p, int64_t C, bool intercept, Plan* out) {
    const int64_t P = p + (intercept ? 1 : 0);
    int device = 0, optin = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    const int64_t tsize = sizeof(T);
    const int64_t per_row = 2 * C * tsize;  // z and dz of one row
    if (per_row > kChunkScratchBytes) return cudaErrorInvalidValue;  // C too large (checked in the binding)
    const int nt = static_cast<int>(kChunkScratchBytes / per_row < kMaxChunkRows ? kChunkScratchBytes / per_row
                                                                                 : kMaxChunkRows);
    const bool with_G = M != kEvaluate;
    // Padded rows when they fit, else unpadded (the same capacity as without padding), else
    // W and G stay in global memory.
    int64_t ws = C % 2 == 0 ? C + 1 : C;
    bool in_smem = SmemLayout(P * ws, C, nt, true, with_G, tsize).total <= optin;
    if (!in_smem) {
        ws = C;
        in_smem = SmemLayout(P * ws, C, nt, true, with_G, tsize).total <= optin;
    }
    const int64_t smem = SmemLayout(P * ws, C, nt, in_smem, with_G, tsize).total;
    if (smem > optin) return cudaErrorInvalidValue;  // cannot happen for C within the limit above
    *out = Plan{nt, ws, in_smem, smem};
    return cudaSuccess;
}

// Scratch rows a local-steps launch uses: 0 when W and G fit shared memory, else one per block
// that can be resident at once (more blocks would only queue; the grid is capped there).
template <Family F, typename T>
cudaError_t scratch_rows_family(int64_t p, int64_t C, bool intercept, int64_t* rows) {
    Plan plan{};
    cudaError_t err = make_plan<T, kLocalSteps>(p, C, intercept, &plan);
    if (err != cudaSuccess) return err;
    *rows = 0;
    if (plan.params_in_smem) return cudaSuccess;
    int device = 0, sms = 0, per_sm = 0;
    err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    // plan.smem <= 48 KiB here (no parameters in it): no opt-in attribute is needed to query
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, glm_kernel<F, T, kLocalSteps>, kThreads,
                                                        static_cast<size_t>(plan.smem));
    if (err != cudaSuccess) return err;
    *rows = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
    return cudaSuccess;
}

#include "glm_warp.cuh"

cudaError_t optin_smem(int* optin) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    return cudaDeviceGetAttribute(optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

template <Family F, typename T, int M>
cudaError_t launch_family(GlmArgs<T> a, cudaStream_t stream) {
    int optin = 0;
    cudaError_t err = optin_smem(&optin);
    if (err != cudaSuccess) return err;
    WarpLayout wl(1, 1, 1, 1);
    int64_t wsmem = 0;
    if (warp_plan<T>(a.p, a.C, a.intercept, optin, &wl, &wsmem)) return launch_warp<F, T, M>(a, wl, wsmem, stream);
    Plan plan{};
    err = make_plan<T, M>(a.p, a.C, a.intercept, &plan);
    if (err != cudaSuccess) return err;
    a.nt = plan.nt;
    a.ws = plan.ws;
    a.params_in_smem = plan.params_in_smem;
    if (plan.smem > kDefaultSmem) {
        err = cudaFuncSetAttribute(glm_kernel<F, T, M>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(plan.smem));
        if (err != cudaSuccess) return err;
    }
    int64_t grid = a.R < kMaxGrid ? a.R : kMaxGrid;  // gridDim.x limit; the kernel grid-strides past it
    if (M == kLocalSteps && !plan.params_in_smem) {
        // G in the caller's scratch [scratch_rows, d], one row per block. The caller allocates it
        // with torch's caching allocator on this stream (stream-ordered reuse, no device-wide
        // synchronization, no cudaMallocAsync pool that frees to the OS at every sync).
        if (!a.scratch || a.scratch_rows < 1) return cudaErrorInvalidValue;
        if (grid > a.scratch_rows) grid = a.scratch_rows;
    } else {
        a.scratch = nullptr;
    }
    glm_kernel<F, T, M><<<static_cast<unsigned>(grid), kThreads, static_cast<size_t>(plan.smem), stream>>>(a);
    return cudaGetLastError();
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
    a.theta_stride = (p + (intercept ? 1 : 0)) * C;
    a.steps = 1;
    return a;
}

}  // namespace

// Largest C the kernels take: z and dz of one row must fit the chunk's shared scratch.
int64_t glm_max_classes(bool f64) { return kChunkScratchBytes / (2 * (f64 ? 8 : 4)); }

// Rows of the scratch a local_steps launch for this shape needs on the current device
// (0: none). The caller allocates [min(R, rows), d] values and passes them with their count.
template <typename T>
cudaError_t glm_scratch_rows(int family, int64_t p, int64_t C, bool intercept, int64_t* rows) {
    switch (family) {
        case 0: return scratch_rows_family<Family::LeastSquares, T>(p, C, intercept, rows);
        case 1: return scratch_rows_family<Family::Logistic, T>(p, C, intercept, rows);
        case 2: return scratch_rows_family<Family::Softmax, T>(p, C, intercept, rows);
        default: return cudaErrorInvalidValue;
    }
}

template <typename T>
cudaError_t glm_local_steps(int family, int64_t p, int64_t C, bool intercept, double l2, void* theta,
                            const void* x, const void* y, const int64_t* offsets, const int64_t* rows,
                            int64_t R, const int32_t* batches, int64_t B, const void* anchor,
                            bool anchor_shared, const void* grad_scale, int64_t steps, double lr, double prox,
                            void* scratch, int64_t scratch_rows, const int32_t* skip_if, cudaStream_t stream) {
    GlmArgs<T> a = make_args<T>(p, C, intercept, l2, x, y, offsets, rows, R, theta);
    a.skip_if = skip_if;
    a.batches = batches;
    a.B = B;
    a.anchor = static_cast<const T*>(anchor);
    a.anchor_shared = anchor_shared;
    a.grad_scale = static_cast<const T*>(grad_scale);
    a.steps = steps;
    a.lr = static_cast<T>(lr);
    a.prox = static_cast<T>(prox);
    a.scratch = static_cast<T*>(scratch);
    a.scratch_rows = scratch_rows;
    return launch<T, kLocalSteps>(family, a, stream);
}

template <typename T>
cudaError_t glm_gradients(int family, int64_t p, int64_t C, bool intercept, double l2, const void* theta,
                          bool theta_shared, const void* x, const void* y, const int64_t* offsets,
                          const int64_t* rows, int64_t R, const int32_t* batches, int64_t B, void* out,
                          cudaStream_t stream) {
    GlmArgs<T> a = make_args<T>(p, C, intercept, l2, x, y, offsets, rows, R, const_cast<void*>(theta));
    if (theta_shared) a.theta_stride = 0;
    a.batches = batches;
    a.B = B;
    a.out = static_cast<T*>(out);
    return launch<T, kGradients>(family, a, stream);
}

template <typename T>
cudaError_t glm_evaluate(int family, int64_t p, int64_t C, bool intercept, double l2, const void* theta,
                         bool theta_shared, const void* x, const void* y, const int64_t* offsets,
                         const int64_t* rows, int64_t R, const int32_t* batches, int64_t B, void* loss_sum,
                         int64_t* correct, int64_t* count, cudaStream_t stream) {
    GlmArgs<T> a = make_args<T>(p, C, intercept, l2, x, y, offsets, rows, R, const_cast<void*>(theta));
    if (theta_shared) a.theta_stride = 0;
    a.batches = batches;
    a.B = B;
    a.loss_sum = static_cast<T*>(loss_sum);
    a.correct = correct;
    a.count = count;
    return launch<T, kEvaluate>(family, a, stream);
}

#define PFL_INSTANTIATE(T)                                                                                \
    template cudaError_t glm_scratch_rows<T>(int, int64_t, int64_t, bool, int64_t*);                     \
    template cudaError_t glm_local_steps<T>(int, int64_t, int64_t, bool, double, void*, const void*,     \
                                            const void*, const int64_t*, const int64_t*, int64_t,          \
                                            const int32_t*, int64_t, const void*, bool, const void*,       \
                                            int64_t, double, double, void*, int64_t, const int32_t*,      \
                                            cudaStream_t);                                                 \
    template cudaError_t glm_gradients<T>(int, int64_t, int64_t, bool, double, const void*, bool,         \
                                          const void*, const void*, const int64_t*, const int64_t*,        \
                                          int64_t, const int32_t*, int64_t, void*, cudaStream_t);          \
    template cudaError_t glm_evaluate<T>(int, int64_t, int64_t, bool, double, const void*, bool,          \
                                         const void*, const void*, const int64_t*, const int64_t*,         \
                                         int64_t, const int32_t*, int64_t, void*, int64_t*, int64_t*,      \
                                         cudaStream_t);
PFL_INSTANTIATE(float)
PFL_INSTANTIATE(double)
#undef PFL_INSTANTIATE

}  // namespace pflcore::cuda
