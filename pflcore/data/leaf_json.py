"""LEAF's JSON data sets as federations, and federations as LEAF JSON (DESIGN.md §6).

LEAF (Caldas et al.) stores FEMNIST, Shakespeare, Sent140, CelebA, Reddit and its Synthetic
sets as a folder with ``train/`` and ``test/`` JSON files, each an object::

    {"users": [u, ...], "num_samples": [n_u, ...], "user_data": {u: {"x": [row, ...], "y": [label, ...]}},
     "hierarchies": [...]}   # optional, one entry per user

and the official FedProx and pFedMe code write their data the same way (pFedMe's
``data/Synthetic/data/{train,test}/*.json``: one file per split, keys in the order users,
user_data, num_samples, labels written as floats such as 3.0; its CIFAR-10 script writes integer
user ids and 3×32×32 nested rows). A split may span several files, and a user's train and test
rows may sit in files of different names.

``leaf(root)`` reads such a folder (or explicit file lists) into a ``Federation``:

- users in file order: the train files in natural order of their names (``…_2_…`` before
  ``…_10_…``, LEAF's own numbering), each file's users in the order of its ``"users"`` list
  (of ``user_data`` where the list is missing). pFedMe's ``read_data`` sorts the users by name
  instead; its Synthetic users (``f_00000`` …) are in that order anyway.
- features float32 (or ``dtype``), labels int64; a label that is not an integer ≥ 0 is a
  ValueError naming the user and the file.
- every user needs rows in both splits (a Federation's clients all have train and test data):
  a user missing from one split is a ValueError naming it, unless ``drop_incomplete=True``
  leaves such users out (listed in ``meta["dropped_users"]``). LEAF data split by user
  (``--split user``, disjoint train and test users) therefore does not load: split it by
  sample.
- image shape (``meta["image_shape"]``, used by ``models.CNN`` in experiments): the nesting of
  the rows where they are nested (``[3][32][32]``), else ``image_shape=``, else (1, 28, 28) for
  rows of 784 values (FEMNIST, and MNIST as pFedMe writes it), else none.
- text: Shakespeare's rows are 80-character strings and its labels the next character; they are
  mapped to indices in LEAF's own 80-letter table (``LEAF_LETTERS``, as LEAF's
  ``word_to_indices`` / ``letter_to_vec`` do), so ``x`` holds the indices as numbers and
  ``num_classes`` is 80. A character outside the table is a ValueError. Other text (Sent140's
  ``[id, date, query, user, tweet]`` rows, Reddit's token lists) is a ValueError: featurize it
  first.

Memory: the files are read one user at a time (``pflcore.data.json_stream``), each user's rows
converted to the federation's dtype as they are read, and the federation is filled user by user;
the peak is about the federation's own bytes plus the largest user, where ``json.load`` of a
file costs about three times the file.

``to_leaf(fed, folder)`` writes the same layout; ``leaf`` reads it back to the same users in the
same order, bitwise equal features and equal labels.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from pflcore.client_data import ClientData
from pflcore.data.federation import Federation
from pflcore.data.json_stream import DEFAULT_CHUNK, JsonStream
from pflcore._checks import check_positive_int

# LEAF's character table (models/utils/language_utils.py, ALL_LETTERS): Shakespeare's characters
# are indices into it.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
# A top-level member to_leaf adds so that what LEAF has no place for (the number of classes, the
# image shape) survives a round trip; LEAF's, FedProx's and pFedMe's readers ignore other keys.
PFLCORE_KEY = "pflcore"
READ_CHUNK = DEFAULT_CHUNK  # characters read at a time (tests make it tiny to cut values apart)
_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}
_LETTER_INDEX = np.full(128, -1, dtype=np.int64)  # code point -> index in LEAF_LETTERS (all ASCII)
_LETTER_INDEX[[ord(c) for c in LEAF_LETTERS]] = np.arange(len(LEAF_LETTERS))
MNIST_ROW = 784  # 28×28: FEMNIST's rows and pFedMe's MNIST rows


# ----------------------------------------------------------------------------- files

def _natural(name: str):
    """Sort key: digit runs compared as numbers (all_data_2 before all_data_10)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def _json_files(folder: str) -> List[str]:
    names = sorted((n for n in os.listdir(folder) if n.endswith(".json")), key=_natural)
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


