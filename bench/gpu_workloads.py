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
    kmeans: tuple               # (N, K, d)
    anderson: tuple             # (rows, d) of the state
    copy_bytes: int             # size of the buffer of the copy-bandwidth measurement
    repeats: int
    dry_run: bool

    @classmethod
    def full(cls, args):
        return cls(torch.device("cuda"), "cuda", args.clients or [10_000, 100_000], 350.0, 60, 10, args.steps,
                   args.ref_clients, (100_000, 64, 7_850), (10_000, 7_850), 1 << 30, args.repeats, False)

    @classmethod
    def dry_run(cls, args):
        return cls(torch.device("cpu"), "native", args.clients or [100, 300], 20.0, 60, 10, args.steps,
                   min(args.ref_clients, 20), (2_000, 8, 300), (50, 785), 1 << 24, min(args.repeats, 2), True)


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


def local_steps_bytes(m: int, N: int, p: int, d: int, steps: int) -> int:
    """Least traffic of one call: K passes over x and y, θ in and out, the anchor, offsets, rows."""
    return steps * N * (p * 4 + 8) + 2 * m * d * 4 + d * 4 + (m + 1) * 8 + m * 8


def bench_local_steps(cfg: Config, m: int, bw: float) -> Dict:
    data = make_clients(cfg, m)
    N = int(data.offsets[-1])
    model = models.Softmax(cfg.p, cfg.C)
    g = torch.Generator(device=cfg.device).manual_seed(1)
    theta0 = 0.01 * torch.randn(m, model.d, generator=g, device=cfg.device)
    anchor = 0.01 * torch.randn(model.d, generator=g, device=cfg.device)
    kw = dict(steps=cfg.steps, lr=0.05, prox=0.1, anchor=anchor)
    theta = theta0.clone()

    def setup():
        theta.copy_(theta0)

    # agreement on a subset of clients: the kernel's rows against the reference loop
    sub = torch.randperm(m, generator=torch.Generator().manual_seed(2))[:cfg.ref_clients].sort().values.to(cfg.device)
    want = ops.local_steps_ref(model, theta0[sub].clone(), data, rows=sub, **kw)
    out: Dict = {"m": m, "N": N, "d": model.d, "steps": cfg.steps, "ref_clients": int(sub.numel())}
    results = {}
    for name in usable((cfg.kernel, "triton"), out):
        with backend.use(name):
            setup()
            got = ops.local_steps(model, theta, data, **kw)
            out[f"{name}_max_abs_diff"] = float((got[sub] - want).abs().max())
            if not out[f"{name}_max_abs_diff"] <= 1e-3:  # float32, K steps over ~350-row sums
                raise SystemExit(f"local_steps m={m}: {name} disagrees with the reference "
                                 f"(max |Δθ| = {out[f'{name}_max_abs_diff']:.3g})")
            results[name] = best_of(lambda: ops.local_steps(model, theta, data, **kw), cfg, setup)
            out[f"{name}_s"] = results[name]
    theta_sub = theta0[sub].clone()
    with backend.use("reference"):
        t_ref = best_of(lambda: ops.local_steps_ref(model, theta_sub, data, rows=sub, **kw), cfg,
                        lambda: theta_sub.copy_(theta0[sub]), repeats=min(3, cfg.repeats))
    out["reference_s_measured"] = t_ref
    out["reference_s"] = t_ref * m / sub.numel()  # a loop over clients: linear in their number
    out["bytes"] = local_steps_bytes(m, N, cfg.p, model.d, cfg.steps)
    if cfg.kernel in results:
        t = results[cfg.kernel]
        out["bytes_per_s"] = out["bytes"] / t
        out["fraction_of_copy_bandwidth"] = out["bytes_per_s"] / bw
        out["speedup_vs_reference"] = out["reference_s"] / t
        if "triton" in results:
            out["triton_over_cuda_time"] = results["triton"] / t
    del data, theta, theta0
    return out


# ---- 2. kmeans_assign ------------------------------------------------------------------------

