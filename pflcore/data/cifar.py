"""CIFAR-10 from its python batches as a federation (DESIGN.md §6).

The "CIFAR-10 python version" (``cifar-10-python.tar.gz`` from
https://www.cs.toronto.edu/~kriz/cifar.html) unpacks to ``cifar-10-batches-py/`` with the
pickles ``data_batch_1`` … ``data_batch_5`` (50,000 training images) and ``test_batch``
(10,000), each a dict with ``b"data"`` (uint8 ``[10000, 3072]``: the red, then green, then blue
32×32 plane of each image, row-major) and ``b"labels"`` (10,000 ints 0..9). They are unpickled
with ``safe_pickle`` (no code in a file is run).

``cifar10(root)`` scales the pixels to [0, 1] (value / 255, computed in the requested dtype:
float32 division of the integers 0..255 rounds exactly as float64 division then rounding does);
the rows keep the planes' order, so ``meta["image_shape"]`` is (3, 32, 32) and
``models.CNN(3072, 10, image_shape=(3, 32, 32))`` reads them as images. No per-channel
standardization: pFedMe's script normalizes to [-1, 1] ((v − 0.5) / 0.5), which is ``2x − 1``
of these features. Clients and their 75/25 train/test split are made as for ``mnist``
(``data.partition``'s schemes, the files' own train/test division not kept).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import torch

from pflcore.data import safe_pickle
from pflcore.data.federation import Federation
from pflcore.data.real import _federate

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_FILES = {"train": tuple(f"data_batch_{k}" for k in range(1, 6)), "test": ("test_batch",)}
CIFAR10_IMAGE_SHAPE = (3, 32, 32)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


def _batch_folder(root) -> str:
    """``root`` itself when it holds the batches, else its ``cifar-10-batches-py``."""
    root = os.fspath(root)
    for folder in (root, os.path.join(root, CIFAR10_FOLDER)):
        if any(os.path.isfile(os.path.join(folder, name)) for names in CIFAR10_FILES.values() for name in names):
            return folder
    raise FileNotFoundError(f"root: no CIFAR-10 batch (data_batch_1 … data_batch_5, test_batch) in {root!r} nor in "
                            f"{os.path.join(root, CIFAR10_FOLDER)!r}. Download {CIFAR10_URL} (the python version), "
                            f"extract it, and pass the folder {CIFAR10_FOLDER} or its parent as root")


def _member(batch: dict, key: str, path: str):
    for k in (key.encode(), key):  # bytes keys as the official (Python 2) files have; str keys also read
        if k in batch:
            return batch[k]
    hint = " (CIFAR-100's batches have 'fine_labels': this reader is for CIFAR-10)" \
        if key == "labels" and (b"fine_labels" in batch or "fine_labels" in batch) else ""
    raise ValueError(f"{path}: no {key!r} in the batch (keys: {sorted(map(repr, batch))}){hint}")


def read_cifar10_batch(path) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 3072], labels int64 [n]) of one CIFAR-10 python batch file; ValueError
    naming the file when it is not one."""
    path = os.fspath(path)
    batch = safe_pickle.load(path)
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a pickled dict with b'data' and b'labels', got {type(batch).__name__}")
    data, labels = _member(batch, "data", path), _member(batch, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{path}: data: expected uint8 images [n, 3072] (3 planes of 32×32), got {got}")
    if isinstance(labels, np.ndarray):
        labels = labels.tolist()
    if not isinstance(labels, (list, tuple)) or len(labels) != data.shape[0] or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        count = len(labels) if isinstance(labels, (list, tuple)) else type(labels).__name__
        raise ValueError(f"{path}: labels: expected {data.shape[0]} integer labels (one per image), got {count}")
    y = np.asarray(labels, dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() > 9):
        bad = int(y[(y < 0) | (y > 9)][0])
        raise ValueError(f"{path}: labels: expected classes 0..9, got {bad}")
    return data, y


def read_cifar10(root, files: str = "all") -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 3072], labels int64 [N]) from the batches in ``root`` (the folder
    ``cifar-10-batches-py`` or its parent): the 50,000 training images (``files="train"``), the
    10,000 test images (``"test"``) or all 60,000 (``"all"``, train first)."""
    if files not in ("all", "train", "test"):
        raise ValueError(f"files: expected 'all', 'train' or 'test', got {files!r}")
    folder = _batch_folder(root)
    names = [n for part in (("train", "test") if files == "all" else (files,)) for n in CIFAR10_FILES[part]]
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise FileNotFoundError(f"root: {folder!r} lacks the CIFAR-10 batch {missing[0]!r} ({len(missing)} of the "
                                f"{len(names)} files for files={files!r} missing); extract {CIFAR10_URL} whole")
    parts = [read_cifar10_batch(os.path.join(folder, n)) for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def cifar10(root, num_clients: int = 20, scheme: str = "classes", *, classes_per_client: int = 2,
            shards_per_client: int = 2, alpha: float = 0.5, sizes: Optional[Tuple[float, float]] = None,
            min_size: int = 2, num_samples: Optional[int] = None, files: str = "all", test_fraction: float = 0.25,
            seed: int = 0, dtype: torch.dtype = torch.float32) -> Federation:
    """CIFAR-10 as a federation of ``num_clients`` clients; features ``x [N, 3072]`` = pixels / 255
    in the batches' order (3 planes of 32×32: ``meta["image_shape"] = [3, 32, 32]``).

    ``root``: the folder ``cifar-10-batches-py`` or its parent; ``files``: "train" (50,000
    images), "test" (10,000) or "all" (60,000, as pFedMe pools them). The other arguments are
    ``mnist``'s: ``data.partition``'s schemes ("classes", "shards", "dirichlet", "iid") and their
    arguments, ``num_samples`` images drawn first, each client's rows split 75/25 into train and
    test (``test_fraction``). pFedMe's CIFAR-10 setting is ``cifar10(root, num_clients=20,
    classes_per_client=3)``.
    """
    if dtype not in _NP_DTYPE:
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype!r}")
    images, labels = read_cifar10(root, files)
    x = np.divide(images, _NP_DTYPE[dtype](255), dtype=_NP_DTYPE[dtype])  # [0, 1], no float64 copy for float32
    del images
    meta = dict(generator="cifar10", root=os.fspath(root), files=files, image_shape=list(CIFAR10_IMAGE_SHAPE),
                source=f"CIFAR-10 python batches in {_batch_folder(root)} ({files})")
    return _federate(x, labels, name=f"cifar10({scheme}, m={num_clients})", meta=meta, num_clients=num_clients,
                     scheme=scheme, classes_per_client=classes_per_client, shards_per_client=shards_per_client,
                     alpha=alpha, sizes=sizes, min_size=min_size, num_samples=num_samples,
                     test_fraction=test_fraction, seed=seed, dtype=dtype)