def _locate(root) -> Tuple[List[str], List[str], Optional[str]]:
    """(train files, test files, root folder or None) from ``root``: a folder, or a pair."""
    if isinstance(root, (str, os.PathLike)):
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"root: no folder {root!r}; expected a LEAF data folder holding train/ and test/ "
                                    f"folders of .json files, or a pair (train_files, test_files)")
        for base in (root, os.path.join(root, "data")):  # <dataset>/data/{train,test}: LEAF's and pFedMe's layout
            train, test = os.path.join(base, "train"), os.path.join(base, "test")
            if os.path.isdir(train) and os.path.isdir(test):
                files = _json_files(train), _json_files(test)
                for split, folder, found in (("train", train, files[0]), ("test", test, files[1])):
                    if not found:
                        raise FileNotFoundError(f"root: no .json file in {folder!r} (the {split} split)")
                return files[0], files[1], root
        raise FileNotFoundError(f"root: {root!r} has no train/ and test/ folders (nor data/train and data/test); "
                                f"expected LEAF's layout: <root>/train/*.json and <root>/test/*.json")
    if isinstance(root, (tuple, list)) and len(root) == 2:
        return _file_list(root[0], "root[0] (train files)"), _file_list(root[1], "root[1] (test files)"), None
    raise ValueError(f"root: expected a folder or a pair (train_files, test_files), got {root!r}")


def _file_list(value, name: str) -> List[str]:
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(items, (list, tuple)) or not items or \
            not all(isinstance(v, (str, os.PathLike)) for v in items):
        raise ValueError(f"{name}: expected a path or a non-empty list of paths, got {value!r}")
    files: List[str] = []
    for item in map(os.fspath, items):
        if os.path.isdir(item):
            found = _json_files(item)
            if not found:
                raise FileNotFoundError(f"{name}: no .json file in the folder {item!r}")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise FileNotFoundError(f"{name}: no file or folder {item!r}")
    return files


# ----------------------------------------------------------------------------- one user's rows

