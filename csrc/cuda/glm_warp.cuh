// GLM local steps, gradients and evaluation for small models: one WARP per model row
// (included by glm.cu inside its anonymous namespace; the formulas are glm.cu's).
//
// Why a second kernel: glm.cu's block kernel gives each model row a block of 256 threads and
// each data row a warp whose lanes split the features and finish each logit with 5 shuffles,
// with block barriers between the phases. For Softmax(60, 10) on an H100 that issued ~30
// instructions per multiply-add (Nsight Compute: 82% SM issue, 1.5% DRAM): 5% of the bandwidth
// floor. Here, for P <= kWarpMaxP and C <= kWarpMaxC, a warp owns a model row and takes its
// data rows 32 at a time (a chunk):
//   1. staging: the chunk's rows x_t [nt, p] are copied into the warp's shared memory
//      (coalesced: the lanes split each row's features);
//   2. logits: lane t computes z_t = x_t W (+ b) for its own row, W [P, wc] broadcast from
//      shared memory (every lane reads the same W row: no bank conflict; 16-byte loads), then
//      dz_t = dℓ/dz(z_t) with pflcore/glm.h into its row of DZ;
//   3. gradient: lane l owns parameter rows k = l, l + 32, ... (KPL of them) and adds
//      G[k, c] += x_t[k]·dz_t[c] for t ascending, G in registers (dz_t broadcast).
// Only __syncwarp orders the phases (no block barrier: the warps of a block are independent).
// Every sum has a fixed order (k ascending in a logit, t ascending in G, lanes in a fixed
// tree for the evaluation's totals): bitwise deterministic, but not the block kernel's bits
// (which kernel runs depends on (P, C) only, never on R or the device).
// Shared memory of a warp (in values of T): W [P, wc] (wc = C rounded up to a 16-byte vector,
// the padding zero), X [32, xs] (xs = p rounded up to odd: lane t reads row t, an odd stride
// puts the 32 rows on distinct banks), Z and DZ [32, wc].

constexpr int kWarpBlockWarps = 4;  // warps (model rows in flight) of a block
constexpr int kWarpBlockThreads = kWarpBlockWarps * kWarpSize;
constexpr int64_t kWarpMaxP = 128;  // parameter rows P = p + intercept: KPL = P / 32 <= 4 per lane
constexpr int64_t kWarpMaxC = 16;   // classes: G holds KPL·16 values per lane

template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
    using type = float4;
    static constexpr int n = 4;
    __device__ static void unpack(const float4 v, float* o) { o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w; }
};
template <>
struct Vec16<double> {
    using type = double2;
    static constexpr int n = 2;
    __device__ static void unpack(const double2 v, double* o) { o[0] = v.x; o[1] = v.y; }
};

// Offsets (in values of T) of the regions of one warp; every region and row starts 16-byte aligned.
struct WarpLayout {
    int64_t xs, wc;            // row strides of X and of W, Z, DZ
    int64_t W, X, Z, DZ, per_warp;
    bool batched_stage = false;  // PFLCORE_CUDA_GLM=warp_batched: the staging of kStage rows at once
    __host__ __device__ WarpLayout(int64_t p, int64_t P, int64_t C, int64_t vec) {
        xs = p % 2 == 1 ? p : p + 1;
        wc = (C + vec - 1) / vec * vec;
        const auto up = [vec](int64_t n) { return (n + vec - 1) / vec * vec; };
        W = 0;
        X = W + up(P * wc);
        Z = X + up(kWarpSize * xs);
        DZ = Z + kWarpSize * wc;
        per_warp = DZ + kWarpSize * wc;
    }
};

