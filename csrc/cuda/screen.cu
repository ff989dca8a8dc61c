// The value screen of an untrusted local_steps / gradients / evaluate call on the GPU: one
// kernel and one host read, in place of ~20 small torch ops (each ~5-8 µs of launch time on the
// CPU) that pflcore/backends/_values.py queues for the same flag. It answers only "may this
// call hold a fault?"; when it says yes, the adapter runs the exact checks of _faults.py, which
// raise the first fault or clear a false alarm. So it may flag more than _values._glm_flags
// (it does: an empty batches tensor is screened like none), never less. Finiteness is tested
// per element, so a finite sum that overflows is no false alarm here.
//
// One grid-stride pass per segment, in turn: theta, anchor, grad_scale (every element); the
// model rows (row index in [0, m), the client's offsets a non-empty range inside [0, N)); the
// batch indices (inside their row's client); the data: every row of x and y when the call
// reads them all (no batches, or at least N indices), else the rows at the batch indices
// (clamped into [0, N): an index out of range is flagged by its own segment).

#include <cuda_runtime.h>

#include <cstdint>

namespace pflcore::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 2048;  // enough to stream x at full bandwidth; grid-stride beyond

// By the exponent bits, not isfinite(): stays right under --use_fast_math, which may assume
// no NaN or inf and fold isfinite() to true.
__device__ __forceinline__ bool nonfinite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool nonfinite(double v) {
    return (static_cast<unsigned long long>(__double_as_longlong(v)) & 0x7ff0000000000000ull) ==
           0x7ff0000000000000ull;
}

// An index clamped into [0, N): one out of range is flagged on its own, what it reads then
// does not matter.
__device__ __forceinline__ int64_t clamp_row(int64_t b, int64_t N) { return b < 0 ? 0 : b >= N ? N - 1 : b; }

template <typename T>
__device__ __forceinline__ bool any_nonfinite(const T* __restrict__ a, int64_t n, int64_t first, int64_t stride) {
    bool bad = false;
    for (int64_t e = first; e < n; e += stride) bad |= nonfinite(a[e]);
    return bad;
}

// [lo, hi) of model row r's client, and whether the row index or that range is a fault. A row
// index out of range is clamped (what it reads then does not matter: the call is flagged).
__device__ __forceinline__ bool client_range(const int64_t* __restrict__ offsets, int64_t m, int64_t N,
                                             const int64_t* __restrict__ rows, int64_t r, int64_t& lo,
                                             int64_t& hi) {
    const int64_t raw = rows ? rows[r] : r;
    const int64_t c = raw < 0 ? 0 : raw >= m ? m - 1 : raw;  // m >= 1 (the host checks)
    lo = offsets[c];
    hi = offsets[c + 1];
    return raw < 0 || raw >= m || !(lo >= 0 && lo < hi && hi <= N);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
glm_screen_kernel(const T* __restrict__ theta, int64_t n_theta,        // [R, d] or [d]: every element
                  const T* __restrict__ anchor, int64_t n_anchor,      // [R, d] or [d], or null (n 0)
                  const T* __restrict__ grad_scale, int64_t n_grad_scale,  // [R], or null (n 0)
                  const T* __restrict__ x,                             // [N, p]
                  const void* __restrict__ y,                          // [N] int64 labels or T values
                  bool classifier, int64_t num_classes, int64_t N, int64_t p,
                  const int64_t* __restrict__ offsets, int64_t m,      // [m + 1]
                  const int64_t* __restrict__ rows, int64_t R,         // [R], or null: row r is client r
                  const int32_t* __restrict__ batches, int64_t n_batches,  // [R, per_row] flattened, or null
                  int32_t* __restrict__ flag)                          // [1] ORed with 1 on a fault
{
    const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
    const int64_t stride = int64_t(gridDim.x) * kThreads;
    bool bad = any_nonfinite(theta, n_theta, first, stride);
    bad |= any_nonfinite(anchor, n_anchor, first, stride);
    bad |= any_nonfinite(grad_scale, n_grad_scale, first, stride);
    const int64_t* labels = static_cast<const int64_t*>(y);
    const T* values = static_cast<const T*>(y);
    int64_t lo, hi;
    for (int64_t r = first; r < R; r += stride) bad |= client_range(offsets, m, N, rows, r, lo, hi);
    if (n_batches > 0) {
        // 32-bit division (the host flags n_batches >= 2^32 instead): a 64-bit one is a call
        // that makes the kernel spill
        const uint32_t per_row = static_cast<uint32_t>(n_batches / R);  // steps·B, or B
        for (int64_t e = first; e < n_batches; e += stride) {
            bad |= client_range(offsets, m, N, rows, static_cast<uint32_t>(e) / per_row, lo, hi);
            bad |= batches[e] < lo || batches[e] >= hi;
        }
    }
    if (N > 0) {
        if (n_batches == 0 || n_batches >= N) {  // every row is read (or reading all is cheaper)
            for (int64_t i = first; i < N; i += stride)
                bad |= classifier ? labels[i] < 0 || labels[i] >= num_classes : nonfinite(values[i]);
            bad |= any_nonfinite(x, N * p, first, stride);
        } else {  // the rows at the batch indices only
            for (int64_t e = first; e < n_batches; e += stride) {
                const int64_t i = clamp_row(batches[e], N);
                bad |= classifier ? labels[i] < 0 || labels[i] >= num_classes : nonfinite(values[i]);
            }
            // one warp per batch index, its lanes over the row's columns (coalesced, no division)
            const int lane = threadIdx.x & 31;
            for (int64_t e = first >> 5; e < n_batches; e += stride >> 5) {
                const T* row = x + clamp_row(batches[e], N) * p;
                for (int64_t c = lane; c < p; c += 32) bad |= nonfinite(row[c]);
            }
        }
    }
    // one atomic per warp that found something (every thread of the grid reaches this vote)
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) atomicOr(flag, 1);
}