def _letters(strings: Sequence, where: str, what: str) -> np.ndarray:
    """Indices in LEAF_LETTERS of the characters of equally long strings: int64 [n, length]."""
    if not all(isinstance(s, str) for s in strings):
        bad = next(s for s in strings if not isinstance(s, str))
        raise ValueError(f"{where}: {what}: expected only strings (text), got also {bad!r}")
    lengths = {len(s) for s in strings}
    if len(lengths) != 1:
        raise ValueError(f"{where}: {what}: expected strings of one length, got lengths {sorted(lengths)[:5]}")
    width = lengths.pop()
    codes = np.frombuffer("".join(strings).encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    ids = np.where(codes < 128, _LETTER_INDEX[np.minimum(codes, 127)], -1)
    if (ids < 0).any():
        k = int(np.argmax(ids < 0))
        raise ValueError(f"{where}: {what}: character {chr(codes[k])!r} (row {k // max(width, 1)}) is not in LEAF's "
                         f"letter table LEAF_LETTERS (80 characters), which pflcore uses to turn text into indices")
    return ids.reshape(len(strings), width)


def _features(x, where: str, npd) -> Tuple[np.ndarray, Optional[tuple], bool]:
    """(rows [n, p] of dtype npd, their image shape if nested, whether they were text)."""
    if not isinstance(x, list):
        raise ValueError(f"{where}: x: expected a list of rows, got {type(x).__name__}")
    if not x:
        return np.empty((0, 0), dtype=npd), None, False
    if isinstance(x[0], str):  # Shakespeare: one string of characters per row
        return _letters(x, where, "x").astype(npd), None, True
    try:
        arr = np.array(x)
    except (ValueError, TypeError, OverflowError):  # numpy refuses ragged nesting
        raise ValueError(f"{where}: x: rows of unequal lengths or nesting; expected every row to hold the same "
                         f"number of values") from None
    kind = arr.dtype.kind
    if kind == "U":
        raise ValueError(f"{where}: x: holds text (such as Sent140's [id, date, query, user, tweet] rows); pflcore "
                         f"reads numeric rows, and Shakespeare's strings of characters: featurize the text first")
    if kind not in "iuf":
        what = {"b": "booleans", "O": "null, nested lists of unequal shape, or numbers beyond int64"}.get(kind, kind)
        raise ValueError(f"{where}: x: expected numbers, got {what}")
    if arr.ndim < 2:
        raise ValueError(f"{where}: x: expected a list of rows (lists of numbers), got a list of single numbers")
    image = tuple(int(s) for s in arr.shape[1:]) if arr.ndim > 2 else None
    with np.errstate(over="ignore", invalid="ignore"):
        rows = arr.reshape(arr.shape[0], -1).astype(npd)
    if not np.isfinite(rows).all():
        r, c = np.argwhere(~np.isfinite(rows))[0]
        value = float(arr.reshape(arr.shape[0], -1)[r, c])
        raise ValueError(f"{where}: x: row {r}, value {c} is {value!r}, not a finite {np.dtype(npd).name}")
    return rows, image, False


def _labels(y, n: int, where: str, text: bool) -> np.ndarray:
    """int64 [n] class labels; float labels must be integral (pFedMe writes 3.0)."""
    if not isinstance(y, list):
        raise ValueError(f"{where}: y: expected a list of labels, got {type(y).__name__}")
    if len(y) != n:
        raise ValueError(f"{where}: y: expected one label for each of the {n} rows of x, got {len(y)} labels")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if text and isinstance(y[0], str):  # Shakespeare: the next character
        return _letters(y, where, "y").reshape(n)
    try:
        arr = np.array(y)
    except (ValueError, TypeError, OverflowError):
        arr = np.array([None])  # falls to the error below
    if arr.shape != (n,) or arr.dtype.kind not in "iuf":
        what = "strings" if arr.dtype.kind == "U" else "lists" if arr.ndim > 1 else "values that are not numbers"
        raise ValueError(f"{where}: y: expected one integer class label per row, got {what}")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr)) | (np.abs(arr) >= 2.0**63)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"{where}: y: label {k} is {y[k]!r}, not an integer class label")
    elif arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{where}: y: label {int(arr.max())} is beyond int64")
    labels = arr.astype(np.int64)
    if labels.min() < 0:
        k = int(np.argmax(labels < 0))
        raise ValueError(f"{where}: y: label {k} is {y[k]!r}; class labels must be >= 0")
    return labels


def _read_record(stream: JsonStream, where: str):
    """A user's ``{"x": [...], "y": [...]}``, its lists decoded element by element (a FEMNIST
    user is megabytes: decoded whole it would be decoded again each time it outgrew the reading
    window); and whether their text holds a literal true or false."""
    if stream.peek() != "{":
        got = stream.value()
        raise ValueError(f"{where}: expected an object with 'x' and 'y', got {type(got).__name__}")
    record: Dict[str, Any] = {}
    literals = False
    for key in stream.members():
        if key in ("x", "y") and stream.peek() == "[":
            items = record[key] = []
            for _ in stream.elements():
                items.append(stream.value())
                literals = literals or stream.last_value_has("true") or stream.last_value_has("false")
        else:
            record[key] = stream.value()  # Shakespeare's "raw" text and anything else: not ours
    if "x" not in record or "y" not in record:
        raise ValueError(f"{where}: expected an object with 'x' and 'y', got keys {sorted(record)}")
    return record, literals


def _refuse_booleans(record: dict, where: str) -> None:
    """ValueError if x or y holds true or false (a Python loop: run only when the text has one)."""
    for key in ("x", "y"):
        stack = [record[key]]
        while stack:
            item = stack.pop()
            if isinstance(item, bool):
                raise ValueError(f"{where}: {key}: expected numbers, got {str(item).lower()}")
            if isinstance(item, list):
                stack.extend(item)


