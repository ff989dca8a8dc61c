"""Microbenchmarks of pflcore's native CPU kernels against references and common baselines.

What is measured (all in one process, same thread count everywhere, float32, fixed seeds):

1. ``local_steps`` on workload A: m = 1,000 clients with lognormal sizes (mean ≈ 350 rows,
   N ≈ 350k), ``Softmax(p=60, C=10)``, K = 5 full-batch proximal steps (prox = 0.1, a shared
   anchor, lr = 0.05, l2 = 0). Compared:
     (a) native ``ops.local_steps`` (all clients in one call),
     (b) ``ops.local_steps_ref`` (pure-torch loop over clients),
     (c) a per-client PyTorch loop with autograd and ``torch.optim.SGD`` (``nn.Linear``,
         ``F.cross_entropy`` + prox/2·‖θ − a‖²), the way PFL libraries run clients today.
   First the three results are checked to agree (max |Δθ|), then timed. The kernel's GFLOP/s
   (4·(p+1)·C FLOPs per row and step: logits + gradient) is compared with a 2048×2048 torch
   matmul measured in the same run.
2. ``kmeans_assign`` (N = 10,000 points, K = 16, d = 7,850): native vs ``kmeans_assign_ref``,
   faiss ``IndexFlatL2`` and scikit-learn ``pairwise_distances_argmin_min`` (when installed),
   after checking that the labels agree.
3. ``Anderson(memory=5).step`` on a 1,000 × 7,850 state with a full history (k = memory+1
   stored pairs), against ``dst.copy_(src)`` of (touched/2)-element buffers, i.e. moving the
   touched = (2 + 2 + k + k + 1)·D elements a step must read or write (u, tu in; r, tu into the
   ring; k residuals for the Gram column; k T(u) for the mix; out) = 17·D for k = 6. The copies
   are timed between the steps so both see the same machine load. Also the reference step.

Diagnostics without a target: the time of one full NaN/inf scan (``check_finite``, the ops'
input validation) of the large inputs relative to the op, for ``kmeans_assign`` and
``Anderson.step``: what validating in a separate pass costs. The 1-minute load average is
recorded, and a warning printed when other processes are busy: on a 2-core machine they
distort the timings.

Times are the best of ``--repeats`` runs (time.perf_counter); every run of ``local_steps``
starts from a copy of the same θ. The slow baselines (reference ops, torch loop, sklearn) use
at most 3 runs. They are timed on all clients unless ``--slow-clients`` is given; then they
run on that many clients and are scaled linearly by rows (stated in the output and the JSON).

Run from the repository root (the installed ``pflcore`` with its compiled ``_core`` is used):

    python bench/kernels.py                 # default sizes, a few minutes at most on 2 cores
    python bench/kernels.py --quick         # small sizes, a smoke run (< 30 s)

It prints a table (name, time, ratio, target, pass/fail), writes all numbers, the machine and
a timestamp to ``--out`` (default bench/results/kernels.json) and, when matplotlib is
importable, a bar plot of the ratios against their targets next to it (kernels.png).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import time

import numpy as np
import torch
import torch.nn.functional as F

import pflcore
from pflcore import backend, ops
from pflcore.models import Softmax
from pflcore.ops._checks import check_finite  # the NaN/inf check the ops run on their inputs

HERE = os.path.dirname(os.path.abspath(__file__))


def best_of(fn, repeats, setup=lambda: None):
    """Best wall time of ``fn(setup())`` over ``repeats`` runs (setup is not timed)."""
    best = math.inf
    for _ in range(max(1, repeats)):
        arg = setup()
        t0 = time.perf_counter()
        fn(arg)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(n, repeats):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)  # warm-up
    t = best_of(lambda _: torch.mm(a, b, out=c), max(3, repeats))
    return 2 * n ** 3 / t / 1e9, t


# ---- 1. local_steps ---------------------------------------------------------------------------

def make_federation(m, p, C, mean_rows, sigma, seed):
    rng = np.random.RandomState(seed)
    sizes = np.maximum(1, np.round(rng.lognormal(math.log(mean_rows) - sigma ** 2 / 2, sigma, m)))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(offsets[-1])
    x = rng.standard_normal((N, p)).astype(np.float32)
    y = rng.randint(0, C, N).astype(np.int64)
    return pflcore.ClientData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(offsets))


def torch_sgd_loop(model, theta, data, clients, *, steps, lr, prox, anchor):
    """(c): each client loads θ_i into an nn.Linear, runs ``steps`` SGD steps on its full
    batch with autograd (cross-entropy + prox/2·‖θ − a‖²), and writes the result back."""
    p, C = model.p, model.C
    lin = torch.nn.Linear(p, C)
    a = anchor.view(p + 1, C)
    a_w, a_b = a[:p].T.contiguous(), a[p].clone()
    for i in clients:
        x, y = data.client(i)
        W = theta[i].view(p + 1, C)
        with torch.no_grad():
            lin.weight.copy_(W[:p].T)
            lin.bias.copy_(W[p])
        opt = torch.optim.SGD(lin.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(lin(x), y) + prox / 2 * (
                (lin.weight - a_w).pow(2).sum() + (lin.bias - a_b).pow(2).sum())
            loss.backward()
            opt.step()
        with torch.no_grad():
            W[:p].copy_(lin.weight.T)
            W[p].copy_(lin.bias)


def bench_local_steps(args, q):
    m, p, C, K = q["m"], 60, 10, 5
    kw = dict(steps=K, lr=0.05, prox=0.1)
    model = Softmax(p, C)
    data = make_federation(m, p, C, 350, 0.5, seed=0)
    N = data.num_rows
    g = torch.Generator().manual_seed(2)
    theta0 = 0.01 * torch.randn(m, model.d, generator=g)
    anchor = 0.01 * torch.randn(model.d, generator=g)
    kw["anchor"] = anchor

    def native(th):
        with backend.use("native"):
            ops.local_steps(model, th, data, **kw)

    def ref(th, rows=None):
        ops.local_steps_ref(model, th, data, rows=rows, **kw)

    def loop(th, clients=range(m)):
        torch_sgd_loop(model, th, data, clients, **kw)

    # Agreement first (these runs also warm everything up).
    out = {}
    for name, fn in (("native", native), ("reference", ref), ("torch_sgd", loop)):
        th = theta0.clone()
        fn(th)
        out[name] = th
    diff_ref = float((out["reference"] - out["native"]).abs().max())
    diff_loop = float((out["torch_sgd"] - out["native"]).abs().max())
    moved = float((out["native"] - theta0).abs().max())
    print(f"[local_steps] m={m} N={N} d={model.d} K={K}: max|Δθ| reference-native = {diff_ref:.2e}, "
          f"torch_sgd-native = {diff_loop:.2e} (tolerance 1e-4; the steps moved θ by up to {moved:.2e})")

    mm_before = matmul_gflops(2048, args.repeats)  # measured before and after the timings of
    t_native = best_of(native, args.repeats, theta0.clone)  # this section; the better one is kept
    # Slow baselines: all clients, or the first --slow-clients ones scaled by rows.
    ms = m if args.slow_clients is None else min(m, args.slow_clients)
    sub = torch.arange(ms)
    scale = N / int(data.offsets[ms])
    slow_reps = max(1, min(args.repeats, 3))
    t_ref = scale * best_of(lambda th: ref(th, rows=sub), slow_reps, lambda: theta0[:ms].clone())
    t_loop = scale * best_of(lambda th: loop(th, range(ms)), slow_reps, theta0.clone)

    flops = K * N * 4 * (p + 1) * C
    kernel_gflops = flops / t_native / 1e9
    mm_gflops, t_mm = max(mm_before, matmul_gflops(2048, args.repeats))
    return dict(
        m=m, N=N, p=p, C=C, d=model.d, steps=K, lr=kw["lr"], prox=kw["prox"], anchor="shared [d]",
        max_abs_diff_reference=diff_ref, max_abs_diff_torch_sgd=diff_loop, tolerance=1e-4, max_abs_update=moved,
        time_native_s=t_native, time_reference_s=t_ref, time_torch_sgd_s=t_loop,
        slow_baselines_clients=ms, slow_baselines_scaled=ms < m, slow_baselines_scale=scale,
        slow_baselines_repeats=slow_reps,
        ratio_torch_sgd_over_native=t_loop / t_native, ratio_reference_over_native=t_ref / t_native,
        flops=flops, kernel_gflops=kernel_gflops, matmul_n=2048, matmul_time_s=t_mm,
        matmul_gflops=mm_gflops, fraction_of_matmul=kernel_gflops / mm_gflops)


# ---- 2. kmeans_assign -------------------------------------------------------------------------

def bench_kmeans(args, q, threads):
    N, K, d = q["kmeans_N"], 16, 7850
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(K, d, generator=g)
    points = centers[torch.randint(0, K, (N,), generator=g)] + 2.0 * torch.randn(N, d, generator=g)
    centroids = centers + 0.5 * torch.randn(K, d, generator=g)
    P, Cn = points.numpy(), centroids.numpy()
    print(f"[kmeans_assign] N={N} K={K} d={d}: checking labels, then timing")

    with backend.use("native"):
        labels, sq = ops.kmeans_assign(points, centroids)
    res = dict(N=N, K=K, d=d)
    lab_ref, sq_ref = ops.kmeans_assign_ref(points, centroids)
    res["agree_reference"] = float((lab_ref == labels).double().mean())
    res["max_rel_sqdist_diff_reference"] = float(((sq_ref - sq).abs() / sq.abs().clamp_min(1e-30)).max())

    def native(_):
        with backend.use("native"):
            ops.kmeans_assign(points, centroids)

    res["time_native_s"] = best_of(native, args.repeats)
    # Diagnostic: one full NaN/inf scan of the [N, d] points, relative to the op.
    res["time_check_finite_s"] = best_of(lambda _: check_finite(points, "points"), args.repeats)
    res["check_finite_over_op"] = res["time_check_finite_s"] / res["time_native_s"]
    res["time_reference_s"] = best_of(lambda _: ops.kmeans_assign_ref(points, centroids),
                                      max(1, min(args.repeats, 3)))
    res["ratio_reference_over_native"] = res["time_reference_s"] / res["time_native_s"]

    try:
        import faiss
        faiss.omp_set_num_threads(threads)
        index = faiss.IndexFlatL2(d)
        index.add(Cn)
        D, I = index.search(P, 1)
        res["agree_faiss"] = float((torch.from_numpy(I[:, 0]) == labels).double().mean())
        res["max_rel_sqdist_diff_faiss"] = float(np.max(np.abs(D[:, 0] - sq.numpy()) / sq.numpy()))
        res["time_faiss_s"] = best_of(lambda _: index.search(P, 1), args.repeats)
        res["ratio_faiss_over_native"] = res["time_faiss_s"] / res["time_native_s"]
        res["faiss_version"] = faiss.__version__
    except ImportError:
        res["faiss"] = "not installed"

    try:
        import sklearn
        from sklearn.metrics import pairwise_distances_argmin_min
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # pragma: no cover
            threadpool_limits = None
        with (threadpool_limits(threads) if threadpool_limits else _nullcontext()):
            lab_sk, dist_sk = pairwise_distances_argmin_min(P, Cn)
            res["agree_sklearn"] = float((torch.from_numpy(lab_sk) == labels).double().mean())
            res["time_sklearn_s"] = best_of(lambda _: pairwise_distances_argmin_min(P, Cn),
                                            max(1, min(args.repeats, 3)))
        res["ratio_sklearn_over_native"] = res["time_sklearn_s"] / res["time_native_s"]
        res["sklearn_version"] = sklearn.__version__
    except ImportError:
        res["sklearn"] = "not installed"
    return res


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- 3. Anderson ------------------------------------------------------------------------------

def bench_anderson(args, q):
    shape, memory = (q["anderson_rows"], 7850), 5
    D, H = shape[0] * shape[1], memory + 1
    warm = H  # fills the history: every timed step sees k = H stored pairs
    g = torch.Generator().manual_seed(4)
    # Fresh (u, T(u)) pairs, made beforehand; T(u) = 0.9·u + noise.
    pairs = []
    for _ in range(warm + args.repeats):
        u = torch.randn(shape, generator=g)
        pairs.append((u, 0.9 * u + 0.1 * torch.randn(shape, generator=g)))

    k = H
    # read u, tu; write r, tu into the ring; read k residuals (Gram column); read k T(u); write out
    touched = (2 + 2 + k + k + 1) * D
    n_copy = touched // 2  # a copy reads and writes: src + dst = touched elements
    src, dst = torch.randn(n_copy, generator=g), torch.empty(n_copy)
    dst.copy_(src)
    copy_times = []

    def timed_copy():
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - t0)

    def run(name, between=lambda: None):
        mixer = ops.Anderson(memory=memory)
        with backend.use(name):
            for u, tu in pairs[:warm]:
                mixer.step(u, tu)
            assert len(mixer._order) == H, "history is not full"
            best, out = math.inf, None
            for u, tu in pairs[warm:]:
                t0 = time.perf_counter()
                out = mixer.step(u, tu)
                best = min(best, time.perf_counter() - t0)
                between()
        return best, out, mixer.resets

    print(f"[anderson] state {list(shape)}, memory {memory}: timing native and reference steps")
    # The copies are timed between the native steps, so that both see the same machine load.
    t_native, out_native, resets_native = run("native", between=timed_copy)
    t_copy = min(copy_times)
    t_ref, out_ref, resets_ref = run("reference")
    u, tu = pairs[-1]
    t_checks = best_of(lambda _: (check_finite(u, "u"), check_finite(tu, "tu")), args.repeats)
    return dict(
        shape=list(shape), D=D, memory=memory, pairs_stored=k, touched_elements=touched,
        touched_bytes=touched * 4, copy_elements=n_copy, time_native_step_s=t_native,
        time_reference_step_s=t_ref, time_copy_s=t_copy, time_check_finite_s=t_checks,
        check_finite_over_op=t_checks / t_native, copy_gbytes_per_s=touched * 4 / t_copy / 1e9,
        step_gbytes_per_s=touched * 4 / t_native / 1e9, ratio_step_over_copy=t_native / t_copy,
        ratio_reference_over_native=t_ref / t_native, safeguard_resets=[resets_native, resets_ref],
        max_abs_diff_reference=float((out_ref - out_native).abs().max()))


def machine_extra():
    """CPU model (platform.processor() is empty on Linux) and the source tree's git commit."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return dict(cpu_model=model, git_commit=commit or None)


