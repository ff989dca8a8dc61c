"""The native CNN kernels (``csrc/cpu/cnn.cpp``) against their torch reference
(``cnn_native.TorchOps``) on random buffers: register-block remainders (rows not a multiple of
4 or 3, taps not a multiple of 4, positions not a multiple of 3 vectors), several groups, both
dtypes, pooling ties and NaN. The whole chunk on both is checked in test_cnn_batched.py."""
from __future__ import annotations

import pytest
import torch

from pflcore.backends import cnn_native

from conftest import DTYPES, TOL

NATIVE = cnn_native.native_ops()
# every CPU level's copy of the kernels (their register blocks and vector widths differ by level)
pytestmark = [pytest.mark.skipif(NATIVE is None, reason="the native module has no CNN kernels"),
              pytest.mark.usefixtures("cpu_level")]
REF = cnn_native.TorchOps()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("R, Tn, P", [(1, 1, 16), (3, 5, 16), (4, 9, 32), (6, 25, 48), (7, 13, 64), (2, 7, 112),
                                     (5, 26, 208), (9, 4, 48), (16, 150, 144)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shifted_gemm_and_corr_equal_the_reference(R, Tn, P, dtype):
    G, n, src_img = 2, 3, max(50, P)
    g = _gen(R * 100 + Tn)
    off = torch.randint(0, 30, (Tn,), generator=g)
    src = torch.randn(G * n * src_img + 40, generator=g, dtype=dtype)  # every q + off[t] lies inside
    w = torch.randn(G, R, Tn, generator=g, dtype=dtype)
    bias = torch.randn(G, R, generator=g, dtype=dtype)
    out_img, out_row = R * (P + 1) + 5, P + 1  # strides wider than the rows: the gaps stay as they are
    for b in (bias, None):
        got = torch.full((G * n * out_img,), 7.0, dtype=dtype)
        want = got.clone()
        NATIVE.shifted_gemm(src, src_img, off, w, b, G, n, R, P, got, out_img, out_row)
        REF.shifted_gemm(src, src_img, off, w, b, G, n, R, P, want, out_img, out_row)
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert int((got == 7.0).sum()) == G * n * (out_img - R * P)  # the gaps
    a = got[: G * n * out_img]
    dw, db, dw_ref, db_ref = (torch.empty(G, R, *s, dtype=dtype) for s in ((Tn,), (), (Tn,), ()))
    NATIVE.shifted_corr(a, out_img, out_row, src, src_img, off, G, n, R, P, dw, db)
    REF.shifted_corr(a, out_img, out_row, src, src_img, off, G, n, R, P, dw_ref, db_ref)
    torch.testing.assert_close(dw, dw_ref, **TOL[dtype])
    torch.testing.assert_close(db, db_ref, **TOL[dtype])
    assert float(dw_ref.abs().max()) > 1.0


@pytest.mark.parametrize("cout, cin, k, ho, wo", [(1, 1, 1, 3, 5), (3, 2, 3, 4, 6), (5, 3, 5, 7, 9), (16, 6, 5, 10, 10),
                                                 (7, 4, 2, 5, 11)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_grad_equals_the_reference(cout, cin, k, ho, wo, dtype):
    """The scatter-form input gradient: tap-row remainders (k² not a multiple of 4), Cout as the
    GEMM's taps (any count), positions not a multiple of 3 vectors, planes with gaps."""
    G, n = 2, 3
    wp = wo + k - 1
    P = -(-ho * wp // 16) * 16
    qv = (ho - 1) * wp + wo
    dz_row, dx_row = P + 3, (ho + k - 1) * wp + 5  # wider than needed: every value of dx's plane is written
    g = _gen(cout * 100 + k)
    dz = torch.randn(G * n * cout * dz_row, generator=g, dtype=dtype)
    planes = dz.view(G * n * cout, dz_row)
    planes[:, :ho * wp].view(-1, ho, wp)[..., wo:] = 0  # the garbage columns (zero, as pool_relu_backward writes)
    planes[:, ho * wp:P] = 0
    wt = torch.randn(G, cin * k * k, cout, generator=g, dtype=dtype)
    dx_img = cin * dx_row + 4  # gaps between images stay as they are
    got = torch.full((G * n * dx_img,), 7.0, dtype=dtype)
    want = got.clone()
    NATIVE.input_grad(dz, cout * dz_row, dz_row, wt, G, n, cout, cin, k, wp, P, qv, got, dx_img, dx_row)
    REF.input_grad(dz, cout * dz_row, dz_row, wt, G, n, cout, cin, k, wp, P, qv, want, dx_img, dx_row)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert int((got == 7.0).sum()) == G * n * 4
    # against torch's own transposed convolution on the valid columns
    dzv = dz.view(G * n, cout, dz_row)[:, :, :ho * wp].reshape(G * n, cout, ho, wp)[..., :wo]
    W = wt.view(G, cin, k, k, cout).permute(0, 4, 1, 2, 3)  # [G, Cout, Cin, k, k]
    for gi in range(G):
        ref = torch.nn.functional.conv_transpose2d(dzv[gi * n:(gi + 1) * n], W[gi])  # [n, Cin, ho + k − 1, wp]
        mine = got.view(G * n, dx_img)[gi * n:(gi + 1) * n, :cin * dx_row].view(n, cin, dx_row)
        torch.testing.assert_close(mine[..., :(ho + k - 1) * wp].reshape(ref.shape), ref, **TOL[dtype])


@pytest.mark.parametrize("pool", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w2, planes", [(3, False), (11, False), (17, True), (8, True)])
def test_pool_relu_and_its_gradient_equal_the_reference(pool, dtype, w2, planes):
    """Window rows of 3, 8, 11 and 17 (pool 2: whole vectors of windows, 4 or 8 lanes, and the
    rest one at a time), into features-like (columns n apart) or plane-like (contiguous) outputs."""
    N, C, n, h2 = 6, 3, 3, 4
    wz = w2 * pool + 2  # garbage columns beyond the windows
    z_row = (h2 * pool + 1) * wz
    g = _gen(pool * 100 + w2)
    z = torch.randint(-12, 3, (N * C * z_row,), generator=g).to(dtype)  # integers: many ties, windows <= 0
    z[5] = float("nan")  # a NaN wins its window, as in torch's max-pooling
    seen = {(0, 0, 5 // pool)}  # more NaNs, one a window at most (which of two NaNs wins is not specified)
    for q in torch.randint(0, z.numel(), (z.numel() // 50,), generator=g).tolist():
        win = (q // z_row, q % z_row // wz // pool, q % wz // pool)
        if win not in seen:
            seen.add(win)
            z[q] = float("nan")
    if planes:  # pooled output into [G, n, C, h2, w2] (the next layer's input planes, unpadded)
        strides = (n * C * h2 * w2, C * h2 * w2, h2 * w2, w2, 1)
    else:  # into [G, C, h2, w2, n] (group, channel, row, column, image: strided like the features)
        strides = (C * h2 * w2 * n, 1, h2 * w2 * n, w2 * n, n)
    outs, idxs = [], []
    for ops in (NATIVE, REF):
        out = torch.full((N * C * h2 * w2,), -5.0, dtype=dtype)
        idx = torch.empty(N * C * h2 * w2, dtype=torch.int32)
        ops.pool_relu(z, N, C, z_row, wz, h2, w2, pool, n, out, *strides, idx)
        outs.append(out)
        idxs.append(idx)
    torch.testing.assert_close(outs[0], outs[1], equal_nan=True, rtol=0, atol=0)
    assert torch.equal(idxs[0], idxs[1])
    assert bool(torch.isnan(outs[0]).any()) and int((outs[0] == 0).sum()) > 0
    da = torch.randn(N * C * h2 * w2, generator=g, dtype=dtype)
    dzs = []
    for ops in (NATIVE, REF):
        dz = torch.full((N * C * z_row,), float("nan"), dtype=dtype)  # every value overwritten
        ops.pool_relu_backward(da, outs[0], N, C, h2, w2, n, *strides, idxs[0], dz, z_row)
        dzs.append(dz)
    assert torch.equal(dzs[0], dzs[1])
    assert int((dzs[0] != 0).sum()) == int((outs[0] > 0).sum())  # one value per window whose output is > 0


def test_rows_read_in_place_only_before_finite_values():
    """The first layer reads its rows in place only where the values after them (read, then
    multiplied by zero gradients) are finite: a NaN after the rows would leak into the weight
    gradient. Otherwise the rows are copied into a buffer with zeros after them."""
    assert not cnn_native._has_slack(torch.zeros(5, 12))  # nothing after the rows
    buf = cnn_native.rows_buffer(4, 10, torch.float32, "cpu")
    assert cnn_native._has_slack(buf)
    big = torch.zeros(4 * 10 + cnn_native._SLACK)
    rows = big[:40].view(4, 10)
    assert cnn_native._has_slack(rows)
    big[40 + cnn_native._SLACK - 1] = float("nan")
    assert not cnn_native._has_slack(rows)
    big[40 + cnn_native._SLACK - 1] = float("inf")
    assert not cnn_native._has_slack(rows)


def test_kernel_size_beyond_the_slack_is_not_served():
    """A wide output row reads kernel_size + 7 values past its plane: models whose kernels need
    more than the slack take the grouped convolutions."""
    from pflcore.backends import cnn_batched
    from pflcore.models.nets import CNN
    big = CNN(120 * 120, 4, image_shape=(1, 120, 120), channels=(2,), kernel_size=cnn_native._SLACK - 7, hidden=())
    small = CNN()
    assert cnn_native.supports(small) and not cnn_native.supports(big)
    theta = big.initial(2, seed=0)
    assert cnn_batched._native_ops(big, theta) is None
    assert isinstance(cnn_batched._chunk(big, theta), cnn_batched.CNNChunk)


@pytest.mark.parametrize("R, k, pool, wz, ho", [(6, 5, 2, 32, 28), (7, 3, 3, 11, 9), (16, 5, 2, 14, 10), (1, 1, 1, 5, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_pool_relu_equals_the_gemm_then_the_pooling(R, k, pool, wz, ho, dtype):
    """The fused forward (each image's conv planes pooled while in cache) against the native
    shifted_gemm + pool_relu and the torch reference: the same values and indices, bit for bit,
    into features-like strides, with and without a bias, several groups."""
    G, n, cin = 3, 2, 2
    hp = ho + k - 1
    L = hp * wz
    P = -(-ho * wz // 16) * 16
    h2, w2 = ho // pool, (wz - k + 1) // pool
    g = _gen(R * 10 + k)
    src = torch.randn(G * n * cin * L + 64, generator=g, dtype=dtype)
    taps = torch.tensor([i * wz + j for i in range(k) for j in range(k)])
    off = (torch.arange(cin)[:, None] * L + taps).reshape(-1)
    w = torch.randn(G, R, cin * k * k, generator=g, dtype=dtype)
    bias = torch.randn(G, R, generator=g, dtype=dtype)
    strides = (R * h2 * w2 * n, 1, h2 * w2 * n, w2 * n, n)
    for b in (bias, None):
        outs, idxs = [], []
        for ops in ("fused", "split", REF):
            out = torch.full((G * n * R * h2 * w2,), -5.0, dtype=dtype)
            idx = torch.full((G * n * R * h2 * w2,), -1, dtype=torch.int32)
            if ops == "split":
                z = torch.empty(G * n * R * P, dtype=dtype)
                NATIVE.shifted_gemm(src, cin * L, off, w, b, G, n, R, P, z, R * P, P)
                NATIVE.pool_relu(z, G * n, R, P, wz, h2, w2, pool, n, out, *strides, idx)
            else:
                (NATIVE if ops == "fused" else ops).conv_pool_relu(src, cin * L, off, w, b, G, n, R, P, wz, h2, w2,
                                                                   pool, out, *strides, idx)
            outs.append(out)
            idxs.append(idx)
        assert torch.equal(outs[0], outs[1]) and torch.equal(idxs[0], idxs[1])
        torch.testing.assert_close(outs[0], outs[2], **TOL[dtype])
        assert int((outs[0] == -5.0).sum()) == 0 and int((idxs[0] < 0).sum()) == 0


@pytest.mark.parametrize("R, cin, k, pool, wz, ho", [(6, 3, 5, 2, 32, 28), (16, 6, 5, 2, 14, 10), (5, 2, 3, 3, 11, 9),
                                                  (3, 5, 7, 2, 13, 8), (2, 1, 8, 2, 19, 12), (7, 4, 1, 1, 5, 3),
                                                  (1, 7, 2, 2, 9, 6)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pooled_backward_equals_the_reference(R, cin, k, pool, wz, ho, dtype):
    """The weight, bias and input gradients from the pooled gradient's nonzero windows
    (``pooled_backward``) against the dense sums over the pooling's gradient planes (the
    reference): kernel sizes 1 to 8 (every accumulator-block remainder of 1 to 7 input channels),
    three models whose gradient blocks sit in wider rows, windows the ReLU zeroes, gradients that
    are exactly 0, nothing written past the input gradient's planes; and a NaN in the pooled
    gradient reaches its channel's weight and bias gradients and the input positions its window
    read, and no other, as in the dense sums."""
    G, n = 3, 4
    hp = ho + k - 1
    L = hp * wz
    P = -(-ho * wz // 16) * 16
    h2, w2 = ho // pool, (wz - k + 1) // pool
    g = _gen(R * 100 + cin * 10 + k)
    src = torch.randn(G * n * cin * L + 64, generator=g, dtype=dtype)
    taps = torch.tensor([i * wz + j for i in range(k) for j in range(k)])
    off = (torch.arange(cin)[:, None] * L + taps).reshape(-1)
    w = torch.randn(G, R, cin * k * k, generator=g, dtype=dtype)
    wt = w.view(G, R, cin, k * k).permute(0, 2, 3, 1).contiguous()  # [G, Cin, k², R]: the input gradient's
    bias = torch.randn(G, R, generator=g, dtype=dtype)
    h = torch.empty(G * n * R * h2 * w2, dtype=dtype)
    idx = torch.empty(G * n * R * h2 * w2, dtype=torch.int32)
    strides = (n * R * h2 * w2, R * h2 * w2, h2 * w2, w2, 1)
    NATIVE.conv_pool_relu(src, cin * L, off, w, bias, G, n, R, P, wz, h2, w2, pool, h, *strides, idx)
    assert 0 < int((h > 0).sum()) < h.numel()  # (some windows the ReLU zeroes)
    da = torch.randn(h.numel(), generator=g, dtype=dtype)
    da[torch.nonzero(h > 0).flatten()[::5]] = 0.0  # gradients that are exactly 0 where h > 0
    N = G * n
    for poison in (False, True):
        if poison:  # a NaN where the ReLU passes it: model 1, channel R − 1
            at = torch.nonzero(h.view(G, n, R, -1)[1, :, R - 1].reshape(-1) > 0).flatten()[0]
            i, q = divmod(int(at), h2 * w2)
            da.view(G, n, R, -1)[1, i, R - 1, q] = float("nan")
        outs = []
        for ops in (NATIVE, REF):
            dw = torch.full((G, R * cin * k * k + 5), 7.0, dtype=dtype)[:, :R * cin * k * k].view(G, R, cin * k * k)
            db = torch.full((G, R + 3), 7.0, dtype=dtype)[:, :R]
            dx = torch.full((N * cin * L + 16,), 7.0, dtype=dtype)
            ops.pooled_backward(da, h, G, n, R, h2, w2, *strides, idx, src, cin * L, L, wz, cin, k, dw, db, wt, dx,
                                cin * L, L)
            assert bool((dx[N * cin * L:] == 7.0).all())  # nothing past the planes
            outs.append((dw, db, dx[:N * cin * L]))
        for got, want in zip(*outs):
            torch.testing.assert_close(got, want, equal_nan=True, **TOL[dtype])
        (dw, db, dx) = outs[0]
        if poison:
            assert bool(torch.isnan(dw[1, R - 1]).all()) and bool(torch.isnan(db[1, R - 1]))
            assert int(torch.isnan(dw).sum()) == cin * k * k and int(torch.isnan(db).sum()) == 1
            assert int(torch.isnan(dx).sum()) == cin * k * k  # the k x k input positions of each channel it read
        else:
            assert bool(torch.isfinite(dw).all()) and float(dw.abs().max()) > 0.1 and float(dx.abs().max()) > 0.1
        # without the input gradient: the same weight and bias gradients, bit for bit
        dw2, db2 = torch.empty(G, R, cin * k * k, dtype=dtype), torch.empty(G, R, dtype=dtype)
        NATIVE.pooled_backward(da, h, G, n, R, h2, w2, *strides, idx, src, cin * L, L, wz, cin, k, dw2, db2)
        assert torch.equal(dw2.isnan(), dw.isnan()) and torch.equal(dw2.nan_to_num(), dw.nan_to_num())
        assert torch.equal(db2.nan_to_num(), db.nan_to_num())


def test_pooled_backward_refuses_what_it_cannot_serve():
    z = torch.zeros(256)
    idx = torch.zeros(4, dtype=torch.int32)
    dw, db = torch.zeros(1, 81), torch.zeros(1, 1)
    with pytest.raises(ValueError, match="^cnn_pooled_backward: .*k <= 8"):
        NATIVE.pooled_backward(z, z, 1, 1, 1, 2, 2, 4, 4, 4, 2, 1, idx, z, 64, 64, 9, 1, 9, dw, db)
    wt, dx = torch.zeros(25), torch.zeros(64)
    idx[3] = 40  # a window whose 5 x 5 taps (Wp = 6) would reach past a plane of 64 values
    with pytest.raises(ValueError, match="^cnn_pooled_backward: .*< dx_row"):
        NATIVE.pooled_backward(z, z, 1, 1, 1, 2, 2, 4, 4, 4, 2, 1, idx, z, 64, 64, 6, 1, 5, dw, db, wt, dx, 64, 64)


def test_conv_pool_relu_refuses_windows_past_its_positions():
    src, out = torch.zeros(256), torch.zeros(64)
    idx = torch.zeros(64, dtype=torch.int32)
    off, w = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, 1)
    NATIVE.conv_pool_relu(src, 64, off, w, None, 1, 1, 1, 64, 8, 4, 4, 2, out, 16, 16, 16, 4, 1, idx)
    for bad in ((64, 8, 5, 4, 2), (60, 8, 4, 4, 2), (64, 8, 4, 5, 2), (64, 8, 4, 4, 0)):  # rows, P % 16, columns, pool
        P, wz, h2, w2, pool = bad
        with pytest.raises(ValueError, match="^cnn_conv_pool_relu: "):
            NATIVE.conv_pool_relu(src, 64, off, w, None, 1, 1, 1, P, wz, h2, w2, pool, out, 16, 16, 16, 4, 1, idx)


@pytest.mark.parametrize("net", [dict(), dict(p=3 * 11 * 13, C=4, image_shape=(3, 11, 13), channels=(5, 3),
                                             kernel_size=3, pool=3, padding=2, hidden=(6,)),
                                 dict(p=20 * 22, C=3, image_shape=(1, 20, 22), channels=(2, 3), kernel_size=9,
                                      padding=4, hidden=(5,))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_backward_is_the_three_kernels_model_by_model(net, dtype):
    """``conv_backward`` (model by model) gives the bits of ``pooled_backward`` over the whole
    chunk where it serves the layer (kernels up to 8 x 8), else of the dense kernels (the pooling's
    gradient into dz, ``shifted_corr``, ``input_grad``: the 9 x 9 net), and the reference's values,
    at every conv layer of a chunk of 3 models."""
    from pflcore import models
    model = models.CNN(**net)
    c, n = 3, 5
    g = _gen(7)
    theta = (model.initial(c, dtype, seed=1) + 0.2 * torch.randn(c, model.d, generator=g, dtype=dtype)).contiguous()
    x = torch.randn(c, n, model.p, generator=g, dtype=dtype)
    chunk = cnn_native.CNNChunk(model, model.split(theta), NATIVE)
    chunk.logits_t(x, keep=True)
    k = model.kernel_size
    for j, geo in enumerate(chunk.geo):
        a, idx, h, st = chunk._saved[j]
        da = torch.randn(h.numel(), generator=g, dtype=dtype)  # a pooled gradient in h's layout
        Wt = chunk.conv[j][2]
        N, Tn = c * n, geo.cin * k * k
        with_dx = j > 0
        outs = {}
        for name, ops in (("fused", NATIVE), ("ref", REF)):
            dW, db = torch.empty(c, geo.cout, Tn, dtype=dtype), torch.empty(c, geo.cout, dtype=dtype)
            dx = torch.full((N * geo.cin * geo.L,), 7.0, dtype=dtype) if with_dx else None
            ops.conv_backward(da, h, geo.cout, geo.h2, geo.w2, n, *st, idx, geo.lz, a, geo.cin * geo.L, geo.off_f, c,
                              dW, db, Wt, geo.cin, k, geo.wp, geo.qv, dx, geo.cin * geo.L, geo.L)
            outs[name] = (dW, db, dx)
        dW, db = torch.empty(c, geo.cout, Tn, dtype=dtype), torch.empty(c, geo.cout, dtype=dtype)
        dx = torch.full((N * geo.cin * geo.L,), 7.0, dtype=dtype) if with_dx else None
        if k <= 8:
            NATIVE.pooled_backward(da, h, c, n, geo.cout, geo.h2, geo.w2, *st, idx, a, geo.cin * geo.L, geo.L, geo.wp,
                                   geo.cin, k, dW, db, Wt, dx, geo.cin * geo.L, geo.L)
        else:
            dz = torch.empty(N * geo.cout * geo.lz, dtype=dtype)
            NATIVE.pool_relu_backward(da, h, N, geo.cout, geo.h2, geo.w2, n, *st, idx, dz, geo.lz)
            NATIVE.shifted_corr(dz, geo.cout * geo.lz, geo.lz, a, geo.cin * geo.L, geo.off_f, c, n, geo.cout, geo.lz,
                                dW, db)
            if with_dx:
                NATIVE.input_grad(dz, geo.cout * geo.lz, geo.lz, Wt, c, n, geo.cout, geo.cin, k, geo.wp, geo.lz,
                                  geo.qv, dx, geo.cin * geo.L, geo.L)
        assert torch.equal(outs["fused"][0], dW) and torch.equal(outs["fused"][1], db)
        if with_dx:
            assert torch.equal(outs["fused"][2], dx)
        for got, want in zip(outs["fused"], outs["ref"]):
            if want is not None:
                torch.testing.assert_close(got, want, **TOL[dtype])
        assert float(outs["ref"][0].abs().max()) > 0.1


def _dense_case(c, n, dims, dtype, seed, extra=3):
    """Parameters and gradients of ``dims`` dense layers as views of [c, d + extra] rows (the
    models a row apart, like theta's and the gradient's), post-ReLU-like features, labels, weights."""
    g = _gen(seed)
    sizes = [dims[i + 1] * dims[i] + dims[i + 1] for i in range(len(dims) - 1)]
    theta = 0.3 * torch.randn(c, sum(sizes) + extra, generator=g, dtype=dtype)
    layers, grads, bufs, off = [], [], [], 0
    for _ in range(2):
        bufs.append(torch.full((c, sum(sizes) + extra), 7.0, dtype=dtype))
    views = [[], []]
    for i in range(len(dims) - 1):
        o, k = dims[i + 1], dims[i]
        layers.append((theta[:, off:off + o * k].view(c, o, k), theta[:, off + o * k:off + o * k + o]))
        for v, buf in zip(views, bufs):
            v.append((buf[:, off:off + o * k].view(c, o, k), buf[:, off + o * k:off + o * k + o]))
        off += o * k + o
    feats = torch.randn(c, n, dims[0], generator=g, dtype=dtype).abs_()  # (a pooled ReLU output, none 0)
    y = torch.randint(0, dims[-1], (c, n), generator=g)
    w = torch.rand(c, n, generator=g, dtype=dtype)
    return feats, y, w, layers, views, bufs


@pytest.mark.parametrize("dims", [(400, 120, 84, 10), (320, 20, 10), (37, 19, 5), (16, 3), (1, 1, 2), (70, 33, 17, 12)])
@pytest.mark.parametrize("c, n", [(3, 20), (1, 1), (2, 7), (4, 21)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_grad_equals_the_reference(dims, c, n, dtype):
    """The dense layers' forward and backward (``csrc/cpu/cnn_dense.cpp``) against the torch
    reference: odd widths (vector tails), rows and outputs past the register blocks, one row, the
    models a theta row apart; the gradients written into their rows only, the features' gradient."""
    feats, y, w, layers, (g_nat, g_ref), (buf_nat, buf_ref) = _dense_case(c, n, dims, dtype, seed=sum(dims) + c * n)
    d_nat, d_ref = torch.full_like(feats, 7.0), torch.full_like(feats, 7.0)
    NATIVE.dense_grad(feats, y, w, layers, g_nat, d_nat)
    REF.dense_grad(feats, y, w, layers, g_ref, d_ref)
    torch.testing.assert_close(buf_nat, buf_ref, **TOL[dtype])
    torch.testing.assert_close(d_nat, d_ref, **TOL[dtype])
    assert bool((buf_nat[:, -3:] == 7.0).all()), "a gradient row was written past its layers"
    assert float(buf_ref[:, :-3].abs().max()) > 0  # (the last bias gradient: softmax − onehot, never 0)


def test_dense_grad_refuses_labels_past_the_classes():
    """The native kernel indexes the logits by the labels: one outside [0, classes) is a
    ValueError before anything is written."""
    feats, y, w, layers, (grads, _), (buf, _) = _dense_case(2, 3, (20, 7, 4), torch.float32, seed=5)
    dfeats = torch.full_like(feats, 7.0)
    for bad in (4, -1):
        y2 = y.clone()
        y2[1, 2] = bad
        with pytest.raises(ValueError, match=r"^cnn_dense_grad: expected labels in \[0, classes\)"):
            NATIVE.dense_grad(feats, y2, w, layers, grads, dfeats)
    assert bool((buf == 7.0).all()) and bool((dfeats == 7.0).all())


@pytest.mark.parametrize("dims", [(400, 120, 84, 10), (37, 19, 5), (16, 3), (70, 33, 17, 12)])
@pytest.mark.parametrize("c, n", [(3, 20), (1, 1), (4, 21)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_logits_equal_the_reference_and_the_gradients_forward(dims, c, n, dtype):
    """The dense layers' forward alone (evaluate's) against the reference."""
    feats, _, _, layers, _, _ = _dense_case(c, n, dims, dtype, seed=sum(dims) + 3 * c * n)
    got = NATIVE.dense_logits(feats, layers)
    assert got.shape == (c, n, dims[-1])
    torch.testing.assert_close(got, REF.dense_logits(feats, layers), **TOL[dtype])


def test_dense_layers_native_only_on_wide_vector_levels():
    """A chunk's dense layers take the native kernels on the avx2 and avx512 levels (faster than
    torch's bmm there) and torch's bmm on the baseline level (128-bit vectors: slower)."""
    from pflcore import backend
    chosen = cnn_native._dense_ops(NATIVE)
    assert (chosen is NATIVE) == (backend.cpu_capability() in ("avx2", "avx512"))
    assert cnn_native._dense_ops(REF) is REF


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_layers_with_separate_tensors(dtype):
    """Each weight, bias and gradient tensor its own model stride (separate tensors, not rows of
    one theta): the kernels take every tensor's stride."""
    g = _gen(3)
    c, n, dims = 3, 5, (23, 9, 4)
    layers = [(torch.randn(c, dims[i + 1], dims[i], generator=g, dtype=dtype),
               torch.randn(c, dims[i + 1] + 2, generator=g, dtype=dtype)[:, 1:1 + dims[i + 1]]) for i in range(2)]
    feats = torch.randn(c, n, dims[0], generator=g, dtype=dtype).abs_()
    y = torch.randint(0, dims[-1], (c, n), generator=g)
    w = torch.rand(c, n, generator=g, dtype=dtype)
    outs = []
    for ops in (NATIVE, REF):
        grads = [(torch.zeros(c, dims[i + 1], dims[i], dtype=dtype), torch.zeros(c, 5, dims[i + 1], dtype=dtype)[:, 2])
                 for i in range(2)]
        dfeats = torch.empty_like(feats)
        ops.dense_grad(feats, y, w, layers, grads, dfeats)
        outs.append((grads, dfeats, ops.dense_logits(feats, layers)))
    (g_n, d_n, z_n), (g_r, d_r, z_r) = outs
    for (a, b), (c_, d) in zip(g_n, g_r):
        torch.testing.assert_close(a, c_, **TOL[dtype])
        torch.testing.assert_close(b, d, **TOL[dtype])
    torch.testing.assert_close(d_n, d_r, **TOL[dtype])
    torch.testing.assert_close(z_n, z_r, **TOL[dtype])
