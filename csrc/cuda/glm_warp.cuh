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
    bool batched_stage = true;  // the staging of kStage rows at once (PFLCORE_CUDA_GLM=warp_rows: one)
    bool fast = false;           // PFLCORE_CUDA_GLM=warp_fast: glm_warp_fast_kernel (fast_layout)
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
        const int64_t client = a.rows ? a.rows[r] : r;  // null rows: model row r is client r
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

// ---- PFLCORE_CUDA_GLM=warp_fast: the same phases and sums, fewer stalls and instructions ----------
// The SASS of glm_warp_kernel<Softmax, float, local steps, KPL 2, CMAX 16> (sm_90, nvcc 13) for
// Softmax(60, 10), with C a runtime value:
//   staging: a row's load is followed by its store, and a lane's second feature (k = lane + 32)
//     is loaded only after the first one's store: 2 dependent DRAM round trips a row, 64 a
//     chunk, one after the other (~50,000 cycles a chunk at ~800 cycles each: what Nsight
//     measured, with 15% of the SM's issue and 7% of DRAM busy);
//   logits: 134 instructions per 4 features (64 FFMA, 16 LDS.128, 4 LDS, 13 BRA, 24 ISETP: the
//     64-bit `q·4 >= C` tests of axpy_row and its breaks), ~31 issued a feature for 12 useful
//     FFMA, and every LDS.128 waits (~30 cycles) before the next can issue (the branch between);
//   gradient: 76 instructions a row t (32 FFMA, 8 LDS.128: dz_t loaded again for each of the
//     KPL parameter rows, 7 BRA, 14 ISETP), again a load, its FMAs and a branch in series.
// This kernel: (a) C rounded up to CW (a multiple of 4, or 1) is a template argument, W, Z and DZ
// rows are CW values whose padding columns stay zero (W: loaded as zeros, updated for c < C
// only; DZ: zeroed once, loss_grad writes c < C; so the padding only adds exact zeros, and the
// sums of the columns c < C are those of glm_warp_kernel), so the loops over classes are
// unrolled with no branch; (b) X has a column p that holds 1 when there is an intercept (X rows
// are xs >= P values), so the intercept is the logits' last feature (the same FFMA, 1·b + acc, as
// axpy_row's) and the gradient's parameter row p reads it like any other; (c) a chunk is staged
// with cp.async (sm_80+; cuda_pipeline.h copies synchronously before), all of its loads in flight
// at once and no register held, issued as soon as the previous chunk's gradient phase has read
// X (across step boundaries too; a row's labels with them): one DRAM round trip a chunk a warp,
// which the SM's other warps cover, instead of 64 in series. (A second X buffer would overlap it
// with the warp's own compute, but at P = 61 it halves the blocks an SM, 4 to 2.) Every sum
// keeps glm_warp_kernel's order (k ascending with the intercept last, t ascending), so results
// are bitwise deterministic run to run.

// C rounded up to the register width of warp_fast: 1 (least squares, logistic; softmax with one
// class) or a multiple of 4, the class count of its W, Z and DZ rows.
inline int64_t fast_cw(int64_t C) { return C == 1 ? 1 : (C + 3) / 4 * 4; }

// warp_fast's layout: rows of CW values (16-byte aligned for CW > 1: 4 floats, or 2 double2),
// X rows of xs >= P values (odd, as in WarpLayout) so that column p can hold the intercept's 1.
template <typename T>
WarpLayout fast_layout(int64_t P, int64_t C) {
    const int64_t cw = fast_cw(C);
    WarpLayout L(P, P, cw, cw == 1 ? 1 : Vec16<T>::n);  // xs from P, not p; wc = cw
    L.fast = true;
    return L;
}

// acc[c] += xv·w[c], c < CW (w: a row of CW values, 16-byte aligned when CW > 1); compile-time
// trip count: no branch, the loads of a row issued together.
template <typename T, int CW>
__device__ __forceinline__ void axpy_fixed(T (&acc)[CW], T xv, const T* w) {
    using V = Vec16<T>;
    if constexpr (CW % V::n == 0) {
        const auto* wv = reinterpret_cast<const typename V::type*>(w);
        T v[CW];
#pragma unroll
        for (int q = 0; q < CW / V::n; ++q) V::unpack(wv[q], v + q * V::n);
#pragma unroll
        for (int c = 0; c < CW; ++c) acc[c] += xv * v[c];
    } else {
#pragma unroll
        for (int c = 0; c < CW; ++c) acc[c] += xv * w[c];
    }
}

