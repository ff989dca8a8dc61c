"""What every algorithm shares (DESIGN.md §5): the run context and the algorithm protocol.

An algorithm holds only its hyperparameters; every tensor lives in its ``state`` (a dataclass
that ``torch.save`` can write and read back), so a checkpoint restores a run exactly.

An algorithm calls the ops through its context: ``ctx.local_steps``, ``ctx.gradients``,
``ctx.hvp``, ``ctx.evaluate`` (bound to the run's model, data and device, counting the
client-steps they take), ``ctx.sample_clients`` and ``ctx.batches`` (the index tensors the
context draws itself: the kernels do not check them again), and the server steps
``ctx.average`` (P_H), ``ctx.sum``, ``ctx.norm``, ``ctx.kmeans``, ``ctx.cluster_means``. The
plain ``pflcore.ops`` refuse to run inside a round that ``pflcore.run`` drives: only the context
form is right when the clients are sharded.

Sharding (``pflcore.distributed``): with several ranks, ``ctx.train``/``ctx.test`` hold this
rank's clients only and every per-client ``[m, d]`` matrix of the state holds their rows; such
state fields are declared with ``per_client()``. ``ctx.m`` is the number of LOCAL clients (so
``state.theta[S]`` indexes local rows), ``ctx.num_clients`` the federation's. The server steps
are collectives there; in one process they are exactly the ops, so a single-process run
computes what it always did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Optional, Tuple

import torch

from pflcore import distributed, ops
from pflcore._sampling import randperm_prefix
from pflcore._checks import MAX_COUNT
from pflcore.ops.average import run_average
from pflcore.ops.evaluate import run_evaluate
from pflcore.ops.gradients import run_gradients
from pflcore.ops.hvp import run_hvp
from pflcore.ops.kmeans import run_kmeans
from pflcore.ops.local_steps import run_local_steps
from pflcore.ops.sample_batches import run_sample_batches
from pflcore.data.federation import Federation
from pflcore.models.glm import GLM

_M32 = 0xFFFFFFFF


def replicate(w: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, d]``: n copies of ``w [d]`` in fresh memory. (``w.expand(n, d).contiguous()`` is no
    copy when n = 1, a size-1 dimension being contiguous already: steps taken in place on it
    would move ``w`` itself.)"""
    return w.unsqueeze(0).repeat(n, 1)


def per_client(**kwargs):
    """A state field whose first dimension runs over the clients: each rank holds its clients'
    rows, and a checkpoint restored on another number of ranks is re-split along it."""
    return field(metadata={"per_client": True}, **kwargs)


