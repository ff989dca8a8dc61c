"""The measurements of bench/gpu.py (see its docstring for what and why): workloads, agreement
checks, timings. ``Config.full`` is the GPU run; ``Config.dry_run`` the same code paths on the
CPU with tiny sizes, the native kernels standing in for cuda and Triton under its interpreter."""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import numpy as np
import torch

import pflcore
from pflcore import backend, models, ops

import _harness as harness


@dataclasses.dataclass
class Config:
    device: torch.device
    kernel: str                 # the backend whose kernels are measured: cuda (native in a dry run)
    clients: List[int]          # m of the local_steps runs
    mean_rows: float
    p: int
    C: int
    steps: int
    ref_clients: int
    kmeans: List[tuple]         # (N, K, d, target speed-up over cdist + argmin) of each kmeans_assign run
    anderson: tuple             # (rows, d) of the state
    copy_bytes: int             # size of the buffer of the copy-bandwidth measurement
    repeats: int
    dry_run: bool
    batch_size: int = 20        # B of the minibatch local_steps runs
    server: tuple = (100_000, 610)  # (m, d) of the average and anderson_weights runs
    gemm: int = 8192            # n of the n x n x n float32 matrix product that gives cuBLAS's peak rate

    @classmethod
    def full(cls, args):
        return cls(torch.device("cuda"), "cuda", args.clients or [10_000, 100_000], 350.0, 60, 10, args.steps,
                   args.ref_clients, [(100_000, 16, 610, 1.5), (100_000, 64, 7_850, 2.0)], (10_000, 7_850),
                   1 << 30, args.repeats, False)

    @classmethod
    def dry_run(cls, args):
        return cls(torch.device("cpu"), "native", args.clients or [100, 300], 20.0, 60, 10, args.steps,
                   min(args.ref_clients, 20), [(2_000, 16, 61, 1.5), (2_000, 8, 300, 2.0)], (50, 785), 1 << 24,
                   min(args.repeats, 2), True, server=(500, 61), gemm=256)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn, cfg: Config, setup=lambda: None, repeats: Optional[int] = None) -> float:
    """Best wall time of ``fn()`` over the repeats, after one untimed warm-up call; the device is
    synchronized around each timed call."""
    return harness.best_of(lambda _: fn(), repeats or cfg.repeats, setup=setup, sync=lambda: sync(cfg.device),
                           warmup=1)


def usable(names, out: Dict):
    """The backends of ``names`` that run here, in order; each other one is recorded in ``out``
    as ``<name>_skipped`` with the reason."""
    status = backend.status()
    for name in names:
        ok, why = status[name]
        if ok:
            yield name
        else:
            out[f"{name}_skipped"] = why


def copy_bandwidth(cfg: Config) -> float:
    """Bytes/s of ``dst.copy_(src)``: each element read once and written once."""
    n = cfg.copy_bytes // 4
    src = torch.rand(n, device=cfg.device)
    dst = torch.empty_like(src)
    t = best_of(lambda: dst.copy_(src), cfg)
    return 2 * n * 4 / t


def gemm_rate(cfg: Config) -> float:
    """FLOP/s of cuBLAS (torch.mm) on an n x n x n float32 product of random data: the device's
    float32 ceiling as the library reaches it (TF32 as torch's default leaves it: off)."""
    n = cfg.gemm
    g = torch.Generator(device=cfg.device).manual_seed(11)
    a = torch.randn(n, n, generator=g, device=cfg.device)
    b = torch.randn(n, n, generator=g, device=cfg.device)
    t = best_of(lambda: torch.mm(a, b), cfg)
    return 2 * n ** 3 / t


def median_call(fn, cfg: Config, calls: int = 300) -> float:
    """Median wall time of one ``fn()`` with the device synchronized after each call (a latency:
    what a caller waits for one small call), after 10 untimed calls."""
    return harness.time_runs(fn, calls, sync=lambda: sync(cfg.device), warmup=10).median


