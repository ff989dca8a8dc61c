"""The Triton adapter: the kernels of ``pflcore.triton`` on CUDA tensors (or, with
``TRITON_INTERPRET=1`` set before they are first loaded, on CPU tensors under Triton's
interpreter: slow, for the tests; only used when asked for by name). Values are checked
before the launch by the torch pre-pass of ``_values.py``."""
from __future__ import annotations

import importlib
from typing import List

import torch

from pflcore.backends import _values
from pflcore.backends.base import Adapter, all_rows, evaluation_outputs, label_segments


class TritonAdapter(Adapter):
    name = "triton"
    devices = ("cuda",)

    def _load(self):
        try:
            import triton
        except ImportError as exc:
            return None, f"triton is not installed: pip install 'pflcore[triton]' ({exc})"
        module = importlib.import_module("pflcore.triton")
        if module.INTERPRETED:
            return module, (f"Triton {triton.__version__} under TRITON_INTERPRET=1: the kernels run on "
                            f"the CPU interpreter (slow); CPU tensors only when requested by name")
        if not torch.cuda.is_available():
            return None, (f"Triton {triton.__version__} is installed, but torch sees no CUDA device "
                          f"(set TRITON_INTERPRET=1 before the first use to run its kernels on CPU "
                          f"tensors under the interpreter)")
        return module, f"Triton {triton.__version__}"

    @property
    def interpreted(self) -> bool:
        module = self.module
        return module is not None and module.INTERPRETED

    @property
    def auto(self) -> bool:  # the interpreter is for tests: only ever used by name
        return not self.interpreted

    def serves(self, device_type: str) -> bool:
        return device_type in (("cuda", "cpu") if self.interpreted else self.devices)

    def local_steps(self, model, theta, data, rows, batches, anchor, grad_scale, steps, lr, prox, trusted=False):
        if steps == 0:
            return
        if not trusted:  # the run's own draws: no pre-pass, no host sync (see _values.py)
            _values.glm_fault(model, theta, data, rows, batches, anchor, grad_scale)
        self.module.local_steps(model, theta, data, all_rows(data, rows), batches, anchor, grad_scale,
                                steps, lr, prox)

    def gradients(self, model, theta, data, rows, batches, trusted=False):
        if not trusted:  # the run's own draws: no pre-pass, no host sync (see _values.py)
            _values.glm_fault(model, theta, data, rows, batches)
        rows = all_rows(data, rows)
        # a shared model [d] is read by every row in place (row stride 0), not copied to [R, d]
        out = torch.empty(rows.numel(), model.d, dtype=theta.dtype, device=theta.device)
        self.module.gradients(model, theta, data, rows, batches, out)
        return out

    def evaluate(self, model, theta, data, rows, batches=None, trusted=False):
        if not trusted:  # the run's own draws: no pre-pass, no host sync (see _values.py)
            _values.glm_fault(model, theta, data, rows, batches)
        dev = theta.device
        rows = all_rows(data, rows)
        loss, correct, count = evaluation_outputs(rows.numel(), theta.dtype, dev)
        # whole clients or the sample ``batches [R, B]``: one launch either way
        self.module.evaluate(model, theta, data, rows, batches, loss, correct, count)
        return loss, correct, count

    def kmeans_assign(self, points, centroids):
        _values.kmeans_assign_fault(points, centroids)
        N = points.shape[0]
        labels = torch.empty(N, dtype=torch.int64, device=points.device)
        sqdist = torch.empty(N, dtype=points.dtype, device=points.device)
        self.module.kmeans_assign(points, centroids, labels, sqdist)
        return labels, sqdist

    def kmeans_update(self, points, labels, weights, centroids):
        K = centroids.shape[0]
        _values.kmeans_update_fault(labels, weights, K)
        wsum = torch.empty(K, dtype=torch.float64, device=points.device)
        order, seg = label_segments(labels, K)
        self.module.kmeans_update(points, labels, order, seg, weights, centroids, wsum)
        return wsum

    def anderson_push(self, u, tu, R_hist, TU_hist, slot: int, slots: List[int]):
        order = torch.tensor(slots, dtype=torch.int64, device=u.device)
        dots = torch.empty(len(slots), dtype=torch.float64, device=u.device)
        self.module.anderson_push(u, tu, R_hist, TU_hist, slot, order, dots)
        return dots.cpu()

    def anderson_mix(self, TU_hist, slots: List[int], pi):
        out = torch.empty(TU_hist.shape[1], dtype=TU_hist.dtype, device=TU_hist.device)
        self.module.anderson_mix(TU_hist, torch.tensor(slots, dtype=torch.int64, device=TU_hist.device),
                                 pi.to(TU_hist.device), out)
        return out

    def gram(self, vecs):
        G = torch.empty(vecs.shape[0], vecs.shape[0], dtype=torch.float64, device=vecs.device)
        self.module.gram(vecs, G)
        return G.cpu()