# ----------------------------------------------------------------------------- one file

class _Layout:
    """What every user of a federation must share: row width, image shape, text or numbers."""

    def __init__(self):
        self.width: Optional[int] = None
        self.image: Optional[tuple] = None
        self.text = False
        self.first = ""  # the user (and file) that set it, for the error

    def check(self, rows: np.ndarray, image, text: bool, where: str) -> None:
        if self.width is None:
            self.width, self.image, self.text, self.first = rows.shape[1], image, text, where
            return
        if text != self.text:
            kinds = ("text", "numbers") if self.text else ("numbers", "text")
            raise ValueError(f"{where}: x holds {kinds[1]}, but {self.first} holds {kinds[0]}")
        if rows.shape[1] != self.width or image != self.image:
            mine = f"{rows.shape[1]} values" + (f" (shape {list(image)})" if image else "")
            theirs = f"{self.width} values" + (f" (shape {list(self.image)})" if self.image else "")
            raise ValueError(f"{where}: x: expected rows of {theirs} like {self.first}, got rows of {mine}")


def _read_file(path: str, npd, layout: _Layout):
    """[(user, x, y)] of one LEAF file in its users' order, its hierarchies (or None) and its
    pflcore member (or None)."""
    records: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    users = num_samples = hierarchies = extra = None
    seen_data = False
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise FileNotFoundError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with fh:
        stream = JsonStream(fh, path, READ_CHUNK)
        try:
            keys = stream.members()
            for key in keys:
                if key == "user_data":
                    seen_data = True
                    for user in stream.members():
                        where = f"{path}: user {user!r}"
                        if user in records:
                            raise ValueError(f"{where}: appears twice in user_data")
                        record, literals = _read_record(stream, where)
                        if literals:
                            _refuse_booleans(record, where)  # numpy would read them as 1 and 0
                        rows, image, text = _features(record["x"], where, npd)
                        labels = _labels(record["y"], len(record["x"]), where, text)
                        del record  # the decoded lists: the largest thing held while reading
                        if rows.shape[0]:
                            layout.check(rows, image, text, where)
                        records[user] = (rows, labels)
                elif key == "users":
                    users = stream.value()
                elif key == "num_samples":
                    num_samples = stream.value()
                elif key == "hierarchies":
                    hierarchies = stream.value()
                elif key == PFLCORE_KEY:
                    extra = stream.value()
                else:
                    stream.value()  # another member (none in LEAF's files): not ours to interpret
            stream.end()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason}); expected a LEAF .json file") from None
    if not seen_data:
        raise ValueError(f"{path}: no 'user_data' member; expected a LEAF file "
                         f"{{\"users\": [...], \"num_samples\": [...], \"user_data\": {{...}}}}")
    order = _user_order(users, records, path)
    if num_samples is not None:
        if not isinstance(num_samples, list) or len(num_samples) != len(order):
            raise ValueError(f"{path}: num_samples: expected a list of {len(order)} counts (one per user), got "
                             f"{len(num_samples) if isinstance(num_samples, list) else type(num_samples).__name__}")
        for user, count in zip(order, num_samples):
            if count != len(records[user][1]):
                raise ValueError(f"{path}: user {user!r}: num_samples says {count!r}, user_data holds "
                                 f"{len(records[user][1])} rows")
    if hierarchies is not None and (not isinstance(hierarchies, list) or len(hierarchies) != len(order)):
        raise ValueError(f"{path}: hierarchies: expected a list with one entry per user ({len(order)})")
    return [(u, *records.pop(u)) for u in order], hierarchies, extra