# The GLM kernels timed against the default (the warp kernel with its batched staging) in the same
# process, by their PFLCORE_CUDA_GLM value: "block", glm.cu's block kernel for every shape;
# "warp_rows", the warp kernel staging one row at a time (the default until the 2026-11-27 run);
# "warp_fast", glm_warp_fast_kernel (the class count in the template, cp.async staging).
GLM_VARIANTS = ("block", "warp_rows", "warp_fast")


def variant_time(variant: str, fn, cfg: Config, setup=lambda: None) -> float:
    """``best_of(fn)`` on the cuda backend with PFLCORE_CUDA_GLM=``variant`` (GLM_VARIANTS): the
    default kernel's A/B in the same process."""
    with harness.environ(PFLCORE_CUDA_GLM=variant), backend.use("cuda"):
        return best_of(fn, cfg, setup)


# ---- 1. local_steps --------------------------------------------------------------------------

def make_clients(cfg: Config, m: int, seed: int = 0) -> pflcore.ClientData:
    rng = np.random.RandomState(seed)
    sigma = 0.5
    sizes = np.maximum(1, np.round(rng.lognormal(math.log(cfg.mean_rows) - sigma ** 2 / 2, sigma, m)))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    N = int(offsets[-1])
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    x = torch.randn(N, cfg.p, generator=g, device=cfg.device)
    y = torch.randint(0, cfg.C, (N,), generator=g, device=cfg.device)
    return pflcore.ClientData(x, y, offsets.to(cfg.device))


def local_steps_bytes(m: int, N: int, p: int, d: int, steps: int, batch_size: int = 0) -> int:
    """Least traffic of one call: K passes over x and y (full batch: all N rows; minibatches: the
    m·B sampled rows of each step and their int32 indices), θ in and out, the anchor, offsets,
    rows."""
    per_step = N * (p * 4 + 8) if not batch_size else m * batch_size * (p * 4 + 8 + 4)
    return steps * per_step + 2 * m * d * 4 + d * 4 + (m + 1) * 8 + m * 8


def local_steps_flops(rows_per_step: int, d: int, steps: int) -> int:
    """Multiply-adds of the model's two products per row and step (logits X·W and the gradient
    Xᵀ·G, d = (p + 1)·C each), counted as 2 FLOPs each."""
    return steps * rows_per_step * 2 * 2 * d


def cublas_same_products(cfg: Config, x: torch.Tensor, C: int, steps: int) -> float:
    """Seconds cuBLAS (torch.mm) takes for the same multiply-adds as K steps over the rows ``x``
    [n, p]: per step X·W [p, C] and Xᵀ·G [n, C], without the loss, the update or the per-client
    segments (a lower bound on any implementation that calls cuBLAS per step)."""
    g = torch.Generator(device=cfg.device).manual_seed(12)
    W = torch.randn(x.shape[1], C, generator=g, device=cfg.device)
    G = torch.randn(x.shape[0], C, generator=g, device=cfg.device)

    def products():
        torch.mm(x, W)
        torch.mm(x.T, G)
    return steps * best_of(products, cfg)


