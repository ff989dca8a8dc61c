"""Researchers' data files (issue 27, item 4): LEAF's JSON (pflcore/data/leaf_json.py, read a
user at a time by pflcore/data/json_stream.py) and CIFAR-10's python pickles
(pflcore/data/cifar.py, unpickled by pflcore/data/safe_pickle.py), on small files the tests
write in the layouts of the official code: pFedMe's Synthetic and CIFAR-10 JSON, LEAF's FEMNIST
and Shakespeare splits, and the Python 2 pickles of the CIFAR-10 download."""
from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct
import tracemalloc

import numpy as np
import pytest
import torch

from pflcore import data, experiments
from pflcore.data import json_stream, leaf_json, safe_pickle
from pflcore.experiment_config import ConfigError


def _assert_same(a, b):
    """Two federations with the same users, order, bits of the features and labels."""
    for name in ("train", "test"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.x.dtype == y.x.dtype
        assert torch.equal(x.x.view(torch.uint8), y.x.view(torch.uint8)), name  # the bits
        assert torch.equal(x.y, y.y) and torch.equal(x.offsets, y.offsets), name
    assert a.num_classes == b.num_classes
    assert a.meta.get("users") == b.meta.get("users")


# ----------------------------------------------------------------------------- pFedMe's Synthetic

def _pfedme_synthetic(root, num_users=12, seed=0):
    """data/Synthetic/data/{train,test}/my*.json the way pFedMe's generate_synthetic_05_05.py
    writes them: one file per split, keys in the order users, user_data, num_samples, user ids
    f_00000…, x lists of float64 values, y labels written as floats (yy = np.zeros(n); 3.0),
    each user's samples shuffled and split 90/10."""
    rng = np.random.default_rng(seed)
    random.seed(seed)
    train = {"users": [], "user_data": {}, "num_samples": []}
    test = {"users": [], "user_data": {}, "num_samples": []}
    expected = []
    for i in range(num_users):
        n = int(rng.integers(11, 40))
        X = rng.normal(rng.normal(0, 1), 1.0, (n, 60)).tolist()
        y = rng.integers(0, 10, n).astype(np.float64).tolist()
        uname = "f_{0:05d}".format(i)
        combined = list(zip(X, y))
        random.shuffle(combined)
        X[:], y[:] = zip(*combined)
        train_len = int(0.9 * n)
        for split, lo, hi in ((train, 0, train_len), (test, train_len, n)):
            split["users"].append(uname)
            split["user_data"][uname] = {"x": list(X[lo:hi]), "y": list(y[lo:hi])}
            split["num_samples"].append(hi - lo)
        expected.append((uname, X, y, train_len))
    base = root / "Synthetic" / "data"
    for split, name, content in (("train", "mytrain.json", train), ("test", "mytest.json", test)):
        (base / split).mkdir(parents=True)
        with open(base / split / name, "w") as fh:
            json.dump(content, fh)
    return expected


def test_leaf_reads_pfedme_synthetic_layout_and_round_trips(tmp_path):
    expected = _pfedme_synthetic(tmp_path)
    text = (tmp_path / "Synthetic/data/train/mytrain.json").read_text()
    assert text.index('"users"') < text.index('"user_data"') < text.index('"num_samples"')  # pFedMe's key order
    fed = data.leaf(tmp_path / "Synthetic")  # <dataset>, whose data/ holds train/ and test/
    assert fed.num_clients == len(expected) and fed.meta["users"] == [e[0] for e in expected]
    assert fed.train.x.dtype == torch.float32 and fed.train.y.dtype == torch.int64
    labels = set()
    for i, (uname, X, y, k) in enumerate(expected):
        for part, lo, hi in ((fed.train, 0, k), (fed.test, k, len(y))):
            xi, yi = part.client(i)
            assert torch.equal(xi, torch.tensor(X[lo:hi], dtype=torch.float64).to(torch.float32))
            assert yi.tolist() == [int(v) for v in y[lo:hi]]
            labels |= set(yi.tolist())
    assert fed.num_classes == max(labels) + 1 and fed.meta["image_shape"] is None
    assert torch.equal(data.leaf(tmp_path / "Synthetic" / "data").train.x, fed.train.x)  # data/ itself

    written = data.to_leaf(fed, tmp_path / "copy")
    assert [os.path.basename(p) for p in written["train"]] == ["data_0_train.json"]
    back = data.leaf(tmp_path / "copy")
    _assert_same(fed, back)
    # What pFedMe's read_data does with a folder: json.load every file, users and user_data.
    plain = json.load(open(written["train"][0]))
    assert plain["users"] == fed.meta["users"] and plain["num_samples"] == fed.train.sizes.tolist()
    assert plain["user_data"]["f_00003"]["y"] == fed.train.client(3)[1].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_to_leaf_round_trips_a_generated_federation_bitwise(tmp_path, dtype):
    fed = data.synthetic(0.5, 0.5, num_clients=9, dim=7, num_classes=4, size_scale=1, max_size=30, seed=3,
                         dtype=dtype)
    files = data.to_leaf(fed, tmp_path, users_per_file=4)
    assert [os.path.basename(p) for p in files["test"]] == ["data_0_test.json", "data_1_test.json",
                                                             "data_2_test.json"]
    back = data.leaf(tmp_path, dtype=dtype)
    assert back.meta["users"] == [f"f_{i:05d}" for i in range(9)]
    fed.meta["users"] = back.meta["users"]
    _assert_same(fed, back)
    assert torch.equal(back.weights, fed.weights)
    with pytest.raises(ValueError, match="already holds LEAF files.*overwrite=True"):
        data.to_leaf(fed, tmp_path)
    data.to_leaf(fed, tmp_path, overwrite=True)  # one file per split now: the four old files are gone
    assert sorted(os.listdir(tmp_path / "train")) == ["data_0_train.json"]
    _assert_same(fed, data.leaf(tmp_path, dtype=dtype))


def test_to_leaf_refuses_what_leaf_cannot_hold(tmp_path):
    fed = data.least_squares(num_clients=3, samples_per_client=6, dim=2)
    with pytest.raises(ValueError, match="float targets"):
        data.to_leaf(fed, tmp_path)
    whole = data.synthetic(0.5, 0.5, num_clients=4, dim=3, size_scale=1, max_size=10)
    with pytest.raises(ValueError, match="shard"):
        data.to_leaf(whole.shard(0, 2), tmp_path)
    with pytest.raises(ValueError, match="users_per_file"):
        data.to_leaf(whole, tmp_path, users_per_file=0)


# ----------------------------------------------------------------------------- LEAF's own layouts

def _write_leaf(path, users, user_data, *, num_samples=True, hierarchies=None, order=None):
    content = {"users": users}
    if num_samples:
        content["num_samples"] = [len(user_data[str(u)]["y"]) for u in users]
    if hierarchies is not None:
        content["hierarchies"] = hierarchies
    content["user_data"] = user_data
    if order:
        content = {k: content[k] for k in order}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


def _femnist(root, rng):
    """FEMNIST's split: several files per split, named as LEAF's split_data.py names them, rows
    of 784 pixels in [0, 1], integer labels of 62 classes; a user's test rows in a test file of
    another number than its train file."""
    users = [f"f{k:04d}_{k % 7:02d}" for k in range(7)]
    rows = {u: rng.integers(0, 256, (int(rng.integers(2, 6)), 784)) / 255 for u in users}
    labels = {u: rng.integers(0, 62, rows[u].shape[0]).tolist() for u in users}
    cut = {u: rows[u].shape[0] - 1 for u in users}
    train_files = {2: users[0:3], 10: users[3:5], 1: users[5:7]}  # natural order: 1, 2, 10
    test_files = {0: users[4:], 3: users[:4]}
    for number, group in train_files.items():
        _write_leaf(root / "train" / f"all_data_{number}_niid_0_keep_0_train_9.json", group,
                    {u: {"x": rows[u][:cut[u]].tolist(), "y": labels[u][:cut[u]]} for u in group},
                    hierarchies=[f"writer_{u}" for u in group])
    for number, group in test_files.items():
        _write_leaf(root / "test" / f"all_data_{number}_niid_0_keep_0_test_9.json", group,
                    {u: {"x": rows[u][cut[u]:].tolist(), "y": labels[u][cut[u]:]} for u in group})
    order = users[5:7] + users[0:3] + users[3:5]
    return order, rows, labels, cut


def test_leaf_reads_femnist_style_splits_in_file_order(tmp_path, monkeypatch):
    order, rows, labels, cut = _femnist(tmp_path, np.random.default_rng(1))
    fed = data.leaf(tmp_path)
    assert fed.meta["users"] == order
    assert fed.meta["image_shape"] == [1, 28, 28] and fed.num_features == 784
    assert fed.meta["hierarchies"] == [f"writer_{u}" for u in order]
    assert [os.path.basename(p) for p in fed.meta["train_files"]] == [
        f"all_data_{k}_niid_0_keep_0_train_9.json" for k in (1, 2, 10)]
    for i, u in enumerate(order):
        assert torch.equal(fed.train.client(i)[0], torch.from_numpy(rows[u][:cut[u]]).float())
        assert fed.test.client(i)[1].tolist() == labels[u][cut[u]:]
    assert fed.num_classes == max(max(v) for v in labels.values()) + 1
    assert data.leaf(tmp_path, num_classes=62).num_classes == 62
    with pytest.raises(ValueError, match="num_classes: expected an integer > "):
        data.leaf(tmp_path, num_classes=2)
    with pytest.raises(ValueError, match="num_classes: expected None or an integer >= 1, got True"):
        data.leaf(tmp_path, num_classes=True)
    with pytest.raises(ValueError, match=r"image_shape: expected \(channels, height, width\)"):
        data.leaf(tmp_path, image_shape=(1, 28, 28, 1))
    # Explicit file lists; the same federation whatever the reading window (values cut apart).
    train = sorted((tmp_path / "train").iterdir(), key=lambda p: leaf_json._natural(p.name))
    monkeypatch.setattr(leaf_json, "READ_CHUNK", 5)
    small = data.leaf((train, tmp_path / "test"))
    _assert_same(fed, small)
    # Round trip keeps the hierarchies, the image shape and the number of classes.
    monkeypatch.setattr(leaf_json, "READ_CHUNK", json_stream.DEFAULT_CHUNK)
    data.to_leaf(small, tmp_path / "copy", users_per_file=3)
    back = data.leaf(tmp_path / "copy")
    _assert_same(fed, back)
    assert back.meta["hierarchies"] == fed.meta["hierarchies"] and back.meta["image_shape"] == [1, 28, 28]


def test_leaf_reads_pfedme_cifar_json_with_integer_users_and_nested_images(tmp_path):
    """pFedMe's CIFAR-10 script lists integer user ids (json.dump turns the user_data keys into
    "0", "1" …) and writes each row as the nested [3][32][32] lists of a tensor (2×2 here)."""
    rng = np.random.default_rng(2)
    users = [0, 1, 2]
    imgs = {u: rng.random((3 + u, 3, 2, 2)) for u in users}
    for split, sl in (("train", slice(0, 2)), ("test", slice(2, None))):
        _write_leaf(tmp_path / split / f"cifa_{split}_100.json", users,
                    {str(u): {"x": imgs[u][sl].tolist(), "y": [float(u)] * len(imgs[u][sl])} for u in users},
                    order=("users", "user_data", "num_samples"))
    fed = data.leaf(tmp_path)
    assert fed.meta["users"] == ["0", "1", "2"] and fed.meta["image_shape"] == [3, 2, 2]
    assert torch.equal(fed.test.client(2)[0], torch.from_numpy(imgs[2][2:].reshape(3, 12)).float())
    with pytest.raises(ValueError, match=r"image_shape: expected a shape of 12 values"):
        data.leaf(tmp_path, image_shape=(3, 3, 3))
    assert data.leaf(tmp_path, image_shape=(1, 3, 4)).meta["image_shape"] == [1, 3, 4]


def test_leaf_maps_shakespeare_characters_to_leaf_letter_indices(tmp_path):
    lines = {"THE_TEMPEST_ARIEL": "Full fathom five thy father lies; ", "HAMLET_HAMLET": "To be, or not to be: that"}
    for split in ("train", "test"):
        ud = {u: {"x": [s[k:k + 8] for k in range(3)], "y": [s[k + 8] for k in range(3)]} for u, s in lines.items()}
        _write_leaf(tmp_path / split / f"all_data_niid_0_keep_0_{split}_9.json", list(lines), ud)
    fed = data.leaf(tmp_path)
    letters = leaf_json.LEAF_LETTERS
    assert len(letters) == 80 and fed.num_classes == 80 and fed.num_features == 8
    x0, y0 = fed.train.client(0)
    assert x0[1].tolist() == [float(letters.index(c)) for c in "ull fath"]
    assert y0.tolist() == [letters.index(c) for c in "hom"]
    lines["HAMLET_HAMLET"] = "To bé, or not to be: tha"
    ud = {u: {"x": [s[k:k + 8] for k in range(3)], "y": [s[k + 8] for k in range(3)]} for u, s in lines.items()}
    _write_leaf(tmp_path / "test" / "all_data_niid_0_keep_0_test_9.json", list(lines), ud)
    with pytest.raises(ValueError, match=r"test_9\.json: user 'HAMLET_HAMLET': x: character 'é' .* LEAF_LETTERS"):
        data.leaf(tmp_path)


def _two_users(root, train_y=((0, 1), (2,)), test_y=((1,), (0,)), width=3, **kw):
    for split, ys in (("train", train_y), ("test", test_y)):
        ud = {f"u{i}": {"x": [[0.5] * width for _ in y], "y": list(y)} for i, y in enumerate(ys)}
        _write_leaf(root / split / "d.json", list(ud), ud, **kw)


@pytest.mark.parametrize("case, match", [
    (dict(train_y=((0, 1.5), (2,))), r"train/d\.json: user 'u0': y: label 1 is 1\.5, not an integer class label"),
    (dict(test_y=((1,), (-2,))), r"test/d\.json: user 'u1': y: label 0 is -2; class labels must be >= 0"),
    (dict(train_y=((0, "a"), (1,))), r"user 'u0': y: expected one integer class label per row, got strings"),
    (dict(train_y=((0, True), (1,))), r"user 'u0': y: expected numbers, got true"),
    (dict(test_y=((1,),)), r"user 'u1' is in the train split .* but not in the test files.*drop_incomplete=True"),
])
def test_leaf_labels_and_users_are_checked(tmp_path, case, match):
    _two_users(tmp_path, **case)
    with pytest.raises(ValueError, match=match):
        data.leaf(tmp_path)


def test_leaf_drop_incomplete_leaves_out_users_without_test_rows(tmp_path):
    _two_users(tmp_path, train_y=((0, 1), (2,), (3,)), test_y=((1,), (0,)))
    fed = data.leaf(tmp_path, drop_incomplete=True)
    assert fed.meta["users"] == ["u0", "u1"] and fed.meta["dropped_users"] == ["u2"] and fed.num_classes == 3


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c["user_data"]["u0"]["x"].append([1.0, 2.0]), r"user 'u0': x: rows of unequal lengths"),
    (lambda c: c["user_data"]["u1"].update(x=[[1.0, 2.0]]), r"user 'u1': x: expected rows of 3 values like .*'u0'"),
    (lambda c: c["user_data"]["u0"]["x"][0].__setitem__(1, None), r"user 'u0': x: expected numbers"),
    (lambda c: c["user_data"]["u0"]["x"][0].__setitem__(1, False), r"user 'u0': x: expected numbers, got false"),
    (lambda c: c["user_data"]["u0"]["x"][0].__setitem__(1, float("nan")), r"user 'u0': x: row 0, value 1 is nan"),
    (lambda c: c["user_data"]["u0"]["x"][0].__setitem__(1, 1e300), r"not a finite float32"),
    (lambda c: c["user_data"]["u0"].update(x=[["1", "2009", "NO_QUERY", "bob", "hi"]] * 2),
     r"user 'u0': x: holds text \(such as Sent140"),
    (lambda c: c["num_samples"].__setitem__(0, 5), r"user 'u0': num_samples says 5, user_data holds 2 rows"),
    (lambda c: c["users"].append("ghost"), r"user 'ghost' is in users but not in user_data"),
    (lambda c: c.pop("user_data"), r"no 'user_data' member"),
    (lambda c: c["user_data"].update(u1=[1, 2]), r"user 'u1': expected an object with 'x' and 'y'"),
])
def test_leaf_file_contents_are_checked(tmp_path, mutate, match):
    _two_users(tmp_path)
    path = tmp_path / "train" / "d.json"
    content = json.loads(path.read_text())
    mutate(content)
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        data.leaf(tmp_path)