def _user_order(users, records: Dict[str, Any], path: str) -> List[str]:
    """The file's "users" list as strings (JSON keys are strings; pFedMe's CIFAR script lists
    integers), checked against the users of user_data."""
    if users is None:
        return list(records)
    if not isinstance(users, list) or not all(isinstance(u, (str, int)) and not isinstance(u, bool) for u in users):
        raise ValueError(f"{path}: users: expected a list of user ids (strings or integers)")
    order = [str(u) for u in users]
    if len(set(order)) != len(order):
        dup = next(u for i, u in enumerate(order) if u in order[:i])
        raise ValueError(f"{path}: users: {dup!r} is listed twice")
    missing = [u for u in order if u not in records]
    if missing:
        raise ValueError(f"{path}: user {missing[0]!r} is in users but not in user_data")
    listed = set(order)
    extra = [u for u in records if u not in listed]
    if extra:
        raise ValueError(f"{path}: user {extra[0]!r} is in user_data but not in users")
    return order


def _read_split(files: List[str], npd, layout: _Layout):
    """{user: (x, y, file)} over the files of one split, in file order; hierarchies by user;
    the pflcore members of the files."""
    split: Dict[str, Tuple[np.ndarray, np.ndarray, str]] = {}
    hierarchies: Dict[str, Any] = {}
    extras = []
    for path in files:
        entries, hier, extra = _read_file(path, npd, layout)
        for k, (user, rows, labels) in enumerate(entries):
            if user in split:
                raise ValueError(f"{path}: user {user!r} is also in {split[user][2]} (of the same split)")
            split[user] = (rows, labels, path)
            if hier is not None:
                hierarchies[user] = hier[k]
        if extra is not None:
            extras.append((path, extra))
    return split, hierarchies, extras


def _assemble(users: List[str], split: Dict[str, tuple], width: int, npd) -> ClientData:
    """ClientData of ``users`` in that order, filled user by user (each user's arrays released
    once copied, so the peak is the result plus one user)."""
    total = sum(split[u][1].shape[0] for u in users)
    x = np.empty((total, width), dtype=npd)
    y = np.empty(total, dtype=np.int64)
    offsets = np.zeros(len(users) + 1, dtype=np.int64)
    row = 0
    for i, user in enumerate(users):
        rows, labels, _ = split.pop(user)
        x[row:row + labels.shape[0]] = rows
        y[row:row + labels.shape[0]] = labels
        row += labels.shape[0]
        offsets[i + 1] = row
    return ClientData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(offsets))


def _image_shape(value, width: int):
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) not in (2, 3) or \
            not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in value):
        raise ValueError(f"image_shape: expected (channels, height, width) or (height, width) of positive integers, "
                         f"got {value!r}")
    shape = tuple(int(s) for s in value)
    shape = (1,) + shape if len(shape) == 2 else shape
    if math.prod(shape) != width:
        raise ValueError(f"image_shape: expected a shape of {width} values (the rows' width), got {value!r} "
                         f"({math.prod(shape)} values)")
    return shape