def bench_local_steps(cfg: Config, m: int, bw: float, peak: float, data=None, batch_size: int = 0) -> Dict:
    """``local_steps`` over m clients, full batch (``batch_size`` 0) or B = ``batch_size`` rows a
    step, against the torch reference, cuBLAS on the same products, and the roofline floor."""
    data = make_clients(cfg, m) if data is None else data
    N = int(data.offsets[-1])
    model = models.Softmax(cfg.p, cfg.C)
    g = torch.Generator(device=cfg.device).manual_seed(1)
    theta0 = 0.01 * torch.randn(m, model.d, generator=g, device=cfg.device)
    anchor = 0.01 * torch.randn(model.d, generator=g, device=cfg.device)
    kw = dict(steps=cfg.steps, lr=0.05, prox=0.1, anchor=anchor)
    batches = None
    if batch_size:
        batches = ops.sample_batches(data, steps=cfg.steps, batch_size=batch_size, seed=1, counter=0)
        kw["batches"] = batches
    theta = theta0.clone()

    def setup():
        theta.copy_(theta0)

    # agreement on a subset of clients: the kernel's rows against the reference loop
    sub = torch.randperm(m, generator=torch.Generator().manual_seed(2))[:cfg.ref_clients].sort().values.to(cfg.device)
    kw_sub = dict(kw, batches=batches[sub].contiguous()) if batch_size else kw
    want = ops.local_steps_ref(model, theta0[sub].clone(), data, rows=sub, **kw_sub)
    out: Dict = {"m": m, "N": N, "d": model.d, "steps": cfg.steps, "batch_size": batch_size or None,
                 "ref_clients": int(sub.numel())}
    results = {}
    for name in usable((cfg.kernel, "triton"), out):
        with backend.use(name):
            setup()
            got = ops.local_steps(model, theta, data, **kw)
            out[f"{name}_max_abs_diff"] = float((got[sub] - want).abs().max())
            if not out[f"{name}_max_abs_diff"] <= 1e-3:  # float32, K steps over ~350-row sums
                out[f"{name}_error"] = f"disagrees with the reference (max |Δθ| = {out[f'{name}_max_abs_diff']:.3g})"
                print(f"local_steps m={m}: {name} {out[f'{name}_error']}", flush=True)
                continue
            results[name] = best_of(lambda: ops.local_steps(model, theta, data, **kw), cfg, setup)
            out[f"{name}_s"] = results[name]
    if "cuda" in results:  # the other GLM kernels (GLM_VARIANTS) against the default
        for variant in GLM_VARIANTS:
            out[f"cuda_{variant}_kernel_s"] = variant_time(variant, lambda: ops.local_steps(model, theta, data, **kw),
                                                           cfg, setup)
            out[f"{variant}_over_default_time"] = out[f"cuda_{variant}_kernel_s"] / results["cuda"]
    theta_sub = theta0[sub].clone()
    with backend.use("reference"):
        t_ref = best_of(lambda: ops.local_steps_ref(model, theta_sub, data, rows=sub, **kw_sub), cfg,
                        lambda: theta_sub.copy_(theta0[sub]), repeats=min(3, cfg.repeats))
    out["reference_s_measured"] = t_ref
    out["reference_s"] = t_ref * m / sub.numel()  # a loop over clients: linear in their number
    out["bytes"] = local_steps_bytes(m, N, cfg.p, model.d, cfg.steps, batch_size)
    rows_per_step = m * batch_size if batch_size else N
    out["flops"] = local_steps_flops(rows_per_step, model.d, cfg.steps)
    x_step = data.x if not batch_size else data.x[batches[:, 0].reshape(-1).long()]
    out["cublas_same_products_s"] = cublas_same_products(cfg, x_step, cfg.C, cfg.steps)
    del x_step
    # roofline: the larger of the two floors says what bounds the op
    floor_bytes, floor_flops = out["bytes"] / bw, out["flops"] / peak
    out["bound"] = "bandwidth" if floor_bytes >= floor_flops else "arithmetic"
    if cfg.kernel in results:
        t = results[cfg.kernel]
        out["bytes_per_s"] = out["bytes"] / t
        out["fraction_of_copy_bandwidth"] = out["bytes_per_s"] / bw
        out["flops_per_s"] = out["flops"] / t
        out["fraction_of_cublas_peak"] = out["flops_per_s"] / peak
        out["fraction_of_bound"] = max(floor_bytes, floor_flops) / t
        out["speedup_vs_reference"] = out["reference_s"] / t
        out["speedup_vs_cublas_same_products"] = out["cublas_same_products_s"] / t
        if "triton" in results:
            out["triton_over_cuda_time"] = results["triton"] / t
    del theta, theta0
    return out


