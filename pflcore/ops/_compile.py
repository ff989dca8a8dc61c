"""The ops as torch custom ops, so that ``torch.compile`` keeps them in its graphs (DESIGN.md §8).

Each public op is registered with ``torch.library`` in the ``pflcore`` namespace
(``torch.ops.pflcore.local_steps`` & co), with a fake implementation that gives the outputs'
shapes and dtypes, and ``local_steps``'s in-place update of ``theta`` declared. The first line
of each public op asks ``is_dynamo_compiling() or is_exporting()`` (``torch.compiler``): while
Dynamo traces (``torch.compile``, strict ``torch.export``) or ``torch.export`` traces without it,
the op calls the ``traced_<op>`` function of this module instead: it unpacks the model and the
``ClientData`` into tensors and scalars and calls the custom op, one node of the graph. (That
test answers as ``torch.compiler.is_compiling()`` does where it matters and costs eager calls
less: ~0.1 µs of an 8 µs small call against ~0.2 µs, ``bench/compile.py``; Dynamo folds both
functions to constants.)
When the compiled graph runs, the custom op's real implementation is the eager op's own path
(``run_<op>``): the same checks, backend choice (``pflcore.backend.use`` around the compiled
call is honoured) and numbers. The algorithm guard is applied then, when the graph runs, so a
function compiled outside a run still refuses to run inside an algorithm's round.

The custom ops take tensors and scalars only:

- a model is ``(family, p, C, fit_intercept, l2, layers)``: ``family`` is the kernels' GLM
  code (0 least squares, 1 logistic, 2 softmax; ``pflcore.models.glm.FAMILY_CODE``), 3 for an
  MLP, 4 for a CNN; ``layers`` is empty for a GLM, an MLP's hidden sizes, or for a CNN
  ``[channels, height, width, kernel_size, pool, padding, n_conv, conv channels..., hidden...]``;
- a ``ClientData`` is ``(x, y, offsets, first_client)``.

The torch nets take the same custom ops as the GLMs: their eager path (a thread pool running
``torch.func`` over chunks of model rows, values checked with data-dependent branches) cannot
be traced, so it runs whole inside the op, as a GLM's kernel does.

What does not carry over from eager code:

- Arrays: torch tensors only. A numpy or DLPack array (JAX, CuPy), which the eager ops take, is
  a ValueError naming the argument when the function is traced: with ``fullgraph=True`` the
  compile fails with it (torch's ``Unsupported``, which quotes it); without, Dynamo runs that
  frame eagerly, where the op takes the array as usual.
- Autograd: the ops have no derivative formulas (their derivatives are what ``gradients`` and
  ``hvp`` compute). ``local_steps`` refuses a ``theta`` that requires grad, as in eager code;
  the other ops read ``theta.detach()``, so their outputs never require grad, also as in eager
  code. ``torch.ops.pflcore.<op>`` called directly on a tensor that requires grad returns
  outputs that do, and ``backward`` through them raises torch's "no autograd formula" error.
- ``torch.func`` transforms do not apply: the eager ops read raw memory, so under ``vmap`` or
  ``grad`` they raise torch's "Cannot access data pointer" error, and the custom ops have
  neither a derivative nor a batching rule (``vmap`` over ``torch.ops.pflcore.<op>`` runs
  torch's slow per-sample fallback, with a warning). The ops batch over model rows themselves:
  ``R`` rows in one call is what ``vmap`` over rows would give.
- ``Anderson`` keeps its history in Python state (the slot order, the safeguard's last norm)
  updated by data-dependent branches: ``Anderson.step`` is a graph break under compile (an
  error with ``fullgraph=True``) and runs eagerly. Its functional form ``anderson_weights`` is a
  custom op: keep residuals ``[k, D]`` and images ``[k, D]`` in tensors and mix with
  ``pi @ images``.
- ``kmeans``: its Lloyd loop stops on data-dependent tests and returns Python numbers; it is a
  graph break that runs eagerly, like ``Anderson.step``; ``kmeans_assign`` is a custom op.
- The ``<op>_ref`` functions set the backend in a context variable, which Dynamo does not trace:
  wrap the compiled call in ``with pflcore.backend.use("reference"):`` instead.
- Per-call cost: a compiled function pays torch's runtime wrappers on every call, and a custom
  op's Python dispatch on every op call, tens of µs; ``local_steps`` more (torch bumps the
  version of a mutated argument after matching all 18 schema arguments, in Python). Compile the
  code around large calls, not a loop of tiny ones (``bench/compile.py`` has the figures).
"""
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from pflcore.client_data import ClientData
from pflcore.models.glm import GLM, LeastSquares, Logistic, Softmax
from pflcore.models.nets import CNN, MLP, TorchNet
from pflcore.ops._args import IN_ALGORITHM, refuse_inside_algorithm