@dataclass
class Context:
    """Everything a round needs besides the state: data, model, device, seed, sampling, and
    (sharded runs) the communicator and this rank's place in the federation."""

    federation: Federation
    model: GLM
    device: torch.device
    seed: int = 0
    clients_per_round: Optional[int] = None
    # client-steps done so far on this rank (the throughput metric): one per gradient of one
    # client's model that ctx.local_steps, ctx.gradients or ctx.hvp computed
    client_steps: int = 0
    f_star: Optional[float] = None  # min of Σ p_i f_i when known (least squares), for the optimality gap
    comm: distributed.Comm = field(default_factory=distributed.Comm)
    train: object = field(init=False)
    test: object = field(init=False)
    weights: torch.Tensor = field(init=False)
    num_clients: int = field(init=False)  # clients of the whole federation
    num_rows: int = field(init=False)     # training rows of the whole federation
    # client-level DP (pflcore.privacy.Mechanism): privatizes ctx.average inside rounds
    privacy: Optional[object] = None
    # index tensors this context drew (sample_clients, batches): id -> (tensor, version when drawn)
    _drawn: dict = field(init=False, repr=False, default_factory=dict)
    # rows of the per-client state fields this round changed (Algorithm.marks_changed_rows), or
    # None when the run checks every row after the round
    _changed: Optional[list] = field(init=False, repr=False, default=None)

    def __post_init__(self):
        self.train = self.federation.train
        self.test = self.federation.test
        self.weights = self.federation.weights
        self.num_clients = self.federation.num_clients_total or self.federation.num_clients
        self.num_rows = self.comm.sum(int(self.train.num_rows))

    @property
    def m(self) -> int:
        """Clients held here (all of them in one process)."""
        return self.federation.num_clients

    @property
    def first_client(self) -> int:
        """Global id of local client 0."""
        return self.train.first_client

    @property
    def d(self) -> int:
        return self.model.d

    @property
    def dtype(self) -> torch.dtype:
        return self.train.dtype

    def changed_rows(self, rows: torch.Tensor) -> None:
        """Declares that this round changes these (local) rows of the state's per-client fields,
        and no others. For an algorithm with ``marks_changed_rows = True``, the run's check for
        NaN/inf after the round then reads only these rows of the per-client fields (every other
        row was checked when it last changed) and all of the other fields: at 10^5 clients and
        a cohort of 1,000, a hundredth of the [m, d] matrices instead of all of them."""
        if self._changed is not None:
            self._changed.append(rows.reshape(-1))

    def initial_models(self, m: int) -> torch.Tensor:
        """``[m, d]`` starting parameters: m copies of the model's initial point (zeros for a
        GLM; a seeded random initialization for a torch net), so every client starts alike."""
        return self.model.initial(m, dtype=self.dtype, device=self.device, seed=self.seed)

    def initial_global(self) -> torch.Tensor:
        """``[d]`` starting global model (the model's initial point)."""
        return self.initial_models(1)[0].clone()

    def sample_clients(self, t: int) -> torch.Tensor:
        """``int64 [S]`` sorted LOCAL indices of this rank's clients among those of round t. The
        draw over all ``num_clients`` comes from a generator keyed by (seed, t) alone, so a
        resumed or sharded run draws the same clients."""
        n = self.num_clients
        poisson = self.privacy is not None and self.privacy.privacy.sampling == "poisson"
        if self.clients_per_round is None or self.clients_per_round >= n:
            return torch.arange(self.m, device=self.device)
        seed = (self.seed * 1_000_003 + t * 7919 + 17) & 0x7FFFFFFFFFFFFFFF
        if poisson:  # DP's Poisson cohorts: each client independently with probability k / N
            g = torch.Generator().manual_seed(seed)
            chosen = torch.nonzero(torch.rand(n, generator=g, dtype=torch.float64) < self.clients_per_round / n)[:, 0]
        else:  # torch.randperm(n, seeded)[:k], bitwise, in O(k) (pflcore/_sampling.py)
            chosen = randperm_prefix(n, self.clients_per_round, seed).sort().values
        if self.m != n:  # keep this rank's clients, as local indices
            lo = self.first_client
            chosen = chosen[(chosen >= lo) & (chosen < lo + self.m)] - lo
        return self._mark(chosen.to(self.device))

    def batches(self, t: int, stream: int, clients: torch.Tensor, steps: int, batch_size: int,
                repeat: int = 1) -> torch.Tensor:
        """``int32 [S, steps·repeat, B]`` minibatches for round t; ``stream`` separates independent
        draws within a round (e.g. pFedMe's local rounds); ``repeat`` uses each draw for that
        many consecutive steps (pFedMe's inner steps share their local round's minibatch)."""
        # The round is the counter; the stream moves the seed by a multiple of the golden ratio,
        # so neither the number of rounds nor of streams is limited and no two draws repeat.
        seed = (self.seed + 0x9E3779B9 * (stream + 1)) & _M32
        b = run_sample_batches(self.train, steps, batch_size, seed, t & _M32, clients,
                               trusted=clients is None or self._trusted(clients))
        if repeat > 1:
            b = b.repeat_interleave(repeat, dim=1)
        return self._mark(b)

    # ---- the ops, bound to this run -------------------------------------------------------

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        """Remembers ``t`` as drawn here: while it is unchanged (same version), its indices are
        known to be in range and the kernels need not check them again."""
        if len(self._drawn) >= 64:  # the draws of the last round or so are what an algorithm reuses
            self._drawn.pop(next(iter(self._drawn)))
        self._drawn[id(t)] = (t, t._version)
        return t

    def _trusted(self, *index_tensors) -> bool:
        for t in index_tensors:
            if t is not None:
                seen = self._drawn.get(id(t))
                if seen is None or seen[0] is not t or seen[1] != t._version:
                    return False
        return True

    def local_steps(self, theta: torch.Tensor, *, steps: int, lr: float, prox: float = 0.0, anchor=None,
                    batches=None, rows=None, grad_scale=None, lr_scale=None) -> torch.Tensor:
        """``ops.local_steps`` on the run's model and training data, in place on ``theta [R, d]``
        (``lr_scale`` [d]: a per-coordinate step factor, 0 freezing a coordinate); counts R·steps
        client-steps."""
        out = run_local_steps(self.model, theta, self.train, steps, lr, prox, anchor, batches, rows, grad_scale,
                              self._trusted(rows, batches), lr_scale)
        self.client_steps += theta.shape[0] * steps
        return out

    def gradients(self, theta: torch.Tensor, *, rows=None, batches=None) -> torch.Tensor:
        """``ops.gradients`` on the run's model and training data (``theta`` [R, d], or [d]: one
        model at every row); counts one client-step per row."""
        out = run_gradients(self.model, theta, self.train, rows, batches, self._trusted(rows, batches))
        self.client_steps += out.shape[0]
        return out

    def hvp(self, theta: torch.Tensor, v: torch.Tensor, *, batches, rows=None) -> torch.Tensor:
        """``ops.hvp`` on the run's model and training data; counts one client-step per row."""
        out = run_hvp(self.model, theta, v, self.train, batches, rows, self._trusted(rows, batches))
        self.client_steps += out.shape[0]
        return out

    def evaluate(self, theta: torch.Tensor, *, rows=None, batches=None, data=None):
        """``ops.evaluate`` on the run's model and its training data (``data=ctx.test``: the test
        data); ``theta`` [d] is one model at every row. Not counted as training."""
        data = self.train if data is None else data
        return run_evaluate(self.model, theta, data, rows, batches, data is self.train and self._trusted(rows, batches))

    # ---- server steps (collectives when sharded) ------------------------------------------

    @property
    def sharded(self) -> bool:
        return self.comm.world > 1

    def average(self, theta: torch.Tensor, weights: torch.Tensor, rows: Optional[torch.Tensor] = None, *,
                center: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[d]`` P_H: Σ w_r θ_r / Σ w_r over ``rows`` of ``theta [R, d]`` on every rank (``ops.average``
        in one process; sharded: one all-reduce of the float64 weighted sum and weight, so a
        rank with no rows takes part with zeros). ``center`` (``[d]``): what the server sent the
        clients whose rows these are; a run with privacy (pflcore.privacy) clips each row's
        difference from it and releases the noised mean instead (with capped weights)."""
        if self.privacy is not None and self.privacy.in_round:
            return self.privacy.average(self, theta, center, rows, weights)
        if not self.sharded:
            return run_average(theta, weights, rows)
        if rows is not None:
            theta, weights = theta[rows], weights[rows]
        d = theta.shape[1]
        acc = torch.zeros(d + 1, dtype=torch.float64, device=theta.device)
        if theta.shape[0]:
            w64 = weights.to(torch.float64)
            acc[:d] = w64 @ theta.to(torch.float64)
            acc[d] = w64.sum()
        self.comm.all_reduce(acc)
        if not float(acc[d]) > 0:
            raise ValueError("weights: the weights of the averaged rows sum to 0 (over all ranks)")
        return (acc[:d] / acc[d]).to(theta.dtype)

    def _not_private(self, what: str) -> None:
        if self.privacy is not None and self.privacy.in_round:
            raise ValueError(f"privacy: {what} sees every client's vector at the server; it has no client-level DP "
                             "form here (run without privacy, or aggregate with ctx.average)")

    def sum(self, value):
        """Sum over ranks (identity in one process) of a number or tensor."""
        return self.comm.sum(value)

    def norm(self, x: torch.Tensor) -> float:
        """Frobenius norm of a per-client matrix whose rows are spread over the ranks."""
        if not self.sharded:
            return float(x.norm())
        return math.sqrt(self.comm.sum(float((x.to(torch.float64) ** 2).sum())))

    def count_total(self, n: int) -> int:
        """Σ over ranks of a local count (e.g. the sampled clients of a round)."""
        return self.comm.sum(int(n))

    def kmeans(self, points: torch.Tensor, k: Optional[int] = None, *, init="k-means++", iters: int = 100,
               tol: float = 1e-6, seed: int = 0, weights=None) -> "ops.KMeans":
        """``ops.kmeans`` over the points of every rank (labels of the local points)."""
        self._not_private("ctx.kmeans")
        return run_kmeans(points, k, init, iters, tol, seed, weights, self.comm)

    def cluster_means(self, points: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor],
                      centroids: torch.Tensor) -> torch.Tensor:
        """``centroids`` ← weighted cluster means over every rank's points, in place (empty
        clusters keep theirs); returns the clusters' float64 weights."""
        self._not_private("ctx.cluster_means")
        return ops.cluster_means(points, labels, weights, centroids, self.comm)