def bench_evaluate(cfg: Config, data, bw: float) -> Dict:
    """``evaluate`` of every client's model on all its rows (an evaluation round's op)."""
    m = data.num_clients
    N = int(data.offsets[-1])
    model = models.Softmax(cfg.p, cfg.C)
    theta = 0.01 * torch.randn(m, model.d, generator=torch.Generator(device=cfg.device).manual_seed(6),
                               device=cfg.device)
    sub = torch.randperm(m, generator=torch.Generator().manual_seed(2))[:cfg.ref_clients].sort().values.to(cfg.device)
    want = ops.evaluate_ref(model, theta[sub], data, rows=sub)
    out: Dict = {"m": m, "N": N, "ref_clients": int(sub.numel()), "bytes": N * (cfg.p * 4 + 8) + m * model.d * 4}
    times = {}
    for name in usable((cfg.kernel, "triton"), out):
        with backend.use(name):
            got = ops.evaluate(model, theta, data)
            if not torch.equal(got[1][sub], want[1]) or not torch.allclose(got[0][sub], want[0], rtol=1e-4, atol=1e-4):
                out[f"{name}_error"] = "disagrees with the reference"
                print(f"evaluate m={m}: {name} disagrees with the reference", flush=True)
                continue
            times[name] = best_of(lambda: ops.evaluate(model, theta, data), cfg)
            out[f"{name}_s"] = times[name]
    if "cuda" in times:
        for variant in GLM_VARIANTS:
            out[f"cuda_{variant}_kernel_s"] = variant_time(variant, lambda: ops.evaluate(model, theta, data), cfg)
            out[f"{variant}_over_default_time"] = out[f"cuda_{variant}_kernel_s"] / times["cuda"]
    t_ref = best_of(lambda: ops.evaluate_ref(model, theta[sub], data, rows=sub), cfg, repeats=min(3, cfg.repeats))
    out["reference_s"] = t_ref * m / sub.numel()
    if cfg.kernel in times:
        t = times[cfg.kernel]
        out["fraction_of_copy_bandwidth"] = out["bytes"] / t / bw
        out["speedup_vs_reference"] = out["reference_s"] / t
        if "triton" in times:
            out["triton_over_cuda_time"] = times["triton"] / t
    return out


def bench_small_call(cfg: Config) -> Dict:
    """Latency of one client's one-step ``local_steps`` (20 rows, Softmax(60, 10)): the public
    op with its checks, the device synchronized after each call; median of 300 calls."""
    model = models.Softmax(cfg.p, cfg.C)
    g = torch.Generator(device=cfg.device).manual_seed(7)
    data = pflcore.ClientData(torch.randn(20, cfg.p, generator=g, device=cfg.device),
                              torch.randint(0, cfg.C, (20,), generator=g, device=cfg.device),
                              torch.tensor([0, 20], device=cfg.device))
    theta = torch.zeros(1, model.d, device=cfg.device)
    out: Dict = {"rows": 20, "d": model.d}
    for name in usable((cfg.kernel, "triton", "reference"), out):
        with backend.use(name):
            out[f"{name}_s"] = median_call(lambda: ops.local_steps(model, theta, data, steps=1, lr=0.01), cfg)
    if cfg.kernel == "cuda" and "cuda_s" in out:
        # the default's parts switched back one at a time: the screen as its own module call, and
        # the warp kernel's row-at-a-time staging
        for key, env in (("cuda_separate_screen_s", {"PFLCORE_CUDA_SCREEN": "separate"}),
                         ("cuda_warp_rows_s", {"PFLCORE_CUDA_GLM": "warp_rows"}),
                         ("cuda_warp_fast_s", {"PFLCORE_CUDA_GLM": "warp_fast"})):
            with harness.environ(**env), backend.use("cuda"):
                out[key] = median_call(lambda: ops.local_steps(model, theta, data, steps=1, lr=0.01), cfg)
    return out


# ---- 2. kmeans_assign ------------------------------------------------------------------------

