"""local_steps / gradients / evaluate: native kernels against the torch references on odd
shapes, both dtypes, every family and every option (DESIGN.md §4, §7)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import DTYPES, TOL, make_data, make_model, random_sizes
from pflcore import ops

# every test once per CPU capability level this CPU runs (conftest.py: cpu_level)
pytestmark = pytest.mark.usefixtures("cpu_level")

# (family, p, C): p not a multiple of the vector width, C = 1, 2, 10.
CASES = [("least_squares", 1, 1), ("least_squares", 17, 1), ("logistic", 3, 1), ("logistic", 61, 1),
         ("softmax", 1, 2), ("softmax", 17, 10), ("softmax", 61, 10), ("softmax", 3, 2)]
SHAPES = {"m1": [1], "n1": [1, 1, 1], "ragged": None}


def _sizes(kind):
    return random_sizes(9, seed=3) if SHAPES[kind] is None else SHAPES[kind]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C", CASES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_full_batch_matches_reference(family, p, C, dtype, shape):
    model = make_model(family, p, C, l2=0.05)
    data = make_data(model, _sizes(shape), dtype, seed=p + C)
    g = torch.Generator().manual_seed(7)
    theta = 0.3 * torch.randn(data.num_clients, model.d, generator=g, dtype=dtype)
    got = ops.local_steps(model, theta.clone(), data, steps=3, lr=0.1)
    want = ops.local_steps_ref(model, theta.clone(), data, steps=3, lr=0.1)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert not torch.equal(got, theta), "the steps must move theta"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C", [("softmax", 17, 10), ("logistic", 3, 1), ("least_squares", 61, 1)])
@pytest.mark.parametrize("anchor_kind", ["none", "shared", "per_row"])
def test_minibatch_anchor_rows_grad_scale(family, p, C, dtype, anchor_kind):
    model = make_model(family, p, C, l2=0.01, fit_intercept=(p != 3))
    data = make_data(model, random_sizes(6, seed=p), dtype, seed=11)
    R = 10
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, data.num_clients, (R,), generator=g)
    theta = 0.2 * torch.randn(R, model.d, generator=g, dtype=dtype)
    anchor = {"none": None, "shared": torch.randn(model.d, generator=g, dtype=dtype),
              "per_row": torch.randn(R, model.d, generator=g, dtype=dtype)}[anchor_kind]
    grad_scale = torch.rand(R, generator=g, dtype=dtype) * 3
    batches = ops.sample_batches(data, steps=4, batch_size=5, seed=9, counter=1, clients=rows)
    kw = dict(steps=4, lr=0.05, prox=0.7, anchor=anchor, batches=batches, rows=rows, grad_scale=grad_scale)
    got = ops.local_steps(model, theta.clone(), data, **kw)
    want = ops.local_steps_ref(model, theta.clone(), data, **kw)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_step_formula_by_hand():
    """One step of least squares without intercept, against the formula written out."""
    model = make_model("least_squares", 2, 1, l2=0.1, fit_intercept=False)
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]], dtype=torch.float64)
    y = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    from pflcore import ClientData
    data = ClientData(x, y, torch.tensor([0, 3]))
    theta = torch.tensor([[0.2, -0.4]], dtype=torch.float64)
    a = torch.tensor([1.0, 1.0], dtype=torch.float64)
    grad = x.T @ (x @ theta[0] - y) / 3
    want = theta[0] - 0.3 * (2.0 * grad + 0.1 * theta[0] + 0.5 * (theta[0] - a))
    got = ops.local_steps(model, theta.clone(), data, steps=1, lr=0.3, prox=0.5, anchor=a,
                          grad_scale=torch.tensor([2.0], dtype=torch.float64))
    torch.testing.assert_close(got[0], want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("family,p,C", [("softmax", 5, 3), ("logistic", 4, 1), ("least_squares", 3, 1)])
def test_reference_gradient_equals_autograd(family, p, C):
    """The references' closed-form gradients agree with autograd of the loss they state."""
    model = make_model(family, p, C, l2=0.2)
    data = make_data(model, [7, 3], torch.float64, seed=2)
    theta = torch.randn(2, model.d, dtype=torch.float64)
    want = []
    for i in range(2):
        X, y = data.client(i)
        W = theta[i].clone().view(model.P, C).requires_grad_(True)
        z = X @ W[:p] + W[p]
        if family == "least_squares":
            loss = (0.5 * (z[:, 0] - y) ** 2).mean()
        elif family == "logistic":
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z[:, 0], y.double())
        else:
            loss = torch.nn.functional.cross_entropy(z, y)
        loss = loss + 0.1 * (W ** 2).sum()
        want.append(torch.autograd.grad(loss, W)[0].reshape(-1))
    torch.testing.assert_close(ops.gradients_ref(model, theta, data), torch.stack(want))
    torch.testing.assert_close(ops.gradients(model, theta, data), torch.stack(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C", CASES)
def test_gradients_and_evaluate_match_reference(family, p, C, dtype):
    model = make_model(family, p, C, l2=0.3)
    data = make_data(model, random_sizes(8, seed=C), dtype, seed=1)
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(data.num_clients, model.d, generator=g, dtype=dtype)
    torch.testing.assert_close(ops.gradients(model, theta, data), ops.gradients_ref(model, theta, data),
                               **TOL[dtype])
    loss, correct, count = ops.evaluate(model, theta, data)
    rloss, rcorrect, rcount = ops.evaluate_ref(model, theta, data)
    torch.testing.assert_close(loss, rloss, **TOL[dtype])
    assert torch.equal(count, data.sizes)
    assert torch.equal(count, rcount)
    # Predictions can only differ where two logits tie to within rounding; random data has none.
    assert torch.equal(correct, rcorrect)
    if family == "least_squares":
        assert int(correct.sum()) == 0
    else:
        assert 0 < int(correct.sum()) < int(count.sum())


def test_evaluate_rows_mapping_and_loss_value():
    """evaluate with rows: model row r is scored on client rows[r]; the loss is the plain sum."""
    model = make_model("logistic", 3, 1)
    data = make_data(model, [4, 6, 2], torch.float64, seed=4)
    theta = torch.zeros(2, model.d, dtype=torch.float64)
    loss, correct, count = ops.evaluate(model, theta, data, rows=torch.tensor([2, 0]))
    # At θ = 0 every row has loss log 2 and is predicted 0.
    torch.testing.assert_close(loss, torch.tensor([2, 4], dtype=torch.float64) * np.log(2.0))
    assert count.tolist() == [2, 4]
    y = data.y
    assert correct.tolist() == [int((y[10:12] == 0).sum()), int((y[0:4] == 0).sum())]


def test_numpy_in_numpy_out_and_in_place():
    model = make_model("softmax", 6, 3)
    data_t = make_data(model, [5, 2, 9], torch.float32)
    from pflcore import ClientData
    data = ClientData(data_t.x.numpy(), data_t.y.numpy(), data_t.offsets.numpy())
    theta = np.zeros((3, model.d), dtype=np.float32)
    out = ops.local_steps(model, theta, data, steps=2, lr=0.5)
    assert out is theta and isinstance(out, np.ndarray) and np.abs(theta).sum() > 0
    g = ops.gradients(model, theta, data)
    assert isinstance(g, np.ndarray) and g.shape == theta.shape
    loss, correct, count = ops.evaluate(model, theta, data)
    assert all(isinstance(v, np.ndarray) for v in (loss, correct, count))
    torch.testing.assert_close(torch.from_numpy(g), ops.gradients_ref(model, torch.from_numpy(theta), data_t),
                               **TOL[torch.float32])


def test_steps_zero_is_identity_and_kernel_is_fused_per_client():
    """steps=0 leaves theta alone; K steps in one call equal K calls of one step."""
    model = make_model("softmax", 7, 4, l2=0.1)
    data = make_data(model, random_sizes(5), torch.float64)
    theta = torch.randn(5, model.d, dtype=torch.float64)
    same = ops.local_steps(model, theta.clone(), data, steps=0, lr=0.1)
    assert torch.equal(same, theta)
    fused = ops.local_steps(model, theta.clone(), data, steps=4, lr=0.1, prox=0.3)
    one_by_one = theta.clone()
    for _ in range(4):
        ops.local_steps(model, one_by_one, data, steps=1, lr=0.1, prox=0.3)
    assert torch.equal(fused, one_by_one)


def test_gradient_descent_reaches_least_squares_solution():
    """Many full-batch steps on one client reach the normal-equation solution."""
    model = make_model("least_squares", 4, 1, l2=0.01)
    data = make_data(model, [50], torch.float64, seed=8)
    X = torch.cat([data.x, torch.ones(50, 1, dtype=torch.float64)], 1)
    w = torch.linalg.solve(X.T @ X / 50 + 0.01 * torch.eye(5, dtype=torch.float64), X.T @ data.y / 50)
    theta = ops.local_steps(model, torch.zeros(1, 5, dtype=torch.float64), data, steps=3000, lr=0.2)
    torch.testing.assert_close(theta[0], w, rtol=1e-9, atol=1e-9)
    assert float(ops.gradients(model, theta, data).abs().max()) < 1e-9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,C", [("softmax", 10), ("logistic", 1)])
def test_clients_larger_than_one_chunk(family, C, dtype):
    """The kernel streams a client's rows in chunks of ~256 KiB (about 1,000 rows of p = 61 in
    float32); a client of 2,500 rows and a minibatch of 1,500 rows cross chunk boundaries."""
    model = make_model(family, 61, C, l2=0.01)
    data = make_data(model, [2500, 3, 700], dtype, seed=21)
    g = torch.Generator().manual_seed(2)
    theta = 0.05 * torch.randn(3, model.d, generator=g, dtype=dtype)
    # float32 sums of 2,500 rows: up to 2,500 × 6e-8 ≈ 1.5e-4 relative, hence 3e-4.
    tol = dict(rtol=3e-4, atol=3e-4) if dtype == torch.float32 else TOL[dtype]
    for kw in (dict(), dict(batches=ops.sample_batches(data, steps=2, batch_size=1500, seed=1, counter=0))):
        got = ops.local_steps(model, theta.clone(), data, steps=2, lr=0.1, **kw)
        want = ops.local_steps_ref(model, theta.clone(), data, steps=2, lr=0.1, **kw)
        torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(ops.gradients(model, theta, data), ops.gradients_ref(model, theta, data), **tol)
    loss, correct, _ = ops.evaluate(model, theta, data)
    rloss, rcorrect, _ = ops.evaluate_ref(model, theta, data)
    torch.testing.assert_close(loss, rloss, **tol)
    assert torch.equal(correct, rcorrect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,p,C", [("softmax", 17, 10), ("logistic", 3, 1), ("least_squares", 61, 1)])
def test_minibatch_gradients_match_reference(family, p, C, dtype):
    model = make_model(family, p, C, l2=0.1)
    data = make_data(model, random_sizes(7, seed=4), dtype, seed=6)
    rows = torch.tensor([6, 0, 0, 3])
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(4, model.d, generator=g, dtype=dtype)
    b = ops.sample_batches(data, steps=1, batch_size=9, seed=2, counter=7, clients=rows)[:, 0]
    got = ops.gradients(model, theta, data, rows=rows, batches=b)
    torch.testing.assert_close(got, ops.gradients_ref(model, theta, data, rows=rows, batches=b), **TOL[dtype])
    # A batch that lists every row of the client once is the full-batch gradient.
    full = ops.gradients(model, theta[:1], data, rows=rows[:1])
    lo, hi = int(data.offsets[6]), int(data.offsets[7])
    every = torch.arange(lo, hi, dtype=torch.int32)[None]
    torch.testing.assert_close(ops.gradients(model, theta[:1], data, rows=rows[:1], batches=every), full,
                               **TOL[dtype])


# The float softmax kernel for C <= 16 classes (glm_minibatch_avx512.h where the CPU has AVX-512)
# splits a pass into blocks of 8, 4, 2 and 1 rows, transposes the logits of 8- and 4-row blocks
# for the softmax, and masks the classes past C: every batch size up to two blocks and a tail,
# and class counts at the edges of the mask, against the reference.
@pytest.mark.parametrize("C", [2, 3, 10, 16, 17])
def test_softmax_blocks_and_class_masks_match_reference(C):
    model = make_model("softmax", 13, C, l2=0.05)
    data = make_data(model, [40, 23, 31], torch.float32, seed=11)
    g = torch.Generator().manual_seed(5)
    for B in list(range(1, 18)) + [20, 23, 64]:
        theta = 0.3 * torch.randn(3, model.d, generator=g)
        b = ops.sample_batches(data, steps=2, batch_size=B, seed=B, counter=0)
        got = ops.local_steps(model, theta.clone(), data, steps=2, lr=0.2, batches=b)
        want = ops.local_steps_ref(model, theta.clone(), data, steps=2, lr=0.2, batches=b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"B={B}: {m}")
        one = b[:, 0]
        torch.testing.assert_close(ops.gradients(model, theta, data, batches=one),
                                   ops.gradients_ref(model, theta, data, batches=one), rtol=1e-5, atol=1e-5)
        theta[0] = 0.0  # every logit equal for client 0: the first class is the prediction
        got_e, want_e = ops.evaluate(model, theta, data, batches=one), ops.evaluate_ref(model, theta, data, batches=one)
        torch.testing.assert_close(got_e[0], want_e[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got_e[1], want_e[1]), f"B={B}: correct counts {got_e[1]} vs {want_e[1]}"


def test_a_federation_past_the_prefetch_size_gives_the_small_ones_bits():
    """A full-batch pass over data of more than 32 MB asks for the rows of the client two model
    rows on while it computes (csrc/cpu/glm.cpp prefetch_next_client): the clients' steps and
    gradients are bitwise those of the same clients in a federation of their own (no prefetch),
    in order, permuted and repeated (``rows``), up to the last client's rows at the data's end."""
    from pflcore import ClientData
    model = make_model("softmax", 61, 10, l2=0.01)
    m, n = 2200, 64  # 2,200 clients x 64 rows x 61 float32 features: 34 MB
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m * n, 61, generator=g)
    y = torch.randint(0, 10, (m * n,), generator=g)
    big = ClientData(x, y, torch.arange(0, m * n + 1, n))
    assert x.numel() * 4 > 32 << 20
    picks = torch.tensor([m - 1, 3, m - 2, 3, 0, m - 1])  # the data's last client, repeats
    small = ClientData(x[-2 * n:].clone(), y[-2 * n:].clone(), torch.tensor([0, n, 2 * n]))
    small_rows = torch.tensor([1, 0, 1])  # clients m - 1, m - 2, m - 1 of big
    theta = 0.05 * torch.randn(picks.numel(), model.d, generator=g)
    got = ops.local_steps(model, theta.clone(), big, steps=3, lr=0.1, rows=picks)
    want = ops.local_steps(model, theta[[0, 2, 5]].clone(), small, steps=3, lr=0.1, rows=small_rows)
    assert torch.equal(got[[0, 2, 5]], want)
    assert torch.equal(ops.gradients(model, theta, big, rows=picks)[[0, 2, 5]],
                       ops.gradients(model, theta[[0, 2, 5]], small, rows=small_rows))
    every = ops.gradients(model, theta[0], big)  # every client, one model
    head = ClientData(x[:4 * n].clone(), y[:4 * n].clone(), torch.arange(0, 4 * n + 1, n))
    assert torch.equal(every[:4], ops.gradients(model, theta[0], head))