def bench_kmeans(cfg: Config) -> Dict:
    N, K, d = cfg.kmeans
    g = torch.Generator(device=cfg.device).manual_seed(3)
    points = torch.randn(N, d, generator=g, device=cfg.device)
    centroids = points[torch.randperm(N, generator=torch.Generator().manual_seed(4))[:K].to(cfg.device)] \
        + 0.5 * torch.randn(K, d, generator=g, device=cfg.device)
    head = min(N, 2_000)
    want_labels, _ = ops.kmeans_assign_ref(points[:head], centroids)
    cdist_labels = torch.cdist(points, centroids).argmin(1)
    out: Dict = {"N": N, "K": K, "d": d}
    times = {}
    for name in usable((cfg.kernel, "triton"), out):
        with backend.use(name):
            labels, _ = ops.kmeans_assign(points, centroids)
            if not torch.equal(labels[:head], want_labels):
                raise SystemExit(f"kmeans_assign: {name} labels differ from kmeans_assign_ref")
            out[f"{name}_agreement_with_cdist"] = float((labels == cdist_labels).double().mean())
            if out[f"{name}_agreement_with_cdist"] < 0.999:
                raise SystemExit(f"kmeans_assign: {name} agrees with cdist on only "
                                 f"{out[f'{name}_agreement_with_cdist']:.4%} of the points")
            times[name] = best_of(lambda: ops.kmeans_assign(points, centroids), cfg)
            out[f"{name}_s"] = times[name]
    out["cdist_argmin_s"] = best_of(lambda: torch.cdist(points, centroids).argmin(1), cfg)
    if cfg.kernel in times:
        out["speedup_vs_cdist"] = out["cdist_argmin_s"] / times[cfg.kernel]
        if "triton" in times:
            out["triton_over_cuda_time"] = times["triton"] / times[cfg.kernel]
    return out


# ---- 3. Anderson -----------------------------------------------------------------------------

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
            "torch_cuda": torch.version.cuda, "backends": {k: v[1] for k, v in backend.status().items()}}


def run_all(cfg: Config) -> Dict:
    info = device_info(cfg)
    print(f"device: {info['device']}; kernels of backend {cfg.kernel!r}; float32")
    bw = copy_bandwidth(cfg)
    print(f"copy bandwidth: {bw / 1e9:.1f} GB/s")
    res = {"dry_run": cfg.dry_run, "kernel_backend": cfg.kernel, "machine": info, "copy_bytes_per_s": bw,
           "local_steps": [], "kmeans_assign": None, "anderson": None}
    for m in cfg.clients:
        print(f"local_steps, m = {m:,} ...", flush=True)
        res["local_steps"].append(bench_local_steps(cfg, m, bw))
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    print("kmeans_assign ...", flush=True)
    res["kmeans_assign"] = bench_kmeans(cfg)
    print("Anderson ...", flush=True)
    res["anderson"] = bench_anderson(cfg, bw)
    return res


def table_rows(res: Dict) -> List[Dict]:
    """(name, value, target, pass) rows; a row whose value could not be measured has value None."""
    rows = []

    def add(name, value, target=None, unit=""):
        ok = None if value is None or target is None else value >= target
        rows.append({"name": name, "value": value, "target": target, "unit": unit, "pass": ok})

    k = res["kernel_backend"]
    for r in res["local_steps"]:
        add(f"local_steps m={r['m']:,}: {k} bytes/s / copy bandwidth", r.get("fraction_of_copy_bandwidth"), 0.5)
        add(f"local_steps m={r['m']:,}: {k} speed-up vs torch reference (scaled from {r['ref_clients']} clients)",
            r.get("speedup_vs_reference"), 10.0, "x")
        add(f"local_steps m={r['m']:,}: triton time / {k} time", r.get("triton_over_cuda_time"), None, "x")
    km = res["kmeans_assign"]
    add(f"kmeans_assign N={km['N']:,} K={km['K']} d={km['d']:,}: {k} speed-up vs cdist+argmin",
        km.get("speedup_vs_cdist"), 2.0, "x")
    add("kmeans_assign: triton time / " + k + " time", km.get("triton_over_cuda_time"), None, "x")
    an = res["anderson"]
    add(f"Anderson step {an['rows']:,}x{an['d']:,}: {k} bytes/s / copy bandwidth", an.get("fraction_of_copy_bandwidth"))
    add(f"Anderson step: triton time / {k} time", an.get("triton_over_cuda_time"), None, "x")
    add(f"Anderson step: {k} speed-up vs reference backend", an.get("speedup_vs_reference"), None, "x")
    return rows


def print_table(rows: List[Dict]) -> None:
    width = max(len(r["name"]) for r in rows)
    print(f"\n{'measurement':<{width}}  {'value':>9}  {'target':>7}  result")
    for r in rows:
        v = "n/a" if r["value"] is None else (f"{r['value']:.1%}" if r["unit"] == "" else f"{r['value']:.2f}x")
        t = "" if r["target"] is None else (f">={r['target']:.0%}" if r["unit"] == "" else f">={r['target']:.0f}x")
        res = "" if r["pass"] is None else ("pass" if r["pass"] else "FAIL")
        print(f"{r['name']:<{width}}  {v:>9}  {t:>7}  {res}")
