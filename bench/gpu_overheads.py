"""Where the wall time of small GPU calls goes (bench/h100.sh's stage ``over``): the issue's
one-client local_steps call (< 100 µs) and ``average`` at 10⁵ × 610 (>= 50% of the copy
bandwidth) each split into its parts, every part the median of many calls with the device
synchronized after each (a caller's wait):

- local_steps, 1 client × 20 rows, Softmax(60, 10), 1 step: the public op (its screen and steps in
  one module call); the same op with the torch value screen (PFLCORE_CUDA_SCREEN=torch), with the
  module's screen as a call of its own (=separate), with the warp kernel's row-at-a-time staging
  (PFLCORE_CUDA_GLM=warp_rows); the op without a screen (a run's trusted call); the module's launch
  alone (arguments prepared once); an empty synchronize and one tiny torch op, for scale;
- average of [10⁵, 610] float32 with weights: the public op (the screen in its kernels); the same
  with the torch screen around them (PFLCORE_CUDA_AVERAGE=torch); the module's two kernels alone;
  the torch screen and result check alone.

    python bench/gpu_overheads.py --out bench/results/gpu_overheads.json   # on a GPU machine
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_overheads.json"))
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench/gpu_overheads.py: no CUDA device; nothing was measured")
        return 0
    import _harness as harness
    import pflcore
    from pflcore import backend, models, ops
    from pflcore.backends import _values, cuda as cuda_adapter
    from pflcore.ops.local_steps import run_local_steps

    dev = torch.device("cuda")

    def med(fn, calls=args.calls):
        return harness.time_runs(fn, calls, sync=torch.cuda.synchronize, warmup=10).median

    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def record(name, fn, **kw):
        try:
            res[name] = med(fn, **kw)
            print(f"{name:55s} {res[name] * 1e6:10.1f} µs", flush=True)
        except Exception as exc:  # one failure keeps the other parts
            res[name] = None
            res[name + "_error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: {res[name + '_error']}", flush=True)

    t = torch.zeros(1, device=dev)
    record("synchronize_s", lambda: None)
    record("one_torch_op_s", lambda: t.add_(1))

    model = models.Softmax(60, 10)
    g = torch.Generator(device=dev).manual_seed(7)
    data = pflcore.ClientData(torch.randn(20, 60, generator=g, device=dev),
                              torch.randint(0, 10, (20,), generator=g, device=dev),
                              torch.tensor([0, 20], device=dev))
    theta = torch.zeros(1, model.d, device=dev)
    with backend.use("cuda"):
        for name, env in (("local_steps_small_op_s", {}),
                          ("local_steps_small_op_torch_screen_s", {"PFLCORE_CUDA_SCREEN": "torch"}),
                          ("local_steps_small_op_separate_screen_s", {"PFLCORE_CUDA_SCREEN": "separate"}),
                          ("local_steps_small_op_warp_rows_s", {"PFLCORE_CUDA_GLM": "warp_rows"})):
            with harness.environ(**env):
                record(name, lambda: ops.local_steps(model, theta, data, steps=1, lr=0.01))
        record("local_steps_small_trusted_s", lambda: run_local_steps(model, theta, data, 1, 0.01, 0.0, None, None,
                                                                      None, None, True))
    ad = backend.ADAPTERS["cuda"]
    module = ad.module
    lead = cuda_adapter.glm_args(model, theta, data, None)  # rows None: a null address, as the op passes
    stream = cuda_adapter.stream(theta)
    record("local_steps_small_module_launch_s",
           lambda: module.local_steps(*lead, 0, 0, 0, False, 0, 1, 0.01, 0.0, 0, 0, "float32", stream))
    record("local_steps_small_torch_screen_only_s",
           lambda: _values.glm_fault(model, theta, data, None, None, None, None))

    m, d = 100_000, 610
    th = torch.randn(m, d, generator=g, device=dev)
    w = torch.rand(m, generator=g, device=dev) + 0.1
    record("average_op_s", lambda: ops.average(th, w), calls=100)
    with harness.environ(PFLCORE_CUDA_AVERAGE="torch"):
        record("average_op_torch_screen_s", lambda: ops.average(th, w), calls=100)
    safe, wsum, flags = _values.average_screen(th, w, None)
    out = torch.empty(d, device=dev)
    buf = torch.empty(module.average_scratch(m, d), dtype=torch.float64, device=dev)
    record("average_kernels_only_s", lambda: module.average(th.data_ptr(), w.data_ptr(), 0, m, d, m, wsum.data_ptr(),
                                                            out.data_ptr(), buf.data_ptr(), "float32", stream),
           calls=100)

    def screen_only():
        s, ws, fl = _values.average_screen(th, w, None)
        _values.average_result_fault(th, w, None, out, fl)
    record("average_screen_and_check_only_s", screen_only, calls=100)
    res["average_bytes"] = m * d * 4 + m * 4 + d * 4
    print(f"wrote {harness.write_json(args.out, res, machine=False)}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"({time.time() - t0:.0f} s)")
    sys.exit(code)