def leaf(root, *, dtype: torch.dtype = torch.float32, num_classes: Optional[int] = None,
         image_shape: Optional[Sequence[int]] = None, drop_incomplete: bool = False) -> Federation:
    """The LEAF data set in ``root`` as a federation, one client per user (see the module doc).

    ``root``: a folder holding ``train/`` and ``test/`` folders of ``*.json`` files (or
    ``data/train`` and ``data/test``: LEAF's ``<dataset>/data`` and pFedMe's
    ``data/Synthetic/data``), or a pair ``(train_files, test_files)``, each a path, a folder or
    a list of paths. ``dtype``: of the features (float32 or float64). ``num_classes``: default
    the largest label + 1 (80 for Shakespeare's characters; the value ``to_leaf`` recorded,
    where it did); it must exceed every label. ``image_shape``: (channels, height, width) of
    the rows where the files do not say it. ``drop_incomplete``: leave out users without rows
    in one of the splits instead of raising.

    Missing folders or files raise FileNotFoundError; malformed JSON, inconsistent files
    (a user twice, ``num_samples`` that disagree with the rows, rows of unequal width) and labels
    that are not integers ≥ 0 raise ValueError naming the file and the user.
    """
    if dtype not in _NP_DTYPE:
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype!r}")
    if not isinstance(drop_incomplete, bool):
        raise ValueError(f"drop_incomplete: expected True or False, got {drop_incomplete!r}")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer))
                                    or num_classes < 1):
        raise ValueError(f"num_classes: expected None or an integer >= 1, got {num_classes!r}")
    if image_shape is not None:
        _image_shape(image_shape, math.prod(image_shape) if isinstance(image_shape, (list, tuple)) else 0)
    npd = _NP_DTYPE[dtype]
    train_files, test_files, folder = _locate(root)
    layout = _Layout()
    train, hierarchies, extras = _read_split(train_files, npd, layout)
    test, _, test_extras = _read_split(test_files, npd, layout)
    if layout.width is None:
        raise ValueError(f"root: no user has any rows in {train_files + test_files}")

    dropped = [u for u in train if u not in test or not len(test[u][1]) or not len(train[u][1])]
    dropped += [u for u in test if u not in train]
    if dropped and not drop_incomplete:
        user = dropped[0]
        if user not in train:
            where = f"is in the test split ({test[user][2]}) but not in the train files"
        elif user not in test:
            where = f"is in the train split ({train[user][2]}) but not in the test files"
        else:
            where = f"has no {'train' if not len(train[user][1]) else 'test'} rows"
        raise ValueError(f"root: user {user!r} {where}; every client needs train and test rows ({len(dropped)} "
                         f"users lack one: LEAF data split by user has disjoint train and test users: split it "
                         f"by sample), or pass drop_incomplete=True to leave such users out")
    left_out = set(dropped)
    users = [u for u in train if u not in left_out]
    if not users:
        raise ValueError(f"root: no user has rows in both splits ({len(dropped)} users lack one)")
    for user in dropped:
        train.pop(user, None)
        test.pop(user, None)

    width = layout.width
    train_data = _assemble(users, train, width, npd)
    test_data = _assemble(users, test, width, npd)
    top = int(max(train_data.y.max(), test_data.y.max()))
    recorded = {e.get("num_classes") for _, e in extras + test_extras if isinstance(e, dict)} - {None}
    source = ""
    if num_classes is None:
        if len(recorded) > 1:
            raise ValueError(f"root: the files record different numbers of classes {sorted(recorded, key=str)}; "
                             f"pass num_classes")
        if recorded:
            num_classes, source = recorded.pop(), f" (recorded in the files' {PFLCORE_KEY!r} member)"
        else:
            num_classes = len(LEAF_LETTERS) if layout.text else top + 1
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes <= top:
        raise ValueError(f"num_classes: expected an integer > {top} (the largest label), got {num_classes!r}{source}")
    shape = _image_shape(image_shape, width)
    if shape is None and layout.image is not None:
        shape = (1,) + layout.image if len(layout.image) == 2 else layout.image
    if shape is None:
        noted = [e.get("image_shape") for _, e in extras if isinstance(e, dict) and e.get("image_shape")]
        shape = _image_shape(noted[0], width) if noted else (1, 28, 28) if width == MNIST_ROW else None
    if shape is not None and len(shape) != 3:
        raise ValueError(f"{layout.first}: x: rows nested {len(shape)} deep; expected (channels, height, width)")

    label = os.path.basename(os.path.normpath(folder)) if folder else os.path.basename(train_files[0])
    meta = dict(generator="leaf", root=folder, train_files=train_files, test_files=test_files, users=users,
                image_shape=None if shape is None else list(shape), num_classes=int(num_classes),
                dtype=str(dtype).replace("torch.", ""), dropped_users=dropped,
                text_encoding="LEAF_LETTERS indices" if layout.text else None)
    if hierarchies:
        meta["hierarchies"] = [hierarchies.get(u) for u in users]
    return Federation(train_data, test_data, int(num_classes), name=f"leaf({label}, m={len(users)})", meta=meta)


# ----------------------------------------------------------------------------- writing

def _dump_number_rows(rows: torch.Tensor) -> str:
    """JSON of float rows: each value as the shortest decimal that reads back as the same
    float64 (Python's repr of the value widened to float64), so a float32 or float64 value
    reads back bitwise equal. (The shortest float32 decimal would be shorter, but read as
    float64 and then rounded to float32 it is rounded twice, which is not always the same.)"""
    return json.dumps(rows.tolist())