def test_leaf_reports_malformed_files_and_missing_folders(tmp_path):
    _two_users(tmp_path)
    path = tmp_path / "train" / "d.json"
    good = path.read_text()
    path.write_text(good[:-30])  # truncated, as by an interrupted download
    with pytest.raises(ValueError, match=r"train/d\.json: not valid JSON: .* at line 1, char"):
        data.leaf(tmp_path)
    path.write_text(good.replace("]]", "]\n]", 1).replace(",", ",,", 3))
    with pytest.raises(ValueError, match=r"train/d\.json: not valid JSON"):
        data.leaf(tmp_path)
    path.write_text(good + "\n[]")
    with pytest.raises(ValueError, match=r"unexpected text after the end of the document at line 2"):
        data.leaf(tmp_path)
    path.write_text(good)
    (tmp_path / "train" / "d2.json").write_text(good)
    with pytest.raises(ValueError, match=r"d2?\.json: user 'u0' is also in .*\.json \(of the same split\)"):
        data.leaf(tmp_path)
    (tmp_path / "train" / "d2.json").unlink()
    with pytest.raises(FileNotFoundError, match="root: no folder"):
        data.leaf(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no train/ and test/ folders"):
        data.leaf(tmp_path / "train")
    with pytest.raises(ValueError, match=r"root: expected a folder or a pair \(train_files, test_files\)"):
        data.leaf(3)
    with pytest.raises(FileNotFoundError, match=r"root\[1\] \(test files\): no file or folder"):
        data.leaf((path, tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="dtype: expected torch.float32 or torch.float64"):
        data.leaf(tmp_path, dtype=torch.int32)


@pytest.mark.parametrize("ascii_only", [False, True])
def test_json_stream_decodes_values_cut_at_every_place(ascii_only):
    doc = {"a": [1, -2.5e-3, 12345678901234567890, "x\"}{,:\\u00e9 \\n", -0.0, float("-inf"), False, None],
           "b": {"c": {"d": [[], {}]}, "e": None}, "f": "é€𝄞\t", "g": 1e308, "h": True}
    text = json.dumps(doc, indent=1, ensure_ascii=ascii_only)
    for chunk in (1, 2, 3, 5, 7, 64):
        stream = json_stream.JsonStream(io.StringIO(text), "doc.json", chunk)
        got = {}
        for key in stream.members():
            if key == "b":
                got[key] = {}
                for inner in stream.members():
                    got[key][inner] = stream.value()
            elif key == "a":
                got[key] = []
                for _ in stream.elements():
                    got[key].append(stream.value())
            else:
                got[key] = stream.value()
        stream.end()
        assert got == doc, chunk


def test_json_stream_reports_an_error_without_reading_the_rest():
    class Counting(io.StringIO):
        def read(self, n=-1):
            out = super().read(n)
            self.chars = getattr(self, "chars", 0) + len(out)
            return out

    fh = Counting('{"a": [1, 2,, 3], "b": "' + "x" * 100_000 + '"}')
    stream = json_stream.JsonStream(fh, "bad.json", 64)
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON: Expecting value at line 1, char 12"):
        for _ in stream.members():
            stream.value()
    assert fh.chars < 1000


def test_leaf_reads_a_user_at_a_time(tmp_path):
    """The reading peak (tracemalloc: Python objects, numpy arrays, the text window) stays below
    the file's size, where json.load holds the text and a 32-byte Python float per value, about
    twice to three times the file."""
    rng = np.random.default_rng(4)
    for split, n in (("train", 24), ("test", 6)):
        ud = {f"u{i}": {"x": rng.random((n, 50)).tolist(), "y": rng.integers(0, 10, n).tolist()} for i in range(100)}
        _write_leaf(tmp_path / split / "big.json", list(ud), ud)
    size = sum(os.path.getsize(tmp_path / s / "big.json") for s in ("train", "test"))
    assert size > 2.5e6
    tracemalloc.start()
    try:
        fed = data.leaf(tmp_path)
        _, leaf_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with open(tmp_path / "train" / "big.json") as fh:
            whole = json.load(fh)
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert fed.train.num_rows == 2400 and len(whole["users"]) == 100
    train_size = os.path.getsize(tmp_path / "train" / "big.json")
    assert load_peak > 1.8 * train_size  # what streaming saves
    print(f"peak: leaf {leaf_peak / size:.2f} x the files, json.load {load_peak / train_size:.2f} x its file")
    assert leaf_peak < 0.9 * size, (leaf_peak, size)


# ----------------------------------------------------------------------------- CIFAR-10 pickles

def _py2_pickle(images: np.ndarray, labels, batch_label: bytes) -> bytes:
    """A CIFAR-10 batch as the original files hold it: cPickle protocol 2 of Python 2, a dict of
    Python 2 strings (SHORT_BINSTRING/BINSTRING) whose b'data' is a numpy array pickled through
    numpy.core.multiarray._reconstruct, numpy.ndarray and numpy.dtype('u1')."""
    def s(b: bytes) -> bytes:
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b

    def i(v: int) -> bytes:
        if v < 256:
            return b"K" + bytes([v])
        return b"M" + struct.pack("<H", v) if v < 65536 else b"J" + struct.pack("<i", v)

    n = images.shape[0]
    return b"".join([
        b"\x80\x02}q\x01(", s(b"data"), b"q\x02cnumpy.core.multiarray\n_reconstruct\nq\x03cnumpy\nndarray\nq\x04",
        i(0), b"\x85", s(b"b"), b"\x87Rq\x05(", i(1), i(n), i(3072), b"\x86cnumpy\ndtype\nq\x06", s(b"u1"), i(0), i(1),
        b"\x87Rq\x07(", i(3), s(b"|"), b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xff", i(0), b"tb\x89", s(images.tobytes()),
        b"tb", s(b"labels"), b"](", *[i(int(v)) for v in labels], b"e", s(b"batch_label"), s(batch_label),
        s(b"filenames"), b"](", *[s(f"img_{k}.png".encode()) for k in range(n)], b"eu."])


def _cifar_folder(root, per_batch=12, seed=0):
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    images, labels = [], []
    for k, name in enumerate([f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]):
        x = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = (np.arange(per_batch) + k) % 10
        (folder / name).write_bytes(_py2_pickle(x, y, f"batch {k}".encode()))
        images.append(x)
        labels.append(y)
    return folder, np.concatenate(images), np.concatenate(labels)


def test_the_python2_batch_writer_matches_numpys_own_unpickling(tmp_path):
    x = np.random.default_rng(1).integers(0, 256, (3, 3072), dtype=np.uint8)
    raw = _py2_pickle(x, [1, 2, 3], b"b")
    stock = pickle.loads(raw, encoding="latin1")  # how torchvision reads the files (numpy's own code)
    assert np.array_equal(stock["data"], x) and stock["labels"] == [1, 2, 3]
    (tmp_path / "b").write_bytes(raw)
    mine = safe_pickle.load(tmp_path / "b")
    assert np.array_equal(mine[b"data"], x) and mine[b"labels"] == [1, 2, 3] and mine[b"batch_label"] == b"b"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cifar10_reads_the_python_batches(tmp_path, dtype):
    folder, images, labels = _cifar_folder(tmp_path)
    x, y = data.read_cifar10(tmp_path)
    assert np.array_equal(x, images) and np.array_equal(y, labels)
    assert np.array_equal(data.read_cifar10(folder, files="test")[0], images[-12:])
    fed = data.cifar10(tmp_path, num_clients=4, scheme="iid", seed=1, dtype=dtype)
    assert fed.num_features == 3072 and fed.num_classes == 10 and fed.meta["image_shape"] == [3, 32, 32]
    assert fed.train.x.dtype == dtype and fed.train.num_rows + fed.test.num_rows == 72
    # Every row is one image / 255 (the same bits as float64 division rounded to the dtype).
    scaled = torch.from_numpy(images.astype(np.float64) / 255.0).to(dtype)
    rows = {r.numpy().tobytes() for r in scaled}
    assert all(r.numpy().tobytes() in rows for r in torch.cat([fed.train.x, fed.test.x]))
    same = data.cifar10(folder, num_clients=4, scheme="iid", seed=1, dtype=dtype)  # the batch folder itself
    assert torch.equal(same.train.x, fed.train.x) and torch.equal(same.test.y, fed.test.y)
    for scheme, kw in (("classes", dict(classes_per_client=2)), ("dirichlet", dict(alpha=1.0)), ("shards", {})):
        part = data.cifar10(tmp_path, num_clients=5, scheme=scheme, files="train", **kw)
        assert part.num_clients == 5 and part.train.num_rows + part.test.num_rows == 60


def test_float32_division_of_pixels_equals_float64_division_rounded():
    pixels = np.arange(256, dtype=np.uint8)
    assert np.array_equal(np.divide(pixels, np.float32(255), dtype=np.float32),
                          (pixels / 255.0).astype(np.float32))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_reads_batches_pickled_by_python3(tmp_path, protocol):
    rng = np.random.default_rng(protocol)
    x = rng.integers(0, 256, (5, 3072), dtype=np.uint8)
    batch = {b"data": x, "labels": np.arange(5, dtype=np.int64), b"batch_label": b"re-pickled"}
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch, protocol=protocol))
    got_x, got_y = data.read_cifar10(tmp_path, files="test")
    assert np.array_equal(got_x, x) and got_y.tolist() == [0, 1, 2, 3, 4]


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_cifar10_unpickling_runs_no_code(tmp_path):
    marker = tmp_path / "owned"
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": _Payload(marker), b"labels": [0]}, protocol=2))
    refused = r"test_batch: not a readable data pickle .*refused to load (posix|nt)\.system"
    with pytest.raises(ValueError, match=refused):
        data.read_cifar10(tmp_path, files="test")
    assert not marker.exists()
    assert os.system is not None  # (the payload is real: pickle.loads would have run it)
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": np.array([object()] * 3072).reshape(1, 3072),
                                                        b"labels": [0]}))
    with pytest.raises(ValueError, match=r"dtype 'O8' refused"):
        data.read_cifar10(tmp_path, files="test")
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]})[:-40])
    with pytest.raises(ValueError, match=r"test_batch: not a readable data pickle"):
        data.read_cifar10(tmp_path, files="test")
    (tmp_path / "test_batch").write_bytes(b"\x80\x02T\xff\xff\xff\x7fabc")  # claims a 2 GB string: no allocation
    with pytest.raises(ValueError, match=r"test_batch: not a readable data pickle .*truncated"):
        data.read_cifar10(tmp_path, files="test")


