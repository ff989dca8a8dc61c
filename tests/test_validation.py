"""Bad input gets a ValueError that names the argument (DESIGN.md §4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_data, make_model
from pflcore import ClientData, backend, models, ops


def _setup(dtype=torch.float32):
    model = make_model("softmax", 4, 3)
    data = make_data(model, [3, 1, 5], dtype)
    theta = torch.zeros(3, model.d, dtype=dtype)
    return model, data, theta


@pytest.mark.parametrize("bad,match", [
    (lambda x, y, o: (x.clone().index_fill_(0, torch.tensor([2]), float("nan")), y, o), r"x: contains 4 NaN"),
    (lambda x, y, o: (x.clone().index_fill_(0, torch.tensor([0]), float("inf")), y, o), r"x: contains 4 NaN or inf"),
    (lambda x, y, o: (x, y, o + 1), r"offsets: must start at 0, got offsets\[0\] = 1"),
    (lambda x, y, o: (x, y, torch.tensor([0, 3, 2, 9])), r"offsets: must be non-decreasing"),
    (lambda x, y, o: (x, y, torch.tensor([0, 3, 4, 8])), r"offsets: must end at N = 9"),
    (lambda x, y, o: (x, y, torch.tensor([0, 3, 3, 9])), r"offsets: client 1 is empty"),
    (lambda x, y, o: (x, y, o.double()), r"offsets: expected dtype int64, got float64"),
    (lambda x, y, o: (x.half(), y, o), r"x: expected dtype float32 or float64, got float16"),
    (lambda x, y, o: (x, y[:-1], o), r"y: expected shape \[N\] = \[9\], got \[8\]"),
    (lambda x, y, o: (x, -y - 1, o), r"y: class labels must be >= 0"),
    (lambda x, y, o: (x[:, 0], y, o), r"x: expected shape \[N, p\]"),
    (lambda x, y, o: (x.tolist(), y, o), r"x: expected an array \(torch.Tensor, numpy.ndarray, or an object with "
                                         r"__dlpack__ such as a JAX or CuPy array\), got list"),
])
def test_client_data_rejects(bad, match):
    _, data, _ = _setup()
    with pytest.raises(ValueError, match=match):
        ClientData(*bad(data.x, data.y, data.offsets))


def test_label_out_of_range_and_wrong_label_kind():
    model, data, theta = _setup()
    y = data.y.clone()
    y[4] = 3
    with pytest.raises(ValueError, match=r"^y: expected labels in \[0, 3\), got y\[4\] = 3$"):
        ops.local_steps(model, theta, ClientData(data.x, y, data.offsets), steps=1, lr=0.1)
    first_two = int(torch.nonzero(data.y == 2)[0])
    with pytest.raises(ValueError, match=rf"^y: expected labels in \[0, 2\), got y\[{first_two}\] = 2$"):
        ops.evaluate(models.Logistic(4), torch.zeros(3, 5), data)
    with pytest.raises(ValueError, match=r"y: LeastSquares needs float targets"):
        ops.gradients(models.LeastSquares(4), torch.zeros(3, 5), data)


@pytest.mark.parametrize("make_theta,match", [
    (lambda t: t[:, :-1], r"theta: expected shape \[m, d\] = \[3, 15\], got \[3, 14\]"),
    (lambda t: t[:2], r"theta: expected shape \[m, d\] = \[3, 15\], got \[2, 15\]"),
    (lambda t: t.double(), r"theta: expected dtype float32 \(the dtype of the data\), got float64"),
    (lambda t: t.half(), r"theta: expected dtype float32 or float64, got float16"),
    (lambda t: t.clone().fill_(float("nan")), r"theta: row 0 holds a NaN or infinite value"),
    (lambda t: t.to("meta"), r"theta: tensors on device 'meta' are not served by any backend"),
    (lambda t: torch.zeros(15, 3).T, r"theta: expected a contiguous array"),
])
def test_local_steps_rejects_bad_theta(make_theta, match):
    model, data, theta = _setup()
    with pytest.raises(ValueError, match=match):
        ops.local_steps(model, make_theta(theta), data, steps=1, lr=0.1)


def test_local_steps_rejects_bad_options():
    model, data, theta = _setup()
    for kw, match in [
        (dict(lr=0.0), r"lr: expected a number > 0"), (dict(lr=float("nan")), r"lr: expected a finite"),
        (dict(prox=-1.0), r"prox: expected a number >= 0"), (dict(steps=-1), r"steps: expected an integer in \[0, 2147483647\]"),
        (dict(steps=1.5), r"steps: expected an integer"),
        (dict(anchor=torch.zeros(14)), r"anchor: expected shape \[d\] = \[15\], got \[14\]"),
        (dict(anchor=torch.zeros(2, 15)), r"anchor: expected shape \[R, d\] or \[d\] = \[3, 15\], got \[2, 15\]"),
        (dict(grad_scale=torch.ones(4)), r"grad_scale: expected shape \[R\] = \[3\], got \[4\]"),
        (dict(rows=torch.tensor([0, 1, 3])), r"rows: expected client indices in \[0, 3\), got rows\[2\] = 3"),
        (dict(batches=torch.zeros(3, 1, 2, dtype=torch.int64)), r"batches: expected dtype int32 \(ops.sample_batches\), got int64"),
        (dict(batches=torch.zeros(3, 2, 2, dtype=torch.int32)), r"batches: expected shape \[R, steps, B\]"),
    ]:
        args = dict(steps=1, lr=0.1)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            ops.local_steps(model, theta.clone(), data, **args)


def test_batch_index_outside_its_clients_rows():
    model, data, theta = _setup()
    batches = torch.tensor([[[0, 2]], [[3, 3]], [[4, 3]]], dtype=torch.int32)  # client 2 owns rows 4..8
    with pytest.raises(ValueError, match=r"batches: index 3 at \[2, 0, 1\] is outside the rows \[4, 9\) of client 2"):
        ops.local_steps(model, theta, data, steps=1, lr=0.1, batches=batches)


def test_meta_device_is_a_clear_error_not_a_crash():
    pts = torch.zeros(4, 3, device="meta")
    with pytest.raises(ValueError, match=r"(not served by any backend|on device 'meta')"):
        ops.kmeans_assign(pts, torch.zeros(2, 3, device="meta"))
    with pytest.raises(ValueError, match="not served by any backend"):
        backend.select("local_steps", models.Softmax(3, 2), torch.zeros(1, device="meta"))


def test_kmeans_anderson_average_sampling_reject_bad_input():
    pts = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"centroids: expected shape \[K, d\] with d = 3, got \[2, 4\]"):
        ops.kmeans_assign(pts, torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"centroids: expected dtype float32 \(the dtype of the data\), got float64"):
        ops.kmeans_assign(pts, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"points: row 0 holds a NaN or infinite value"):
        ops.kmeans_assign(pts.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"))), pts[:2])
    with pytest.raises(ValueError, match=r"k: expected at most N = 5"):
        ops.kmeans(pts, 6)
    with pytest.raises(ValueError, match=r"init: expected 'k-means\+\+'"):
        ops.kmeans(pts, 2, init="random")
    with pytest.raises(ValueError, match=r"weights: expected finite weights >= 0, got weights\[0\] = -1"):
        ops.kmeans(pts, 2, weights=-torch.ones(5))
    with pytest.raises(ValueError, match=r"weights: expected non-negative weights with a positive sum"):
        ops.kmeans(pts, 2, weights=torch.zeros(5))
    with pytest.raises(ValueError, match=r"residuals: expected shape \[k, D\]"):
        ops.anderson_weights(torch.zeros(4))
    with pytest.raises(ValueError, match=r"tu: expected shape the shape of u"):
        ops.Anderson().step(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"memory: expected an integer in \[0, 1024\]"):
        ops.Anderson(memory=-1)
    with pytest.raises(ValueError, match=r"weights: expected shape \[m\] = \[5\], got \[4\]"):
        ops.average(pts, torch.ones(4))
    with pytest.raises(ValueError, match=r"weights: the weights of the averaged rows sum to 0"):
        ops.average(pts, torch.zeros(5))
    _, data, _ = _setup()
    with pytest.raises(ValueError, match=r"seed: expected an integer in \[0, 2\*\*32\)"):
        ops.sample_batches(data, steps=1, batch_size=2, seed=-1, counter=0)
    with pytest.raises(ValueError, match=r"batch_size: expected an integer in \[1, 2147483647\]"):
        ops.sample_batches(data, steps=1, batch_size=0, seed=0, counter=0)


def test_models_reject_bad_hyperparameters():
    with pytest.raises(ValueError, match=r"p: expected an integer in \[1, 2147483647\]"):
        models.Softmax(0, 3)
    with pytest.raises(ValueError, match=r"l2: expected a number >= 0"):
        models.Logistic(3, l2=-1)
    with pytest.raises(ValueError, match=r"model: expected a GLM"):
        ops.local_steps("softmax", np.zeros((3, 15), np.float32), _setup()[1], steps=1, lr=0.1)
    with pytest.raises(ValueError, match=r"data: x has 4 features but the model expects p = 5"):
        ops.gradients(models.Softmax(5, 3), torch.zeros(3, 18), _setup()[1])


def test_anderson_names_the_non_finite_argument():
    acc = ops.Anderson(memory=2)
    bad = torch.zeros(6)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match=r"u: contains 1 NaN"):
        acc.step(bad, torch.zeros(6))
    with pytest.raises(ValueError, match=r"tu: contains 1 NaN or infinite"):
        acc.step(torch.zeros(6), torch.full((6,), float("inf")).index_fill_(0, torch.arange(1, 6), 0.0))