# ---- report -----------------------------------------------------------------------------------

def rows_of(r):
    """(name, time, value, target, 'ge'|'le'|None) for the table and the plot."""
    ls, km, an = r["local_steps"], r["kmeans_assign"], r["anderson"]
    sc = " (scaled)" if ls["slow_baselines_scaled"] else ""
    rows = [
        ("local_steps agreement: max|Δθ| reference", None, ls["max_abs_diff_reference"], 1e-4, "le"),
        ("local_steps agreement: max|Δθ| torch SGD", None, ls["max_abs_diff_torch_sgd"], 1e-4, "le"),
        ("local_steps native (a)", ls["time_native_s"], None, None, None),
        ("local_steps torch SGD loop (c)/(a)" + sc, ls["time_torch_sgd_s"],
         ls["ratio_torch_sgd_over_native"], 25, "ge"),
        ("local_steps reference (b)/(a)" + sc, ls["time_reference_s"],
         ls["ratio_reference_over_native"], 10, "ge"),
        (f"local_steps {ls['kernel_gflops']:.1f} GFLOP/s / matmul {ls['matmul_gflops']:.0f}",
         ls["matmul_time_s"], ls["fraction_of_matmul"], 0.10, "ge"),
        ("kmeans_assign native", km["time_native_s"], None, None, None),
        ("kmeans_assign: check_finite(points) scan / op", km["time_check_finite_s"],
         km["check_finite_over_op"], None, None),
        ("kmeans_assign agreement: reference labels", None, km["agree_reference"], 0.999, "ge"),
        ("kmeans_assign reference/native", km["time_reference_s"], km["ratio_reference_over_native"], None, None),
    ]
    if "time_faiss_s" in km:
        rows += [("kmeans_assign agreement: faiss labels", None, km["agree_faiss"], 0.999, "ge"),
                 ("kmeans_assign faiss/native", km["time_faiss_s"], km["ratio_faiss_over_native"], 1.0, "ge")]
    if "time_sklearn_s" in km:
        rows += [("kmeans_assign agreement: sklearn labels", None, km["agree_sklearn"], 0.999, "ge"),
                 ("kmeans_assign sklearn/native", km["time_sklearn_s"], km["ratio_sklearn_over_native"], None, None)]
    rows += [
        ("anderson agreement: max|Δout| reference (info)", None, an["max_abs_diff_reference"], None, None),
        ("anderson step native", an["time_native_step_s"], None, None, None),
        ("anderson step: check_finite(u, tu) scans / step", an["time_check_finite_s"],
         an["check_finite_over_op"], None, None),
        ("anderson step / copy of touched bytes", an["time_copy_s"], an["ratio_step_over_copy"], 1.5, "le"),
        ("anderson reference/native", an["time_reference_step_s"], an["ratio_reference_over_native"], None, None),
    ]
    return rows