def test_cifar10_reports_missing_and_wrong_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"root: no CIFAR-10 batch .*cifar-10-python\.tar\.gz"):
        data.cifar10(tmp_path)
    folder, _, _ = _cifar_folder(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks the CIFAR-10 batch 'data_batch_3'"):
        data.cifar10(tmp_path)
    assert data.read_cifar10(tmp_path, files="test")[0].shape == (12, 3072)
    bad = {"wrong shape": ({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}, r"data: expected uint8"),
           "label 10": ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"expected classes 0\.\.9"),
           "cifar-100": ({b"data": np.zeros((1, 3072), np.uint8), b"fine_labels": [3]}, r"CIFAR-100"),
           "count": ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}, r"expected 2 integer labels")}
    for batch, match in bad.values():
        (folder / "test_batch").write_bytes(pickle.dumps(batch))
        with pytest.raises(ValueError, match=match):
            data.read_cifar10(tmp_path, files="test")
    with pytest.raises(ValueError, match="files: expected 'all', 'train' or 'test'"):
        data.read_cifar10(tmp_path, files="val")


# ----------------------------------------------------------------------------- experiment files

def test_experiments_name_leaf_and_cifar10_with_a_root(tmp_path):
    _pfedme_synthetic(tmp_path, num_users=5)
    cfg = {"rounds": 1, "data": {"generator": "leaf", "root": str(tmp_path / "Synthetic")},
           "algorithms": {"LocalTrain": {"lr": 0.1, "steps": 2}}}
    experiments.check(cfg)
    fed = experiments.build_federation(cfg["data"], seed=3)  # no seed passed to leaf
    assert fed.num_clients == 5 and fed.meta["generator"] == "leaf"
    with pytest.raises(ConfigError, match=r"data\.root: missing; the leaf generator needs root"):
        experiments.check(dict(cfg, data={"generator": "leaf"}))
    with pytest.raises(ConfigError, match=r"unknown key 'data\.seed'"):
        experiments.check(dict(cfg, data=dict(cfg["data"], seed=1)))
    with pytest.raises(ConfigError, match=r"data\.drop_incomplete: expected true or false"):
        experiments.check(dict(cfg, data=dict(cfg["data"], drop_incomplete=1)))
    with pytest.raises(ConfigError, match=r"^data: root: no folder"):
        experiments.build_federation({"generator": "leaf", "root": str(tmp_path / "none")}, 0)

    _cifar_folder(tmp_path)
    spec = {"generator": "cifar10", "root": str(tmp_path), "num_clients": 3, "scheme": "iid"}
    experiments.check(dict(cfg, data=spec, model={"family": "cnn", "channels": [2], "hidden": [4]}))
    fed = experiments.build_federation(spec, seed=2)
    assert fed.meta["seed"] == 2
    model = experiments.build_model({"family": "cnn", "channels": [2], "hidden": [4]}, fed)
    assert model.image_shape == (3, 32, 32)
    with pytest.raises(ConfigError, match=r"data\.root: missing; the cifar10 generator needs root"):
        experiments.check(dict(cfg, data={"generator": "cifar10"}))