// acc[c] += xv·w[c] for c < C (w: a row of W or DZ in shared memory, 16-byte aligned, padded
// with zeros to a whole vector). CMAX is the register capacity; the loop stops at C.
template <typename T, int CMAX>
__device__ __forceinline__ void axpy_row(T (&acc)[CMAX], T xv, const T* w, int64_t C) {
    using V = Vec16<T>;
    if constexpr (CMAX >= V::n) {
        const auto* wv = reinterpret_cast<const typename V::type*>(w);
#pragma unroll
        for (int q = 0; q < CMAX / V::n; ++q) {
            if (q * V::n >= C) break;
            T v[V::n];
            V::unpack(wv[q], v);
#pragma unroll
            for (int u = 0; u < V::n; ++u) acc[q * V::n + u] += xv * v[u];
        }
    } else {
#pragma unroll
        for (int c = 0; c < CMAX; ++c) {
            if (c >= C) break;
            acc[c] += xv * w[c];
        }
    }
}

template <Family F, typename T, int M, int KPL, int CMAX>
__global__ void __launch_bounds__(kWarpBlockThreads, 1) glm_warp_kernel(const GlmArgs<T> a, const WarpLayout L) {
    using Y = label_t<F, T>;
    if (a.skip_if && *a.skip_if) return;  // a fault was screened: the launch is a no-op
    // rows staged at once (batched_stage): kStage·KPL values of T a lane in registers
    constexpr int kStage = KPL * sizeof(T) <= 8 ? 8 : KPL * sizeof(T) <= 16 ? 4 : 2;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    T* const base = reinterpret_cast<T*>(smem) + warp * L.per_warp;
    T* const W = base + L.W;    // [P, wc]
    T* const X = base + L.X;    // [32, xs]
    T* const Z = base + L.Z;    // [32, wc]
    T* const DZ = base + L.DZ;  // [32, wc]
    const int64_t p = a.p, C = a.C, P = p + (a.intercept ? 1 : 0), d = P * C;
    const int64_t xs = L.xs, wc = L.wc;
    const int Wn = static_cast<int>(P * wc), iwc = static_cast<int>(wc), ip = static_cast<int>(p);  // P, C bounded
    const Y* y = static_cast<const Y*>(a.y);
    const int64_t stride = int64_t(gridDim.x) * kWarpBlockWarps;

    // Z and DZ (contiguous) zeroed once: their padding columns, which the 16-byte loads of a row
    // read, stay 0 (only c < C is ever written)
    for (int i = lane; i < 2 * kWarpSize * iwc; i += kWarpSize) Z[i] = T(0);
    bool first = true;
    for (int64_t r = int64_t(blockIdx.x) * kWarpBlockWarps + warp; r < a.R; r += stride) {  // warp-uniform
        const int64_t client = a.rows[r];
        const int64_t lo = a.offsets[client], n = a.offsets[client + 1] - lo;
        const int64_t nb = a.batches ? a.B : n;
        T* const theta_r = a.theta + r * a.theta_stride;  // [d]; written only by local steps
        if (a.theta_stride != 0 || first)  // a shared model is loaded once
            for (int i = lane; i < Wn; i += kWarpSize) {
                const int k = i / iwc, c = i - k * iwc;
                W[i] = c < C ? theta_r[int64_t(k) * C + c] : T(0);
            }
        first = false;
        __syncwarp();
        T loss_acc = T(0);  // evaluate: this lane's rows, in row order
        int64_t hit_acc = 0;
        const int64_t steps = M == kLocalSteps ? a.steps : 1;
        for (int64_t s = 0; s < steps; ++s) {
            T G[KPL][CMAX];
#pragma unroll
            for (int j = 0; j < KPL; ++j)
#pragma unroll
                for (int c = 0; c < CMAX; ++c) G[j][c] = T(0);
            for (int64_t t0 = 0; t0 < nb; t0 += kWarpSize) {
                const int nt = static_cast<int>(nb - t0 < kWarpSize ? nb - t0 : kWarpSize);
                int64_t my_row = 0;  // absolute index of this lane's data row
                if (lane < nt)
                    my_row = a.batches ? static_cast<int64_t>(a.batches[(r * steps + s) * a.B + t0 + lane])
                                       : lo + t0 + lane;
                // 1. stage x_t, t < nt (the previous chunk's readers passed the __syncwarp below)
                if (L.batched_stage) {
                    // kStage rows' loads issued before their stores: kStage·KPL loads in flight a
                    // lane, where the loop below has one row's (its loads wait on the store of
                    // the row before)
                    for (int t0s = 0; t0s < nt; t0s += kStage) {
                        T buf[kStage][KPL];
#pragma unroll
                        for (int u = 0; u < kStage; ++u) {
                            const int t = t0s + u;  // past nt: lane t's my_row is 0, a valid row
                            const T* src = a.x + __shfl_sync(kFullMask, my_row, t & (kWarpSize - 1)) * p;
#pragma unroll
                            for (int j = 0; j < KPL; ++j) {
                                const int k = lane + kWarpSize * j;  // KPL·32 >= P >= p
                                buf[u][j] = t < nt && k < ip ? src[k] : T(0);
                            }
                        }
#pragma unroll
                        for (int u = 0; u < kStage; ++u)
#pragma unroll
                            for (int j = 0; j < KPL; ++j) {
                                const int t = t0s + u, k = lane + kWarpSize * j;
                                if (t < nt && k < ip) X[t * xs + k] = buf[u][j];
                            }
                    }
                } else {
                    for (int t = 0; t < nt; ++t) {
                        const T* src = a.x + __shfl_sync(kFullMask, my_row, t) * p;
                        for (int k = lane; k < ip; k += kWarpSize) X[t * xs + k] = src[k];
                    }
                }
                __syncwarp();
                // 2. lane t: the logits and dz of row t
                if (lane < nt) {
                    T acc[CMAX];
#pragma unroll
                    for (int c = 0; c < CMAX; ++c) acc[c] = T(0);
                    const T* xr = X + lane * xs;
#pragma unroll 4
                    for (int k = 0; k < ip; ++k) axpy_row<T, CMAX>(acc, xr[k], W + k * iwc, C);
                    if (a.intercept) axpy_row<T, CMAX>(acc, T(1), W + p * wc, C);
                    T* z = Z + lane * wc;
                    T* dz = DZ + lane * wc;
#pragma unroll
                    for (int c = 0; c < CMAX; ++c)
                        if (c < C) z[c] = acc[c];
                    const Y label = y[my_row];
                    const T l = loss_grad<F, T>(z, C, label, dz);
                    if (M == kEvaluate) {
                        loss_acc += l;
                        hit_acc += is_correct<F, T>(z, C, label);
                    }
                }
                __syncwarp();
                // 3. G[k, c] += x_t[k]·dz_t[c], t ascending; lane owns k = lane + 32j
                if (M != kEvaluate) {
                    for (int t = 0; t < nt; ++t) {
                        const T* xt = X + t * xs;
                        const T* dzt = DZ + t * wc;  // the same address in every lane: a broadcast
#pragma unroll
                        for (int j = 0; j < KPL; ++j) {
                            const int k = lane + kWarpSize * j;
                            const T xv = k < ip ? xt[k] : (k == ip ? T(1) : T(0));  // k = p: the intercept
                            axpy_row<T, CMAX>(G[j], xv, dzt, C);
                        }
                    }
                }
                __syncwarp();  // X, Z, DZ are rewritten by the next chunk
            }
            if (M == kLocalSteps) {
                const T scale = (a.grad_scale ? a.grad_scale[r] : T(1)) / static_cast<T>(nb);
                const T* anc = a.anchor ? a.anchor + (a.anchor_shared ? 0 : r * d) : nullptr;
#pragma unroll
                for (int j = 0; j < KPL; ++j) {
                    const int64_t k = lane + kWarpSize * j;
                    if (k >= P) break;
#pragma unroll
                    for (int c = 0; c < CMAX; ++c) {
                        if (c >= C) break;
                        const T w = W[k * wc + c];
                        const T av = anc ? anc[k * C + c] : T(0);
                        W[k * wc + c] = w - a.lr * (scale * G[j][c] + a.l2 * w + a.prox * (w - av));
                    }
                }
                __syncwarp();  // the next step's logits read every lane's rows of W
            } else if (M == kGradients) {
                T* out_r = a.out + r * d;
#pragma unroll
                for (int j = 0; j < KPL; ++j) {
                    const int64_t k = lane + kWarpSize * j;
                    if (k >= P) break;
#pragma unroll
                    for (int c = 0; c < CMAX; ++c) {
                        if (c >= C) break;
                        out_r[k * C + c] = G[j][c] / static_cast<T>(nb) + a.l2 * W[k * wc + c];
                    }
                }
            }
        }
        if (M == kLocalSteps)
            for (int i = lane; i < Wn; i += kWarpSize) {
                const int k = i / iwc, c = i - k * iwc;
                if (c < C) theta_r[int64_t(k) * C + c] = W[i];
            }
        if (M == kEvaluate) {
#pragma unroll
            for (int off = kWarpSize / 2; off > 0; off >>= 1) {  // a fixed tree: deterministic
                loss_acc += __shfl_xor_sync(kFullMask, loss_acc, off);
                hit_acc += __shfl_xor_sync(kFullMask, hit_acc, off);
            }
            if (lane == 0) {
                a.loss_sum[r] = loss_acc;
                a.correct[r] = hit_acc;
                a.count[r] = nb;
            }
        }
        __syncwarp();  // W is reloaded for the next model row
    }
}