def bench_kmeans(cfg: Config, N: int, K: int, d: int, target: float) -> Dict:
    g = torch.Generator(device=cfg.device).manual_seed(3)
    points = torch.randn(N, d, generator=g, device=cfg.device)
    centroids = points[torch.randperm(N, generator=torch.Generator().manual_seed(4))[:K].to(cfg.device)] \
        + 0.5 * torch.randn(K, d, generator=g, device=cfg.device)
    # Labels against the reference in float64: where the two nearest centroids are closer than
    # float32 rounding of a d-term sum can tell apart, any summation order may pick either one;
    # everywhere else the labels must be equal.
    head = min(N, 20_000)
    d64 = torch.cdist(points[:head].double(), centroids.double()) ** 2
    two = d64.topk(2, dim=1, largest=False).values
    tie = (two[:, 1] - two[:, 0]) <= 1e-5 * two[:, 1]
    want_labels = d64.argmin(1)
    del d64
    cdist_labels = torch.cdist(points, centroids).argmin(1)
    out: Dict = {"N": N, "K": K, "d": d, "target": target, "labels_checked": head, "near_ties": int(tie.sum()),
                 "bytes": (N * d + K * d) * points.element_size() + N * (8 + points.element_size())}
    times = {}
    for name in usable((cfg.kernel, "triton"), out):
        with backend.use(name):
            labels, _ = ops.kmeans_assign(points, centroids)
            wrong = int(((labels[:head] != want_labels) & ~tie).sum())
            out[f"{name}_labels_differing_outside_ties"] = wrong
            out[f"{name}_labels_equal_float64"] = float((labels[:head] == want_labels).double().mean())
            out[f"{name}_agreement_with_cdist"] = float((labels == cdist_labels).double().mean())
            if wrong:
                out[f"{name}_error"] = f"{wrong} labels differ from the float64 reference away from ties"
                print(f"kmeans_assign: {name}: {out[f'{name}_error']}", flush=True)
                continue
            times[name] = best_of(lambda: ops.kmeans_assign(points, centroids), cfg)
            out[f"{name}_s"] = times[name]
    out["cdist_argmin_s"] = best_of(lambda: torch.cdist(points, centroids).argmin(1), cfg)
    out["reference_s"] = best_of(lambda: ops.kmeans_assign_ref(points, centroids), cfg, repeats=min(3, cfg.repeats))
    if cfg.kernel in times:
        out["speedup_vs_cdist"] = out["cdist_argmin_s"] / times[cfg.kernel]
        out["speedup_vs_reference"] = out["reference_s"] / times[cfg.kernel]
        if "triton" in times:
            out["triton_over_cuda_time"] = times["triton"] / times[cfg.kernel]
    return out


# ---- 3. server ops: average, anderson_weights -----------------------------------------------------