def passed(value, target, sense):
    if sense is None:
        return None
    return value >= target if sense == "ge" else value <= target


def print_table(rows):
    print(f"\n{'benchmark':<52} {'time [s]':>10} {'value':>10} {'target':>10}  result")
    print("-" * 92)
    for name, t, v, target, sense in rows:
        ts = f"{t:10.4f}" if t is not None else " " * 10
        vs = f"{v:10.3g}" if v is not None else " " * 10
        tg = f"{'>=' if sense == 'ge' else '<='}{target:g}".rjust(10) if sense else " " * 10
        ok = passed(v, target, sense)
        print(f"{name:<52} {ts} {vs} {tg}  {'' if ok is None else 'PASS' if ok else 'FAIL'}")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # The speed ratios only (not the agreement checks, absolute times or diagnostics).
    rows = [r for r in rows if r[1] is not None and r[2] is not None and "/" in r[0]
            and "check_finite" not in r[0]]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    ys = range(len(rows))
    colors = ["tab:gray" if s is None else "tab:green" if passed(v, t, s) else "tab:red"
              for _, _, v, t, s in rows]
    ax.barh(list(ys), [r[2] for r in rows], color=colors)
    for y, (_, _, v, t, s) in zip(ys, rows):
        ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        if s is not None:
            ax.plot([t, t], [y - 0.4, y + 0.4], color="black", lw=2)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ratio (black tick: target; green pass, red fail, gray no target)")
    ax.set_title("pflcore kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kernels.json"), help="JSON output path")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (best is kept)")
    ap.add_argument("--slow-clients", type=int, default=None,
                    help="run the slow local_steps baselines on this many clients and scale by rows")
    args = ap.parse_args()
    q = dict(m=100, kmeans_N=1000, anderson_rows=100) if args.quick else \
        dict(m=1000, kmeans_N=10000, anderson_rows=1000)
    if args.quick:
        args.repeats = min(args.repeats, 3)

    status = backend.status()
    if not status["native"][0]:
        raise SystemExit(f"the native backend is not available: {status['native'][1]}")
    threads = torch.get_num_threads()
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        print(f"warning: 1-minute load average is {load_start:.2f} before starting; other processes "
              f"compete for the {os.cpu_count()} cores and the timings will be noisy")
    t0 = time.perf_counter()
    results = {"local_steps": bench_local_steps(args, q)}
    results["kmeans_assign"] = bench_kmeans(args, q, threads)
    results["anderson"] = bench_anderson(args, q)
    rows = rows_of(results)
    print_table(rows)
    results["table"] = [dict(name=n, time_s=t, value=v, target=tg, sense=s, passed=passed(v, tg, s))
                        for n, t, v, tg, s in rows]
    results["machine"] = dict(
        torch_threads=threads, cpu_count=os.cpu_count(), processor=platform.processor(),
        platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
        pflcore=pflcore.__version__, backends={k: list(v) for k, v in status.items()},
        loadavg_1min_start=load_start, loadavg_1min_end=os.getloadavg()[0], **machine_extra())
    results["config"] = dict(quick=args.quick, repeats=args.repeats, slow_clients=args.slow_clients)
    results["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    results["total_wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    png = plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"\nwrote {args.out}" + (f" and {png}" if png else "") + f" ({results['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