// Register budget of warp_fast. With (128, 1) ptxas took 133 registers for Softmax float KPL 2,
// CW 12 (65536 / (133·128) < 4 blocks: 12 warps an SM where glm_warp_kernel has 16). For KPL 2
// (P <= 64, where X is small enough for 4 blocks) with up to 32 registers of G the bound asks for
// 4 blocks (128 registers; no spill on sm_80, sm_90); past that (float KPL 4 CW 12 spilled 8
// bytes within 128, float64 KPL 4 CW 4 20 bytes) ptxas chooses: X of P > 64 rows limits the
// blocks to 2-3 anyway.
template <typename T, int KPL, int CW>
constexpr int kFastMinBlocks = KPL == 2 && KPL * CW * int(sizeof(T)) / 4 <= 32 ? 4 : 1;
// Unrolling of the logits' loop over k (each unrolled k holds its row of W, CW values, and x_t[k]
// in registers) and of the gradient's loop over t (KPL values of x and CW of dz_t): as far as
// about 32 registers of loads in flight, so that it never costs the occupancy above.
template <typename T, int CW>
constexpr int kFastUnrollK = (CW * int(sizeof(T)) / 4 + 1) * 4 <= 32 ? 4 : (CW * int(sizeof(T)) / 4 + 1) * 2 <= 32 ? 2 : 1;
template <typename T, int KPL, int CW>
constexpr int kFastUnrollT = (KPL + CW) * int(sizeof(T)) / 4 * 2 <= 32 ? 2 : 1;