def to_leaf(fed: Federation, folder, *, users_per_file: Optional[int] = None,
            overwrite: bool = False) -> Dict[str, List[str]]:
    """Writes ``fed`` as LEAF JSON: ``folder/train/*.json`` and ``folder/test/*.json``.

    Users are ``fed.meta["users"]`` where the federation came from ``leaf`` (with its
    ``hierarchies``), else ``f_00000``, ``f_00001`` … (the names of LEAF's and pFedMe's
    Synthetic sets); one file per split, or files of ``users_per_file`` users each. Rows are
    written flat, as FEMNIST's are; the number of classes and the image shape go in a member
    ``"pflcore"`` that other LEAF readers ignore. Client weights and true models (``truth``)
    have no place in LEAF's format and are not written. The federation must have class labels
    (not regression targets) and be whole (not a shard). A folder that already holds LEAF
    files is refused unless ``overwrite=True``, which first deletes the ``*.json`` files of its
    ``train/`` and ``test/``. Returns ``{"train": [paths], "test": [paths]}``.
    """
    if not isinstance(fed, Federation):
        raise ValueError(f"fed: expected a pflcore Federation, got {type(fed).__name__}")
    if fed.is_shard:
        raise ValueError("fed: a shard of a federation; write the whole federation")
    if fed.train.y.dtype.is_floating_point:
        raise ValueError("fed: has float targets (regression); LEAF's format holds integer class labels")
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite: expected True or False, got {overwrite!r}")
    m = fed.num_clients
    per_file = m if users_per_file is None else check_positive_int(users_per_file, "users_per_file")
    users = fed.meta.get("users") if isinstance(fed.meta, dict) else None
    if not (isinstance(users, list) and len(users) == m and all(isinstance(u, str) for u in users)
            and len(set(users)) == m):
        users = [f"f_{i:05d}" for i in range(m)]
    hierarchies = fed.meta.get("hierarchies") if isinstance(fed.meta, dict) else None
    if not (isinstance(hierarchies, list) and len(hierarchies) == m):
        hierarchies = None
    image = fed.meta.get("image_shape") if isinstance(fed.meta, dict) else None
    extra = {"num_classes": fed.num_classes, "image_shape": list(image) if image else None}

    folder = os.fspath(folder)
    dirs = {split: os.path.join(folder, split) for split in ("train", "test")}
    old = [os.path.join(d, n) for d in dirs.values() if os.path.isdir(d)
           for n in sorted(os.listdir(d)) if n.endswith(".json")]
    if old and not overwrite:
        raise ValueError(f"folder: {folder!r} already holds LEAF files ({old[0]!r} …); pass overwrite=True to "
                         f"replace them, or choose another folder")
    for path in old:
        os.remove(path)
    written: Dict[str, List[str]] = {"train": [], "test": []}
    for split, data in (("train", fed.train), ("test", fed.test)):
        os.makedirs(dirs[split], exist_ok=True)
        data = data.to("cpu")
        offsets = data.offsets.tolist()
        for part, lo in enumerate(range(0, m, per_file)):
            hi = min(m, lo + per_file)
            path = os.path.join(dirs[split], f"data_{part}_{split}.json")
            tmp = path + ".partial"
            with open(tmp, "w", encoding="utf-8") as fh:
                head = {"users": users[lo:hi], "num_samples": [offsets[i + 1] - offsets[i] for i in range(lo, hi)]}
                if hierarchies is not None:
                    head["hierarchies"] = hierarchies[lo:hi]
                head[PFLCORE_KEY] = extra
                fh.write(json.dumps(head)[:-1] + ', "user_data": {')
                for i in range(lo, hi):
                    r0, r1 = offsets[i], offsets[i + 1]
                    fh.write(("" if i == lo else ", ") + json.dumps(users[i]) + ': {"x": '
                             + _dump_number_rows(data.x[r0:r1]) + ', "y": ' + json.dumps(data.y[r0:r1].tolist()) + "}")
                fh.write("}}")
            os.replace(tmp, path)
            written[split].append(path)
    return written