def bench_server_ops(cfg: Config, bw: float) -> Dict:
    """``average`` of m client models [m, d] and ``anderson_weights`` of k = 6 residuals of an
    [m, d] state (Anderson memory 5): bytes of one pass over the inputs against the copy
    bandwidth, and the ratio to the reference (torch, float64 sums) on the same device."""
    m, d = cfg.server
    g = torch.Generator(device=cfg.device).manual_seed(8)
    theta = torch.randn(m, d, generator=g, device=cfg.device)
    w = torch.rand(m, generator=g, device=cfg.device) + 0.1
    k = 6
    R = torch.randn(k, m * d, generator=g, device=cfg.device)
    res: Dict = {}
    for op, args, nbytes, ref in (("average", (theta, w), m * d * 4 + m * 4 + d * 4, ops.average_ref),
                                  ("anderson_weights", (R,), k * m * d * 4, ops.anderson_weights_ref)):
        out: Dict = {"m": m, "d": d, "bytes": nbytes, "served_by": backend.select(
            "gram" if op == "anderson_weights" else op, None, args[0]).name}
        fn = getattr(ops, op)
        want = ref(*args)
        got = fn(*args)
        out["max_abs_diff_vs_reference"] = float((got.double().cpu() - want.double().cpu()).abs().max())
        if not out["max_abs_diff_vs_reference"] <= (1e-4 if op == "average" else 1e-8):
            out["error"] = f"disagrees with {op}_ref (max |Δ| = {out['max_abs_diff_vs_reference']:.3g})"
            print(f"{op}: {out['error']}", flush=True)
        out["s"] = best_of(lambda: fn(*args), cfg)
        out["reference_s"] = best_of(lambda: ref(*args), cfg)
        out["fraction_of_copy_bandwidth"] = nbytes / out["s"] / bw
        out["speedup_vs_reference"] = out["reference_s"] / out["s"]
        if op == "average" and out["served_by"] == "cuda":  # the torch screen around the kernels
            with harness.environ(PFLCORE_CUDA_AVERAGE="torch"):  # (the default until 2026-11-27)
                diff = float((fn(*args).double().cpu() - want.double().cpu()).abs().max())
                out["torch_screen_max_abs_diff_vs_reference"] = diff
                if diff <= 1e-4:
                    out["torch_screen_s"] = best_of(lambda: fn(*args), cfg)
                    out["torch_screen_fraction_of_copy_bandwidth"] = nbytes / out["torch_screen_s"] / bw
                else:
                    out["torch_screen_error"] = f"disagrees with average_ref (max |Δ| = {diff:.3g})"
                    print(f"average (torch screen): {out['torch_screen_error']}", flush=True)
        res[op] = out
    del theta, R
    return res


# ---- 4. Anderson -----------------------------------------------------------------------------

def bench_anderson(cfg: Config, bw: float) -> Dict:
    rows, d = cfg.anderson
    g = torch.Generator(device=cfg.device).manual_seed(5)
    us = [torch.randn(rows, d, generator=g, device=cfg.device) for _ in range(8)]
    memory = 5
    D = rows * d
    out: Dict = {"rows": rows, "d": d, "memory": memory, "bytes": 17 * D * 4}
    times = {}
    ref_run = None
    for name in usable((cfg.kernel, "triton", "reference"), out):
        with backend.use(name):
            acc = ops.Anderson(memory=memory, reg=1e-8)
            steps = [acc.step(us[i], 0.9 * us[i] + 0.1 * us[i + 1]) for i in range(memory + 1)]  # full history
            last = steps[-1]
            if ref_run is None:
                ref_run = last
            else:
                out[f"{name}_max_abs_diff"] = float((last - ref_run).abs().max())
            pairs = [(us[i], 0.9 * us[i] + 0.1 * us[i + 1]) for i in range(7)]
            turn = iter(range(10 ** 9))

            def step():  # distinct pairs: a repeated one would make the Gram matrix singular
                u, tu = pairs[next(turn) % len(pairs)]
                acc.step(u, tu)
            times[name] = best_of(step, cfg)
            out[f"{name}_s"] = times[name]
    if cfg.kernel in times:
        out["fraction_of_copy_bandwidth"] = out["bytes"] / times[cfg.kernel] / bw
        if "triton" in times:
            out["triton_over_cuda_time"] = times["triton"] / times[cfg.kernel]
        if "reference" in times:
            out["speedup_vs_reference"] = times["reference"] / times[cfg.kernel]
    return out


# ---- driver and report -----------------------------------------------------------------------

def device_info(cfg: Config) -> Dict:
    if cfg.device.type != "cuda":
        return {"device": "cpu (dry run)", "backends": {k: v[1] for k, v in backend.status().items()}}
    prop = torch.cuda.get_device_properties(cfg.device)
    return {"device": prop.name, "capability": f"{prop.major}.{prop.minor}", "sms": prop.multi_processor_count,
            "memory_gib": round(prop.total_memory / 2 ** 30, 1), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "driver": _command(["nvidia-smi", "--query-gpu=driver_version",
                                                                  "--format=csv,noheader"]),
            "toolkit": _command(["nvcc", "--version"]).splitlines()[-1:],
            "cuda_module": _cuda_build_info(), "backends": {k: v[1] for k, v in backend.status().items()}}