_GLM_CLASSES = {0: LeastSquares, 1: Logistic, 2: Softmax}  # by FAMILY_CODE
MLP_CODE, CNN_CODE = 3, 4


# ---- models and data as scalars and tensors ---------------------------------------------------

def model_args(model) -> tuple:
    """``model`` as ``(family, p, C, fit_intercept, l2, layers)`` (the module docstring)."""
    if isinstance(model, GLM):
        return model.code, model.p, model.C, model.fit_intercept, model.l2, []
    if type(model) is MLP:
        return MLP_CODE, model.p, model.C, True, model.l2, list(model.hidden)
    if type(model) is CNN:
        layers = list(model.image_shape) + [model.kernel_size, model.pool, model.padding, len(model.channels)]
        return CNN_CODE, model.p, model.C, True, model.l2, layers + list(model.channels) + list(model.hidden)
    if isinstance(model, TorchNet):
        raise ValueError(f"model: under torch.compile the ops take the GLMs, MLP and CNN (they are rebuilt from "
                         f"their sizes inside the custom op), got a {type(model).__name__}; call the op "
                         f"outside the compiled function")
    raise ValueError(f"model: expected a GLM from pflcore.models (LeastSquares, Logistic, Softmax) or a "
                     f"torch net (MLP, CNN), got {type(model).__name__}")


@functools.lru_cache(maxsize=64)
def _model_of(family: int, p: int, C: int, fit_intercept: bool, l2: float, layers: tuple):
    if family in _GLM_CLASSES:
        if layers:
            raise ValueError(f"layers: a GLM (family {family}) has none, got {list(layers)}")
        if family == 2:
            return Softmax(p, C, l2=l2, fit_intercept=fit_intercept)
        if C != 1:
            raise ValueError(f"C: {_GLM_CLASSES[family].__name__} has C = 1, got {C}")
        return _GLM_CLASSES[family](p, l2=l2, fit_intercept=fit_intercept)
    if family == MLP_CODE:
        return MLP(p, layers, C, l2=l2)
    if family == CNN_CODE and len(layers) >= 7 and len(layers) >= 7 + layers[6]:
        c, h, w, kernel, pool, padding, n_conv = layers[:7]
        return CNN(p, C, image_shape=(c, h, w), kernel_size=kernel, pool=pool, padding=padding,
                   channels=layers[7:7 + n_conv], hidden=layers[7 + n_conv:], l2=l2)
    raise ValueError(f"family: expected 0-2 (a GLM), {MLP_CODE} (MLP) or {CNN_CODE} (CNN) with its layers, "
                     f"got {family} with layers {list(layers)}")


def _model(family, p, C, fit_intercept, l2, layers):
    return _model_of(family, p, C, fit_intercept, l2, tuple(layers))


def _data(x: Tensor, y: Tensor, offsets: Tensor, first_client: int) -> ClientData:
    """A ClientData over the arrays as they are: the ops check every value they read (DESIGN.md
    §8), so nothing is validated (or copied) here."""
    data = object.__new__(ClientData)
    data.x, data.y, data.offsets, data.first_client = x, y, offsets, first_client
    return data


_AD_INPLACE = torch._C.DispatchKey.ADInplaceOrView