template <Family F, typename T, int M, int KPL, int CW>
__global__ void __launch_bounds__(kWarpBlockThreads, (kFastMinBlocks<T, KPL, CW>))
    glm_warp_fast_kernel(const GlmArgs<T> a,    // GlmArgs' shapes; rows may be null (row r is client r)
                         const WarpLayout L) {  // fast_layout<T>(P, C): W [P, CW], X [32, xs], Z, DZ [32, CW]
    using Y = label_t<F, T>;
    if (a.skip_if && *a.skip_if) return;  // a fault was screened: the launch is a no-op
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    T* const base = reinterpret_cast<T*>(smem) + warp * L.per_warp;
    T* const W = base + L.W;    // [P, CW]
    T* const X = base + L.X;    // [32, xs]: columns < p the chunk's rows, column p the intercept's 1
    T* const Z = base + L.Z;    // [32, CW]
    T* const DZ = base + L.DZ;  // [32, CW]
    const int64_t p = a.p, C = a.C, P = p + (a.intercept ? 1 : 0), d = P * C;
    const int ip = static_cast<int>(p), iP = static_cast<int>(P), xs = static_cast<int>(L.xs);  // P bounded
    const int Wn = iP * CW;
    const Y* y = static_cast<const Y*>(a.y);
    const int64_t stride = int64_t(gridDim.x) * kWarpBlockWarps;
    // the column of X that parameter row k = lane + 32j reads in the gradient phase: k < P, or any
    // column for the rows past P (their G is never stored)
    int kcol[KPL];
#pragma unroll
    for (int j = 0; j < KPL; ++j) kcol[j] = lane + kWarpSize * j < iP ? lane + kWarpSize * j : 0;

    // Z and DZ (contiguous) zeroed once: their padding columns stay 0 (only c < C is written by
    // loss_grad; Z's padding gets acc's exact zeros); X's column p set once: staging writes k < p
    for (int i = lane; i < 2 * kWarpSize * CW; i += kWarpSize) Z[i] = T(0);
    if (a.intercept) X[lane * xs + ip] = T(1);

    // Issues the copy of chunk (s, t0) into X (asynchronous, one commit group) and loads this
    // lane's row index and label (row t0 + lane; lanes past the chunk keep row 0 and no label).
    // X must be free: the previous chunk's gradient phase passed a __syncwarp. Full batches take
    // rows lo + t0 + t, contiguous: a pointer step a row, no shuffle and no 64-bit multiply (the
    // SASS of a shuffled row address and its copies: ~35 instructions a row, as many as the logits).
    const T* const x = a.x;  // in registers: the lambda's reads of a went through LDC each row
    const int32_t* const batches = a.batches;
    const int64_t B = a.B;
    int64_t my_row = 0;
    Y my_label = Y(0);
    const auto stage = [&](int64_t r, int64_t lo, int64_t nb, int64_t steps, int64_t s, int64_t t0) {
        const int nt = static_cast<int>(nb - t0 < kWarpSize ? nb - t0 : kWarpSize);
        bool live[KPL];  // this lane's features k = lane + 32j of a row
#pragma unroll
        for (int j = 0; j < KPL; ++j) live[j] = lane + kWarpSize * j < ip;
        T* dst = X + lane;
        if (batches) {
            const int32_t* bt = batches + (r * steps + s) * B + t0;  // [nt] rows of the chunk
            const int32_t idx = lane < nt ? bt[lane] : 0;
            my_row = idx;
#pragma unroll 4
            for (int t = 0; t < nt; ++t, dst += xs) {  // warp-uniform trip count: the shuffle has every lane
                const T* src = x + int64_t(__shfl_sync(kFullMask, idx, t)) * ip + lane;
#pragma unroll
                for (int j = 0; j < KPL; ++j)
                    if (live[j]) __pipeline_memcpy_async(dst + kWarpSize * j, src + kWarpSize * j, sizeof(T));
            }
        } else {
            my_row = lo + t0 + lane;
            const T* src = x + (lo + t0) * p + lane;
#pragma unroll 4
            for (int t = 0; t < nt; ++t, dst += xs, src += p)
#pragma unroll
                for (int j = 0; j < KPL; ++j)
                    if (live[j]) __pipeline_memcpy_async(dst + kWarpSize * j, src + kWarpSize * j, sizeof(T));
        }
        __pipeline_commit();
        if (lane < nt) my_label = y[my_row];  // needed after the logits: its latency hides behind them
        else my_row = 0;
    };

    bool first = true;
    for (int64_t r = int64_t(blockIdx.x) * kWarpBlockWarps + warp; r < a.R; r += stride) {  // warp-uniform
        const int64_t client = a.rows ? a.rows[r] : r;  // null rows: model row r is client r
        const int64_t lo = a.offsets[client], n = a.offsets[client + 1] - lo;
        const int64_t nb = a.batches ? a.B : n;
        const int64_t steps = M == kLocalSteps ? a.steps : 1;
        if (nb > 0) stage(r, lo, nb, steps, 0, 0);  // the first chunk's copy runs while W loads
        T* const theta_r = a.theta + r * a.theta_stride;  // [d]; written only by local steps
        if (a.theta_stride != 0 || first)  // a shared model is loaded once
            for (int i = lane; i < Wn; i += kWarpSize) {
                const int k = i / CW, c = i - k * CW;  // CW a constant: no division
                W[i] = c < C ? theta_r[int64_t(k) * C + c] : T(0);
            }
        first = false;
        __syncwarp();  // W read by every lane (also when nb = 0: the update reads other lanes' W)
        T loss_acc = T(0);  // evaluate: this lane's rows, in row order
        int64_t hit_acc = 0;
        for (int64_t s = 0; s < steps; ++s) {
            T G[KPL][CW];
#pragma unroll
            for (int j = 0; j < KPL; ++j)
#pragma unroll
                for (int c = 0; c < CW; ++c) G[j][c] = T(0);
            for (int64_t t0 = 0; t0 < nb; t0 += kWarpSize) {
                const int nt = static_cast<int>(nb - t0 < kWarpSize ? nb - t0 : kWarpSize);
                __pipeline_wait_prior(0);  // this lane's copies of the chunk landed
                __syncwarp();              // and every lane's
                // 2. lane t: the logits and dz of row t
                if (lane < nt) {
                    T acc[CW];
#pragma unroll
                    for (int c = 0; c < CW; ++c) acc[c] = T(0);
                    const T* xr = X + lane * xs;
#pragma unroll(kFastUnrollK<T, CW>)
                    for (int k = 0; k < iP; ++k) axpy_fixed<T, CW>(acc, xr[k], W + k * CW);  // k = p: the intercept
                    T* z = Z + lane * CW;
                    T* dz = DZ + lane * CW;
#pragma unroll
                    for (int c = 0; c < CW; ++c) z[c] = acc[c];
                    const T l = loss_grad<F, T>(z, C, my_label, dz);
                    if (M == kEvaluate) {
                        loss_acc += l;
                        hit_acc += is_correct<F, T>(z, C, my_label);
                    }
                }
                __syncwarp();
                // 3. G[k, c] += x_t[k]·dz_t[c], t ascending; lane owns k = lane + 32j
                if (M != kEvaluate) {
#pragma unroll(kFastUnrollT<T, KPL, CW>)
                    for (int t = 0; t < nt; ++t) {
                        const T* xt = X + t * xs;
                        const T* dzt = DZ + t * CW;  // the same address in every lane: a broadcast
                        T xv[KPL];
#pragma unroll
                        for (int j = 0; j < KPL; ++j) xv[j] = xt[kcol[j]];
                        // dz_t a vector at a time, used by every j (loaded once, not KPL times);
                        // only a vector of it live: G (KPL·CW values) keeps the registers
                        if constexpr (CW % Vec16<T>::n == 0) {
                            using V = Vec16<T>;
#pragma unroll
                            for (int q = 0; q < CW / V::n; ++q) {
                                T v[V::n];
                                V::unpack(reinterpret_cast<const typename V::type*>(dzt)[q], v);
#pragma unroll
                                for (int j = 0; j < KPL; ++j)
#pragma unroll
                                    for (int u = 0; u < V::n; ++u) G[j][q * V::n + u] += xv[j] * v[u];
                            }
                        } else {
#pragma unroll
                            for (int c = 0; c < CW; ++c) {
                                const T v = dzt[c];
#pragma unroll
                                for (int j = 0; j < KPL; ++j) G[j][c] += xv[j] * v;
                            }
                        }
                    }
                }
                __syncwarp();  // X, Z, DZ are rewritten by the next chunk
                // the next chunk, of this step or the next one: its copy runs during the rest
                if (t0 + kWarpSize < nb) stage(r, lo, nb, steps, s, t0 + kWarpSize);
                else if (s + 1 < steps) stage(r, lo, nb, steps, s + 1, 0);
            }
            if (M == kLocalSteps) {
                const T scale = (a.grad_scale ? a.grad_scale[r] : T(1)) / static_cast<T>(nb);
                const T* anc = a.anchor ? a.anchor + (a.anchor_shared ? 0 : r * d) : nullptr;
#pragma unroll
                for (int j = 0; j < KPL; ++j) {
                    const int64_t k = lane + kWarpSize * j;
                    if (k >= P) break;
#pragma unroll
                    for (int c = 0; c < CW; ++c) {
                        if (c >= C) break;
                        const T w = W[k * CW + c];
                        const T av = anc ? anc[k * C + c] : T(0);
                        W[k * CW + c] = w - a.lr * (scale * G[j][c] + a.l2 * w + a.prox * (w - av));
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
                    for (int c = 0; c < CW; ++c) {
                        if (c >= C) break;
                        out_r[k * C + c] = G[j][c] / static_cast<T>(nb) + a.l2 * W[k * CW + c];
                    }
                }
            }
        }
        if (M == kLocalSteps)
            for (int i = lane; i < Wn; i += kWarpSize) {
                const int k = i / CW, c = i - k * CW;
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
    // By default this kernel with the staging of several rows' loads at once (batched_stage: on
    // the 2026-11-27 H100 run 0.49x the row-at-a-time staging's time at 10^5 clients full batch,
    // 0.73x with B = 20, 0.46x for evaluate; tests/gpu and compute-sanitizer clean).
    // PFLCORE_CUDA_GLM (A/B timing and tests): "block", glm.cu's kernel for every shape;
    // "warp_rows", this kernel staging one row at a time (the default before that run);
    // "warp_fast", glm_warp_fast_kernel (class count in the template, cp.async staging: written
    // after this kernel's SASS, not yet run on a GPU, hence opt-in); "warp_batched", the default.
    const char* force = std::getenv("PFLCORE_CUDA_GLM");
    if (force && std::strcmp(force, "block") == 0) return false;
    if (force && std::strcmp(force, "warp_fast") == 0) {
        *layout = fast_layout<T>(P, C);
    } else {
        *layout = WarpLayout(p, P, C, Vec16<T>::n);
        layout->batched_stage = !(force && std::strcmp(force, "warp_rows") == 0);
    }
    *smem = kWarpBlockWarps * layout->per_warp * int64_t(sizeof(T));
    return *smem <= optin;
}

template <Family F, typename T, int M, int KPL>
cudaError_t launch_warp_kpl(const GlmArgs<T>& a, const WarpLayout& L, int64_t smem, cudaStream_t stream) {
    constexpr int CMAX = F == Family::Softmax ? int(kWarpMaxC) : 1;
    auto kernel = glm_warp_kernel<F, T, M, KPL, CMAX>;
    if (L.fast) {  // fast_layout's row width CW: 1 outside softmax (C = 1)
        if constexpr (F == Family::Softmax) {
            switch (fast_cw(a.C)) {
                case 1: kernel = glm_warp_fast_kernel<F, T, M, KPL, 1>; break;
                case 4: kernel = glm_warp_fast_kernel<F, T, M, KPL, 4>; break;
                case 8: kernel = glm_warp_fast_kernel<F, T, M, KPL, 8>; break;
                case 12: kernel = glm_warp_fast_kernel<F, T, M, KPL, 12>; break;
                case 16: kernel = glm_warp_fast_kernel<F, T, M, KPL, 16>; break;
                default: return cudaErrorInvalidValue;  // C > kWarpMaxC: warp_plan refuses it
            }
        } else {
            if (a.C != 1) return cudaErrorInvalidValue;
            kernel = glm_warp_fast_kernel<F, T, M, KPL, 1>;
        }
    }
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