def _command(argv) -> str:
    import subprocess
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({argv[0]}: {exc})"


def _cuda_build_info() -> Optional[Dict]:
    module, _ = backend.ADAPTERS["cuda"].load()
    return None if module is None else dict(module.build_info())


def run_all(cfg: Config, save=lambda res: None) -> Dict:
    """Every measurement; ``save(res)`` after each one (a later failure keeps the earlier ones)."""
    info = device_info(cfg)
    print(f"device: {info['device']}; kernels of backend {cfg.kernel!r}; float32")
    bw = copy_bandwidth(cfg)
    peak = gemm_rate(cfg)
    print(f"copy bandwidth: {bw / 1e9:.1f} GB/s; cuBLAS float32 {cfg.gemm}^3 product: {peak / 1e12:.1f} TFLOP/s")
    res = {"dry_run": cfg.dry_run, "kernel_backend": cfg.kernel, "machine": info, "copy_bytes_per_s": bw,
           "cublas_fp32_flops_per_s": peak, "local_steps": [], "evaluate": None, "small_call": None,
           "kmeans_assign": [], "server_ops": None, "anderson": None}
    print("one-client one-step local_steps ...", flush=True)
    res["small_call"] = bench_small_call(cfg)
    save(res)
    for m in cfg.clients:
        data = make_clients(cfg, m)
        for B in (0, cfg.batch_size):
            print(f"local_steps, m = {m:,}, {'full batch' if not B else f'B = {B}'} ...", flush=True)
            res["local_steps"].append(bench_local_steps(cfg, m, bw, peak, data=data, batch_size=B))
            save(res)
        if m == max(cfg.clients):
            print(f"evaluate, m = {m:,} ...", flush=True)
            res["evaluate"] = bench_evaluate(cfg, data, bw)
            save(res)
        del data
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    for N, K, d, target in cfg.kmeans:
        print(f"kmeans_assign N = {N:,}, K = {K}, d = {d:,} ...", flush=True)
        res["kmeans_assign"].append(bench_kmeans(cfg, N, K, d, target))
        save(res)
    print("average, anderson_weights ...", flush=True)
    res["server_ops"] = bench_server_ops(cfg, bw)
    save(res)
    print("Anderson ...", flush=True)
    res["anderson"] = bench_anderson(cfg, bw)
    return res