def _hvp_call(family: int, call):
    """The nets' hvp runs ``torch.func.jvp``, which needs the dispatch keys above Python. Called
    from inside a TorchDispatchMode (AOTAutograd runs a compiled graph's first call under one, to
    check that custom ops' outputs do not alias their inputs) those keys are excluded on this
    thread and the jvp fails: then the call runs on a helper thread, whose dispatch state is a
    plain eager call's (as the nets adapter's own chunk threads do). A GLM needs nothing."""
    if family < MLP_CODE or not torch._C._dispatch_tls_is_dispatch_key_excluded(_AD_INPLACE):
        return call()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(contextvars.copy_context().run, call).result()  # with the caller's backend choice


def _guard(op: str) -> None:
    if IN_ALGORITHM.get() is not None:
        refuse_inside_algorithm(op)


# ---- the custom ops: real implementations (the eager path) and fake ones (shapes) ------------

def _rows_of(theta: Tensor, offsets: Tensor, rows: Optional[Tensor]):
    """R: theta's rows, or for a shared [d] theta one per client (or per entry of rows)."""
    if theta.dim() == 2:
        return theta.shape[0]
    return offsets.shape[0] - 1 if rows is None else rows.shape[0]


@torch.library.custom_op("pflcore::local_steps", mutates_args=("theta",))
def local_steps_op(theta: Tensor, x: Tensor, y: Tensor, offsets: Tensor, first_client: int, family: int, p: int,
                   C: int, fit_intercept: bool, l2: float, layers: List[int], steps: int, lr: float, prox: float,
                   anchor: Optional[Tensor], batches: Optional[Tensor], rows: Optional[Tensor],
                   grad_scale: Optional[Tensor]) -> None:
    from pflcore.ops.local_steps import run_local_steps

    _guard("local_steps")
    run_local_steps(_model(family, p, C, fit_intercept, l2, layers), theta, _data(x, y, offsets, first_client),
                    steps, lr, prox, anchor, batches, rows, grad_scale, False)


@local_steps_op.register_fake
def _(theta, x, y, offsets, first_client, family, p, C, fit_intercept, l2, layers, steps, lr, prox, anchor, batches,
      rows, grad_scale):
    return None


@torch.library.custom_op("pflcore::gradients", mutates_args=())
def gradients_op(theta: Tensor, x: Tensor, y: Tensor, offsets: Tensor, first_client: int, family: int, p: int, C: int,
                 fit_intercept: bool, l2: float, layers: List[int], rows: Optional[Tensor],
                 batches: Optional[Tensor]) -> Tensor:
    from pflcore.ops.gradients import run_gradients

    _guard("gradients")
    return run_gradients(_model(family, p, C, fit_intercept, l2, layers), theta, _data(x, y, offsets, first_client),
                         rows, batches, False)


@gradients_op.register_fake
def _(theta, x, y, offsets, first_client, family, p, C, fit_intercept, l2, layers, rows, batches):
    return theta.new_empty(_rows_of(theta, offsets, rows), theta.shape[-1])


