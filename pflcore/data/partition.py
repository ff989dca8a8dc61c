"""Split the rows of a labelled data set among simulated clients (DESIGN.md §6).

``partition`` returns row indices only, so one split can be applied to any features;
``partition_to_client_data`` gathers the rows into the ragged ``ClientData`` layout.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from pflcore.client_data import ClientData
from pflcore._arrays import to_tensor as as_tensor
from pflcore._checks import check_positive_int, check_real

SCHEMES = ("classes", "shards", "dirichlet", "iid")
# Dirichlet draws are repeated until every client has min_size rows; past this many tries the
# request is (nearly) infeasible for this alpha and we say so instead of looping forever.
MAX_DIRICHLET_ATTEMPTS = 1000


def _labels_array(labels) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"labels: expected a non-empty 1-D array of class labels, got shape {list(labels.shape)}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels: expected integer class labels, got dtype {labels.dtype}")
    return labels.astype(np.int64, copy=False)


def _split_counts(n: int, weights: np.ndarray, floor: int) -> np.ndarray:
    """``len(weights)`` counts >= floor summing to n, the rows beyond the floors shared in
    proportion to ``weights`` (largest-remainder rounding). Needs n >= floor·len(weights)."""
    rest = n - floor * len(weights)
    share = rest * weights / weights.sum()
    counts = np.floor(share).astype(np.int64)
    counts[np.argsort(-(share - counts), kind="stable")[:rest - int(counts.sum())]] += 1
    return counts + floor


def partition(labels, num_clients: int, scheme: str = "classes", *, classes_per_client: int = 2,
              shards_per_client: int = 2, alpha: float = 0.5, min_size: int = 1,
              sizes: Optional[Tuple[float, float]] = None, seed: int = 0) -> List[np.ndarray]:
    """Split the rows of ``labels`` [N] among ``num_clients`` clients.

    Returns ``num_clients`` sorted int64 arrays of row indices into ``labels``: disjoint, each
    with at least ``min_size`` rows. Schemes (K = number of distinct labels):

    - ``"classes"``: client i holds the ``classes_per_client`` = c classes at positions
      ``i·c, …, i·c + c − 1 (mod K)`` of the sorted distinct labels (dealt round-robin, so all
      classes are used when m·c >= K; otherwise the rows of the classes no client holds are
      left out). Each class's rows are shuffled and split among the clients holding it:
      equally, or, with ``sizes=(lo, hi)``, in proportion to a weight ``s_i ~ U[lo, hi]``
      drawn per client (only the ratio hi/lo matters; client sizes then spread over about
      that ratio, like pFedMe's MNIST split with sizes in [1165, 3834]).
    - ``"shards"`` (McMahan et al. 2017): rows sorted by label (random order within a label)
      are cut into m·``shards_per_client`` near-equal shards; each client gets
      ``shards_per_client`` shards chosen at random.
    - ``"dirichlet"`` (Hsu et al. 2019): for every class, proportions q ~ Dir(``alpha``·1_m)
      over clients and the class's shuffled rows are cut at the cumulative proportions; the
      whole draw is repeated until every client has >= ``min_size`` rows (at most
      1000 attempts). Small alpha → few classes per client; large alpha → close to iid.
    - ``"iid"``: a random permutation cut into m near-equal parts.

    Every scheme but "classes" (with m·c < K) covers all N rows. Deterministic in ``seed``.
    Bad arguments raise ValueError naming them.
    """
    labels = _labels_array(labels)
    N = labels.size
    m = check_positive_int(num_clients, "num_clients")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}")
    min_size = check_positive_int(min_size, "min_size")
    seed = check_positive_int(seed, "seed", minimum=0)
    if m * min_size > N:
        raise ValueError(f"num_clients: {m} clients with min_size = {min_size} rows each need at least "
                         f"{m * min_size} rows, but labels has N = {N}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    K = classes.size

    if scheme == "iid":
        parts = np.array_split(rng.permutation(N), m)

    elif scheme == "shards":
        spc = check_positive_int(shards_per_client, "shards_per_client")
        if m * spc * min_size > N:
            raise ValueError(f"shards_per_client: {m} clients x {spc} shards need at least {m * spc * min_size} "
                             f"rows, but labels has N = {N}")
        # Sorting a random permutation stably by label randomizes the order inside each label.
        perm = rng.permutation(N)
        order = perm[np.argsort(labels[perm], kind="stable")]
        shards = np.array_split(order, m * spc)
        pick = rng.permutation(m * spc).reshape(m, spc)
        parts = [np.concatenate([shards[s] for s in row]) for row in pick]

    elif scheme == "classes":
        c = check_positive_int(classes_per_client, "classes_per_client")
        if c > K:
            raise ValueError(f"classes_per_client: expected at most the {K} distinct classes in labels, got {c}")
        if sizes is None:
            weights = np.ones(m)
        else:
            if not isinstance(sizes, (tuple, list)) or len(sizes) != 2:
                raise ValueError(f"sizes: expected None or a pair (lo, hi), got {sizes!r}")
            lo = check_real(sizes[0], "sizes[0]", minimum=0.0, strict=True)
            hi = check_real(sizes[1], "sizes[1]", minimum=lo)
            weights = rng.uniform(lo, hi, m)
        held = (np.arange(m)[:, None] * c + np.arange(c)[None, :]) % K  # [m, c] class positions
        chunks = [[] for _ in range(m)]
        for k in range(K):
            holders = np.nonzero((held == k).any(axis=1))[0]
            if holders.size == 0:
                continue
            rows = rng.permutation(np.nonzero(labels == classes[k])[0])
            if rows.size < holders.size * min_size:
                raise ValueError(f"classes_per_client: class {classes[k]} has {rows.size} rows, too few for the "
                                 f"{holders.size} clients holding it (min_size = {min_size} each); use fewer "
                                 f"clients or classes_per_client")
            counts = _split_counts(rows.size, weights[holders], min_size)
            for i, piece in zip(holders, np.split(rows, np.cumsum(counts)[:-1])):
                chunks[i].append(piece)
        parts = [np.concatenate(ch) for ch in chunks]

    else:  # dirichlet
        a = check_real(alpha, "alpha", minimum=0.0, strict=True)
        by_class = [np.nonzero(labels == k)[0] for k in classes]
        for _ in range(MAX_DIRICHLET_ATTEMPTS):
            owner = np.empty(N, dtype=np.int64)  # client of every row
            for rows in by_class:
                q = rng.dirichlet(np.full(m, a))
                cuts = np.round(np.cumsum(q) * rows.size).astype(np.int64)
                cuts[-1] = rows.size  # the proportions may sum to 1 - 1e-16
                owner[rng.permutation(rows)] = np.repeat(np.arange(m), np.diff(cuts, prepend=0))
            counts = np.bincount(owner, minlength=m)
            if counts.min() >= min_size:
                break
        else:
            raise ValueError(f"alpha: no Dirichlet({a}) split in {MAX_DIRICHLET_ATTEMPTS} attempts gave every one "
                             f"of the {m} clients >= min_size = {min_size} rows (N = {N}); increase alpha or "
                             f"lower num_clients / min_size")
        parts = np.split(np.argsort(owner, kind="stable"), np.cumsum(counts)[:-1])

    return [np.sort(p).astype(np.int64, copy=False) for p in parts]


def partition_to_client_data(x, y, parts: Sequence) -> ClientData:
    """``ClientData`` whose client i holds rows ``x[parts[i]]``, ``y[parts[i]]`` in that order.

    ``x [N, p]`` float and ``y [N]`` (torch or numpy; integer labels become int64).
    """
    x_t, _ = as_tensor(x, "x")
    y_t, _ = as_tensor(y, "y")
    if not y_t.dtype.is_floating_point:
        y_t = y_t.to(torch.int64)
    if len(parts) == 0:
        raise ValueError("parts: expected a non-empty list of row-index arrays, got an empty one")
    idx = [np.asarray(p.cpu() if isinstance(p, torch.Tensor) else p).reshape(-1) for p in parts]
    for i, p in enumerate(idx):
        if p.size == 0:
            raise ValueError(f"parts: client {i} is empty; every client needs at least one row")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"parts: expected integer row indices, got dtype {p.dtype} for client {i}")
        if p.min() < 0 or p.max() >= x_t.shape[0]:
            raise ValueError(f"parts: client {i} has indices in [{p.min()}, {p.max()}], outside the "
                             f"{x_t.shape[0]} rows of x")
    rows = torch.from_numpy(np.concatenate(idx).astype(np.int64)).to(x_t.device)
    counts = torch.tensor([0] + [p.size for p in idx], dtype=torch.int64)
    return ClientData(x_t[rows], y_t.to(x_t.device)[rows], torch.cumsum(counts, 0).to(x_t.device))
