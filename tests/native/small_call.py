"""A small call of the CPU kernels straight from the extension module's file, without torch.

Run as ``python small_call.py PATH_TO__core.so`` (the tests run it natively and under
``qemu-x86_64 -cpu ...``, where importing torch would take minutes): loads the module alone,
runs local_steps (float32 minibatch softmax and float64 full-batch logistic), sample_batches
and kmeans_assign on small arrays and prints JSON with the level in use and the results.
"""
import importlib.machinery
import importlib.util
import json
import sys

import numpy as np


def load(path):
    loader = importlib.machinery.ExtensionFileLoader("pflcore._core", path)
    spec = importlib.util.spec_from_file_location("pflcore._core", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main(path):
    core = load(path)
    rng = np.random.default_rng(0)
    m, p, C, steps, B = 3, 7, 10, 2, 20
    sizes = np.array([25, 31, 40])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(offsets[-1])
    out = {"level": core.cpu_capability()}

    x32 = rng.standard_normal((N, p)).astype(np.float32)
    y = rng.integers(0, C, N).astype(np.int64)
    theta32 = np.zeros((m, (p + 1) * C), np.float32)
    batches = np.empty((m, steps, B), np.int32)
    core.sample_batches(offsets.ctypes.data, m, N, 0, 0, m, steps, B, 7, 0, batches.ctypes.data)
    core.local_steps(False, 2, p, C, True, 1e-3, theta32.ctypes.data, m, x32.ctypes.data, N, y.ctypes.data,
                     offsets.ctypes.data, m, 0, batches.ctypes.data, B, 0, False, 0, steps, 0.1, 0.0, True)
    out["batches"] = batches.reshape(-1).tolist()
    out["softmax_f32"] = theta32.reshape(-1).astype(float).tolist()

    x64 = rng.standard_normal((N, p))
    y01 = rng.integers(0, 2, N).astype(np.int64)
    theta64 = np.zeros((m, p + 1), np.float64)
    core.local_steps(True, 1, p, 1, True, 0.0, theta64.ctypes.data, m, x64.ctypes.data, N, y01.ctypes.data,
                     offsets.ctypes.data, m, 0, 0, 0, 0, False, 0, 3, 0.5, 0.0, True)
    out["logistic_f64"] = theta64.reshape(-1).tolist()

    centroids = x32[:4].copy()
    labels = np.empty(N, np.int64)
    sqdist = np.empty(N, np.float32)
    core.kmeans_assign(False, x32.ctypes.data, N, p, centroids.ctypes.data, 4, labels.ctypes.data,
                       sqdist.ctypes.data)
    out["labels"] = labels.tolist()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