int64_t work_of(int64_t a, int64_t b) { return a > b ? a : b; }

}  // namespace

// *host <- *flag after the work queued on `stream` (a copy, then a wait: `found` lives on the stack).
cudaError_t read_flag(const int32_t* flag, int* host, cudaStream_t stream) {
    int32_t found = 0;
    cudaError_t err = cudaMemcpyAsync(&found, flag, sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
    if (err != cudaSuccess) return err;
    err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return err;
    *host = found;
    return cudaSuccess;
}

// Queues the screen on `stream` without waiting: flag <- 0, then the kernel ORs 1 into it on a
// fault. *decided <- 1 (and nothing is queued) when the host already knows the call must go to
// the exact checks: model rows but no client, or more batch indices than the kernel's 32-bit
// division takes. local_steps_screened queues the GLM kernel behind it, which reads the flag.
template <typename T>
cudaError_t glm_screen_queue(const void* theta, int64_t n_theta, const void* anchor, int64_t n_anchor,
                             const void* grad_scale, int64_t n_grad_scale, const void* x, const void* y,
                             bool classifier, int64_t num_classes, int64_t N, int64_t p, const int64_t* offsets,
                             int64_t m, const int64_t* rows, int64_t R, const int32_t* batches, int64_t n_batches,
                             int32_t* flag, int* decided, cudaStream_t stream) {
    *decided = 0;
    if (R > 0 && m < 1) {  // model rows but no client to read: a fault, and nothing to clamp into
        *decided = 1;
        return cudaSuccess;
    }
    if (R == 0) {  // nothing is read but theta (as _values._glm_flags)
        n_anchor = n_grad_scale = n_batches = N = 0;
    }
    if (n_batches > 0 && n_batches % R != 0) return cudaErrorInvalidValue;  // not [R, ...]
    if (n_batches >= (int64_t(1) << 32)) {  // past the kernel's 32-bit index division: let the exact pass look
        *decided = 1;
        return cudaSuccess;
    }
    cudaError_t err = cudaMemsetAsync(flag, 0, sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
    int64_t work = work_of(work_of(n_theta, n_anchor), work_of(n_grad_scale, R));
    work = work_of(work, n_batches * 32);  // a warp per gathered row
    if (N > 0) work = work_of(work, N * (p > 0 ? p : 1));
    if (work == 0) return cudaSuccess;  // nothing to read: the flag stays 0
    int64_t blocks = (work + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocks) blocks = kMaxBlocks;
    glm_screen_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const T*>(theta), n_theta, static_cast<const T*>(anchor), n_anchor,
        static_cast<const T*>(grad_scale), n_grad_scale, static_cast<const T*>(x), y, classifier, num_classes, N, p,
        offsets, m, rows, R, batches, n_batches, flag);
    return cudaGetLastError();
}

// *host_flag <- the flag read back: nonzero when the call may hold a fault (see the top of this
// file). Queues the screen and a copy on `stream`, then waits for it: the one synchronization of
// a screened call. flag: [1] int32 device scratch. batches null with n_batches 0: no batches.
template <typename T>
cudaError_t glm_screen(const void* theta, int64_t n_theta, const void* anchor, int64_t n_anchor,
                       const void* grad_scale, int64_t n_grad_scale, const void* x, const void* y, bool classifier,
                       int64_t num_classes, int64_t N, int64_t p, const int64_t* offsets, int64_t m,
                       const int64_t* rows, int64_t R, const int32_t* batches, int64_t n_batches, int32_t* flag,
                       int* host_flag, cudaStream_t stream) {
    int decided = 0;
    cudaError_t err = glm_screen_queue<T>(theta, n_theta, anchor, n_anchor, grad_scale, n_grad_scale, x, y,
                                          classifier, num_classes, N, p, offsets, m, rows, R, batches, n_batches,
                                          flag, &decided, stream);
    if (err != cudaSuccess) return err;
    *host_flag = decided;
    if (decided) return cudaSuccess;
    return read_flag(flag, host_flag, stream);
}

#define PFL_INSTANTIATE_QUEUE(T)                                                                          \
    template cudaError_t glm_screen_queue<T>(const void*, int64_t, const void*, int64_t, const void*, int64_t,   \
                                             const void*, const void*, bool, int64_t, int64_t, int64_t,          \
                                             const int64_t*, int64_t, const int64_t*, int64_t, const int32_t*,    \
                                             int64_t, int32_t*, int*, cudaStream_t);
PFL_INSTANTIATE_QUEUE(float)
PFL_INSTANTIATE_QUEUE(double)
#undef PFL_INSTANTIATE_QUEUE
template cudaError_t glm_screen<float>(const void*, int64_t, const void*, int64_t, const void*, int64_t, const void*,
                                       const void*, bool, int64_t, int64_t, int64_t, const int64_t*, int64_t,
                                       const int64_t*, int64_t, const int32_t*, int64_t, int32_t*, int*,
                                       cudaStream_t);
template cudaError_t glm_screen<double>(const void*, int64_t, const void*, int64_t, const void*, int64_t,
                                        const void*, const void*, bool, int64_t, int64_t, int64_t, const int64_t*,
                                        int64_t, const int64_t*, int64_t, const int32_t*, int64_t, int32_t*, int*,
                                        cudaStream_t);

}  // namespace pflcore::cuda