def table_rows(res: Dict) -> List[Dict]:
    """(name, value, target, pass) rows; a row whose value could not be measured has value None."""
    rows = []

    def add(name, value, target=None, unit=""):
        ok = None if value is None or target is None else value >= target
        rows.append({"name": name, "value": value, "target": target, "unit": unit, "pass": ok})

    def add_time(name, value, limit):  # a time (seconds): passes when at most the limit (None: no target)
        ok = None if value is None or limit is None else value <= limit
        rows.append({"name": name, "value": value, "target": limit, "unit": "s", "pass": ok})

    k = res["kernel_backend"]
    small = res.get("small_call")
    if small:
        add_time(f"local_steps 1 client, 1 step: {k} wall per call", small.get(f"{k}_s"), 100e-6)
        for key, what in (("cuda_separate_screen_s", "PFLCORE_CUDA_SCREEN=separate"),
                          ("cuda_warp_rows_s", "PFLCORE_CUDA_GLM=warp_rows"),
                          ("cuda_warp_fast_s", "PFLCORE_CUDA_GLM=warp_fast")):
            if key in small:
                add_time(f"local_steps 1 client, 1 step, {what}: wall per call", small.get(key), None)
    for r in res["local_steps"]:
        mode = f"B={r['batch_size']}" if r.get("batch_size") else "full batch"
        tag = f"local_steps m={r['m']:,} {mode}"
        bound = r.get("bound", "bandwidth")
        add(f"{tag}: {k} fraction of the {bound} floor", r.get("fraction_of_bound", r.get("fraction_of_copy_bandwidth")), 0.5)
        add(f"{tag}: {k} speed-up vs torch reference (scaled from {r['ref_clients']} clients)",
            r.get("speedup_vs_reference"), 10.0, "x")
        add(f"{tag}: {k} speed-up vs cuBLAS on the same products", r.get("speedup_vs_cublas_same_products"), None, "x")
        add(f"{tag}: triton time / {k} time", r.get("triton_over_cuda_time"), None, "x")
        for variant in GLM_VARIANTS:
            add(f"{tag}: PFLCORE_CUDA_GLM={variant} time / default time", r.get(f"{variant}_over_default_time"),
                None, "x")
    ev = res.get("evaluate")
    if ev:
        add_time(f"evaluate m={ev['m']:,} ({ev['N']:,} rows): {k} time", ev.get(f"{k}_s"), 50e-3)
        add(f"evaluate m={ev['m']:,}: {k} speed-up vs torch reference", ev.get("speedup_vs_reference"), None, "x")
        for variant in GLM_VARIANTS:
            add(f"evaluate m={ev['m']:,}: PFLCORE_CUDA_GLM={variant} time / default time",
                ev.get(f"{variant}_over_default_time"), None, "x")
    kms = res["kmeans_assign"]
    for km in (kms if isinstance(kms, list) else [kms]):
        add(f"kmeans_assign N={km['N']:,} K={km['K']} d={km['d']:,}: {k} speed-up vs cdist+argmin",
            km.get("speedup_vs_cdist"), km.get("target", 2.0), "x")
        add(f"kmeans_assign N={km['N']:,} K={km['K']}: triton time / {k} time", km.get("triton_over_cuda_time"),
            None, "x")
    for op, r in (res.get("server_ops") or {}).items():
        add(f"{op} {r['m']:,}x{r['d']}: {r['served_by']} bytes/s / copy bandwidth", r.get("fraction_of_copy_bandwidth"), 0.5)
        add(f"{op}: speed-up vs {op}_ref", r.get("speedup_vs_reference"), None, "x")
        if "torch_screen_max_abs_diff_vs_reference" in r:
            add(f"{op} {r['m']:,}x{r['d']} with the torch screen (PFLCORE_CUDA_AVERAGE=torch): bytes/s / "
                f"copy bandwidth", r.get("torch_screen_fraction_of_copy_bandwidth"), None)
    an = res["anderson"]
    add(f"Anderson step {an['rows']:,}x{an['d']:,}: {k} bytes/s / copy bandwidth", an.get("fraction_of_copy_bandwidth"))
    add(f"Anderson step: triton time / {k} time", an.get("triton_over_cuda_time"), None, "x")
    add(f"Anderson step: {k} speed-up vs reference backend", an.get("speedup_vs_reference"), None, "x")
    return rows


def print_table(rows: List[Dict]) -> None:
    width = max(len(r["name"]) for r in rows)
    print(f"\n{'measurement':<{width}}  {'value':>9}  {'target':>7}  result")
    def fmt_s(v):
        return f"{v * 1e6:.0f} us" if v < 1e-3 else f"{v * 1e3:.2f} ms"
    for r in rows:
        if r["unit"] == "s":
            v = "n/a" if r["value"] is None else fmt_s(r["value"])
            t = "" if r["target"] is None else "<=" + fmt_s(r["target"])
        else:
            v = "n/a" if r["value"] is None else (f"{r['value']:.1%}" if r["unit"] == "" else f"{r['value']:.2f}x")
            t = "" if r["target"] is None else (f">={r['target']:.0%}" if r["unit"] == "" else f">={r['target']:.1f}x")
        res = "" if r["pass"] is None else ("pass" if r["pass"] else "FAIL")
        print(f"{r['name']:<{width}}  {v:>9}  {t:>7}  {res}")