class Algorithm:
    """Base class: subclasses set ``name`` and implement init/round/personalized/global_model."""

    name = "algorithm"
    # True: each round calls ctx.changed_rows(...) with every row of its per-client state fields
    # it changes, and the run's finiteness check reads only those rows (see Context.changed_rows);
    # False: the check reads all of every field
    marks_changed_rows = False
    # client-level DP (pflcore.privacy): the ctx.average releases of one round, and why the
    # algorithm cannot run under privacy (None: it can)
    dp_releases_per_round = 1
    dp_unsupported: Optional[str] = None

    def init(self, ctx: Context):
        raise NotImplementedError

    def round(self, state, ctx: Context, t: int):
        raise NotImplementedError

    def personalized(self, state) -> Optional[torch.Tensor]:
        return None

    def global_model(self, state) -> Optional[torch.Tensor]:
        return None

    def evaluated_models(self, state, ctx: Context) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(personalized ``[m, d]`` or None, global ``[d]`` or None): the models the round loop
        evaluates and returns. By default ``personalized(state)`` and ``global_model(state)``; an
        algorithm whose personalized models are derived from its state (Per-FedAvg: one step
        from the global model) computes them here, when they are evaluated, not every round."""
        return self.personalized(state), self.global_model(state)

    def residual(self, state) -> Optional[float]:
        """‖T(u) − u‖ of the last round for fixed-point methods, else None."""
        return None

    # How many [trained clients, d] copies of the trained clients' models a round makes (FedAvg:
    # θ of the sampled clients; pFedMe: w_i and θ_i): for the memory estimate of run's warning.
    working_copies = 1

    def clients_trained_per_round(self, m: int, clients_per_round: Optional[int]) -> int:
        """How many of the ``m`` clients a round trains (runs local steps for): by default the
        ``clients_per_round`` sampled ones (all m when None). An algorithm that trains more
        (pFedMe with ``train_all``, LocalTrain, L2SGD, PERM after its warm-up: every client)
        overrides it, and ``pflcore.run`` warns when it exceeds ``clients_per_round``, with the
        memory it estimates (see ``training_note``)."""
        return m if clients_per_round is None else min(int(clients_per_round), m)

    def training_note(self) -> str:
        """Why a round trains more clients than ``clients_per_round`` and how to change it (said in
        run's warning); empty when it does not."""
        return ""

    def hyperparameters(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


class ServerModelFixedPoint:
    """For algorithms whose fixed-point state (what ``Accelerated`` mixes) is the server model
    ``state.w`` (the same on every rank of a sharded run)."""

    fixed_point_per_client = False

    def fixed_point(self, state) -> torch.Tensor:
        return state.w

    def set_fixed_point(self, state, w: torch.Tensor):
        state.w = w
        return state


def positive(value, name: str, algorithm: str, *, allow_zero: bool = False) -> float:
    """A hyperparameter check that names the algorithm and the argument."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{algorithm}: {name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{algorithm}: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def count_int(value, name: str, algorithm: str, minimum: int = 1) -> int:
    """A step, round or batch count: an integer in [minimum, 2**31) (past that a count overflows the
    kernels' int64 arithmetic, or a loop over it would never end)."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise ValueError(f"{algorithm}: {name} must be an integer in [{minimum}, {MAX_COUNT}], got {value!r}")
    return value


def state_tensors(state, prefix: str = "", *, with_kind: bool = False):
    """(name, tensor) pairs of a state dataclass (and of dataclasses inside it), for
    finiteness checks; ``with_kind``: (name, tensor, per_client) triples, per_client True for a
    top-level ``per_client()`` field."""
    for f in fields(state):
        v = getattr(state, f.name)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            if with_kind:
                yield prefix + f.name, v, not prefix and bool(f.metadata.get("per_client"))
            else:
                yield prefix + f.name, v
        elif is_dataclass(v):
            yield from state_tensors(v, prefix + f.name + ".", with_kind=with_kind)