// Whether the warp kernel takes this shape, and its layout and shared memory per block.
template <typename T>
bool warp_plan(int64_t p, int64_t C, bool intercept, int optin, WarpLayout* layout, int64_t* smem) {
    const int64_t P = p + (intercept ? 1 : 0);
    if (P > kWarpMaxP || C > kWarpMaxC || p < 1) return false;
    // PFLCORE_CUDA_GLM: "block", glm.cu's kernel for every shape; "warp_batched", this kernel with
    // the staging of several rows' loads at once (written after the 2026-11-27 H100 run showed
    // the row-by-row staging latency-bound; not yet run on a GPU, hence not the default); A/B, tests
    const char* force = std::getenv("PFLCORE_CUDA_GLM");
    if (force && std::strcmp(force, "block") == 0) return false;
    *layout = WarpLayout(p, P, C, Vec16<T>::n);
    layout->batched_stage = force && std::strcmp(force, "warp_batched") == 0;
    *smem = kWarpBlockWarps * layout->per_warp * int64_t(sizeof(T));
    return *smem <= optin;
}

template <Family F, typename T, int M, int KPL>
cudaError_t launch_warp_kpl(const GlmArgs<T>& a, const WarpLayout& L, int64_t smem, cudaStream_t stream) {
    constexpr int CMAX = F == Family::Softmax ? int(kWarpMaxC) : 1;
    auto kernel = glm_warp_kernel<F, T, M, KPL, CMAX>;
    if (smem > kDefaultSmem) {
        const cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
        if (err != cudaSuccess) return err;
    }
    const int64_t blocks = (a.R + kWarpBlockWarps - 1) / kWarpBlockWarps;
    const int64_t grid = blocks < kMaxGrid ? blocks : kMaxGrid;  // the kernel grid-strides past it
    kernel<<<static_cast<unsigned>(grid), kWarpBlockThreads, static_cast<size_t>(smem), stream>>>(a, L);
    return cudaGetLastError();
}

template <Family F, typename T, int M>
cudaError_t launch_warp(const GlmArgs<T>& a, const WarpLayout& L, int64_t smem, cudaStream_t stream) {
    const int64_t P = a.p + (a.intercept ? 1 : 0);
    if (P <= 64) return launch_warp_kpl<F, T, M, 2>(a, L, smem, stream);
    return launch_warp_kpl<F, T, M, 4>(a, L, smem, stream);
}