@torch.library.custom_op("pflcore::evaluate", mutates_args=())
def evaluate_op(theta: Tensor, x: Tensor, y: Tensor, offsets: Tensor, first_client: int, family: int, p: int, C: int,
                fit_intercept: bool, l2: float, layers: List[int], rows: Optional[Tensor],
                batches: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    from pflcore.ops.evaluate import run_evaluate

    _guard("evaluate")
    loss, correct, count = run_evaluate(_model(family, p, C, fit_intercept, l2, layers), theta,
                                        _data(x, y, offsets, first_client), rows, batches, False)
    # a backend may return the two counts as rows of one allocation; a custom op's outputs may
    # not share storage
    return loss, correct, count.clone()


@evaluate_op.register_fake
def _(theta, x, y, offsets, first_client, family, p, C, fit_intercept, l2, layers, rows, batches):
    R = _rows_of(theta, offsets, rows)
    return (theta.new_empty(R), theta.new_empty(R, dtype=torch.int64), theta.new_empty(R, dtype=torch.int64))


@torch.library.custom_op("pflcore::hvp", mutates_args=())
def hvp_op(theta: Tensor, v: Tensor, x: Tensor, y: Tensor, offsets: Tensor, first_client: int, family: int, p: int,
           C: int, fit_intercept: bool, l2: float, layers: List[int], batches: Tensor,
           rows: Optional[Tensor]) -> Tensor:
    from pflcore.ops.hvp import run_hvp

    _guard("hvp")
    model = _model(family, p, C, fit_intercept, l2, layers)
    data = _data(x, y, offsets, first_client)
    return _hvp_call(family, lambda: run_hvp(model, theta, v, data, batches, rows, False))


@hvp_op.register_fake
def _(theta, v, x, y, offsets, first_client, family, p, C, fit_intercept, l2, layers, batches, rows):
    return torch.empty_like(theta)


@torch.library.custom_op("pflcore::sample_batches", mutates_args=())
def sample_batches_op(x: Tensor, y: Tensor, offsets: Tensor, first_client: int, clients: Optional[Tensor], steps: int,
                      batch_size: int, seed: int, counter: int) -> Tensor:
    from pflcore.ops.sample_batches import run_sample_batches

    _guard("sample_batches")
    return run_sample_batches(_data(x, y, offsets, first_client), steps, batch_size, seed, counter, clients)


@sample_batches_op.register_fake
def _(x, y, offsets, first_client, clients, steps, batch_size, seed, counter):
    R = offsets.shape[0] - 1 if clients is None else clients.shape[0]
    return x.new_empty(R, steps, batch_size, dtype=torch.int32)


@torch.library.custom_op("pflcore::kmeans_assign", mutates_args=())
def kmeans_assign_op(points: Tensor, centroids: Tensor) -> Tuple[Tensor, Tensor]:
    from pflcore.ops.kmeans import _assign, _centroids, _points

    _guard("kmeans_assign")
    points_t, _ = _points(points)
    return _assign(points_t, _centroids(centroids, points_t))


@kmeans_assign_op.register_fake
def _(points, centroids):
    N = points.shape[0]
    return points.new_empty(N, dtype=torch.int64), points.new_empty(N)


@torch.library.custom_op("pflcore::average", mutates_args=())
def average_op(theta: Tensor, weights: Tensor, rows: Optional[Tensor]) -> Tensor:
    from pflcore.ops.average import run_average

    _guard("average")
    return run_average(theta, weights, rows)


@average_op.register_fake
def _(theta, weights, rows):
    return theta.new_empty(theta.shape[-1])


@torch.library.custom_op("pflcore::anderson_weights", mutates_args=())
def anderson_weights_op(residuals: Tensor, reg: float) -> Tensor:
    from pflcore.ops.anderson import run_anderson_weights

    return run_anderson_weights(residuals, reg)


@anderson_weights_op.register_fake
def _(residuals, reg):
    return residuals.new_empty(residuals.shape[0], dtype=torch.float64)


# ---- what the public ops call under torch.compile (traced by Dynamo) -------------------------

def _tensor(value, name: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    raise ValueError(f"{name}: under torch.compile the ops take torch tensors, got {type(value).__name__} "
                     f"(numpy and DLPack arrays are for the eager ops: convert with torch.from_numpy / "
                     f"torch.from_dlpack before the compiled function)")


def _optional(value, name: str) -> Optional[Tensor]:
    return None if value is None else _tensor(value, name)


def _indices(value, name: str, like: Tensor) -> Optional[Tensor]:
    """Client indices: a tensor, or a Python sequence as the eager ops take it."""
    if isinstance(value, (list, tuple, range)):
        return torch.tensor(list(value), dtype=torch.int64, device=like.device)
    return _optional(value, name)


def _int(value, name: str):
    """An integer as the custom op's schema takes it (its range is checked when the op runs)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, np.integer):
        return int(value)
    raise ValueError(f"{name}: expected an integer, got {value!r}")


def _real(value, name: str):
    """A real number as the schema takes it (a Python number: a tensor would be read by .item(),
    a graph break); checked when the op runs."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, (np.integer, np.floating)):
        return float(value)
    raise ValueError(f"{name}: expected a real number (under torch.compile, a Python number), got {value!r}")


def _data_args(data) -> tuple:
    if not isinstance(data, ClientData):
        raise ValueError(f"data: expected a pflcore.ClientData, got {type(data).__name__}")
    return data.x, data.y, data.offsets, data.first_client


def traced_local_steps(model, theta, data, steps, lr, prox, anchor, batches, rows, grad_scale):
    theta_t = _tensor(theta, "theta")
    if theta_t.requires_grad:
        raise ValueError("theta: requires grad, and this op updates it in place outside autograd; "
                         "pass theta.detach()")
    x, y, offsets, first = _data_args(data)
    torch.ops.pflcore.local_steps(theta_t, x, y, offsets, first, *model_args(model), _int(steps, "steps"),
                                  _real(lr, "lr"), _real(prox, "prox"),
                                  _optional(anchor, "anchor"), _optional(batches, "batches"),
                                  _indices(rows, "rows", x), _optional(grad_scale, "grad_scale"))
    return theta


def traced_gradients(model, theta, data, rows, batches):
    x, y, offsets, first = _data_args(data)
    return torch.ops.pflcore.gradients(_tensor(theta, "theta").detach(), x, y, offsets, first, *model_args(model),
                                       _indices(rows, "rows", x), _optional(batches, "batches"))


def traced_evaluate(model, theta, data, rows, batches):
    x, y, offsets, first = _data_args(data)
    return torch.ops.pflcore.evaluate(_tensor(theta, "theta").detach(), x, y, offsets, first, *model_args(model),
                                      _indices(rows, "rows", x), _optional(batches, "batches"))


def traced_hvp(model, theta, v, data, batches, rows):
    x, y, offsets, first = _data_args(data)
    return torch.ops.pflcore.hvp(_tensor(theta, "theta").detach(), _tensor(v, "v").detach(), x, y, offsets, first,
                                 *model_args(model), _tensor(batches, "batches"), _indices(rows, "rows", x))


def traced_sample_batches(data, steps, batch_size, seed, counter, clients):
    x, y, offsets, first = _data_args(data)
    return torch.ops.pflcore.sample_batches(x, y, offsets, first, _indices(clients, "clients", x),
                                            _int(steps, "steps"), _int(batch_size, "batch_size"), _int(seed, "seed"),
                                            _int(counter, "counter"))


def traced_kmeans_assign(points, centroids):
    return torch.ops.pflcore.kmeans_assign(_tensor(points, "points").detach(),
                                           _tensor(centroids, "centroids").detach())


def traced_average(theta, weights, rows):
    theta_t = _tensor(theta, "theta").detach()
    return torch.ops.pflcore.average(theta_t, _tensor(weights, "weights").detach(), _indices(rows, "rows", theta_t))


def traced_anderson_weights(residuals, reg):
    return torch.ops.pflcore.anderson_weights(_tensor(residuals, "residuals").detach(),
                                              _real(reg, "reg"))


# ---- graph breaks: what runs eagerly under torch.compile -------------------------------------

def _eager_kmeans(points, k, init, iters, tol, seed, weights, comm):
    from pflcore.ops.kmeans import run_kmeans

    _guard("kmeans")
    return run_kmeans(points, k, init, iters, tol, seed, weights, comm)


def _eager_anderson_step(anderson, u, tu, reduce):
    return anderson._step(u, tu, reduce)


_EAGER = {
    "eager_kmeans": (_eager_kmeans, "pflcore.ops.kmeans runs eagerly under torch.compile: its Lloyd loop stops on "
                     "data-dependent tests and returns Python numbers (ops.kmeans_assign is a custom op)"),
    "eager_anderson_step": (_eager_anderson_step, "pflcore.ops.Anderson.step runs eagerly under torch.compile: its "
                            "history is Python state updated by data-dependent branches (mix with "
                            "ops.anderson_weights in compiled code)"),
}


def __getattr__(name: str):
    """``eager_kmeans``, ``eager_anderson_step``: the eager functions wrapped in
    ``torch.compiler.disable`` (a graph break with the reason named; with ``fullgraph=True`` an
    error that says it). Made on first use, by Dynamo while it traces the public op, because
    ``torch.compiler.disable`` imports Dynamo (~1 s), which ``import pflcore`` should not."""
    if name in _EAGER:
        fn, reason = _EAGER[name]
        wrapped = torch.compiler.disable(fn, reason=reason)
        globals()[name] = wrapped
        return wrapped
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
