"""What the fuzz suite (tests/test_fuzz.py) calls, with which arguments, and how it judges a result.

A ``Target`` is a callable, a hypothesis strategy that draws ``(args, kwargs)`` for it (valid and
invalid values mixed), and a check of a result: a function ``check(result, args, kwargs)`` that
returns what is wrong with it, or None. The contract every target is held to: a correct result,
or a ``ValueError`` that names one of the target's arguments; never another exception, a crash
or a hang.

Adding a callable is one entry: ``Target("name", fn, call(x=..., y=...), check)``. ``OPS`` is the
list of the ops' entries (``pflcore.ops``): it is kept empty here on purpose, while the ops'
validation is rebuilt; the lead fills it (see the example in its comment).
"""
from __future__ import annotations

import contextlib
import inspect
import io
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import torch
from hypothesis import strategies as st

import pflcore
from pflcore import algorithms as A
from pflcore import data as D
from pflcore import models as M

# ---- value strategies -----------------------------------------------------------------------------

_NAN, _INF = float("nan"), float("inf")
# Values that are wrong for almost any argument (a few are right for some: the check decides).
JUNK_SCALARS = [None, True, False, -1, 0, 2 ** 63, 2 ** 64, 2 ** 70, -2 ** 70, 0.5, -0.5, _NAN, _INF, -_INF,
                "", "x", "1", [1, 2], (1,), {"a": 1}, b"\x00", np.int64(-3), np.float32(_NAN),
                torch.tensor(1.0), torch.zeros(2, 3)]
junk = st.sampled_from(JUNK_SCALARS)


def maybe(valid: st.SearchStrategy, junk_every: int = 4) -> st.SearchStrategy:
    """``valid`` most of the time, else junk (one draw in ``junk_every``)."""
    return st.integers(0, junk_every - 1).flatmap(lambda i: junk if i == 0 else valid)


def _mix(*weighted) -> st.SearchStrategy:
    """One of the strategies, drawn with the given weights: ``_mix((3, a), (1, b))``."""
    table = [s for w, s in weighted for _ in range(w)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def ints(lo: int, hi: int) -> st.SearchStrategy:
    """Integers in [lo, hi] (numpy integers among them), and the values just outside."""
    return _mix((6, st.integers(lo, hi)), (2, st.integers(lo, hi).map(np.int64)),
                (2, st.sampled_from([lo - 1, hi + 1, 2 ** 64])))


def reals(lo: float, hi: float) -> st.SearchStrategy:
    """Reals in [lo, hi] (integers and numpy floats among them), and out-of-range or non-finite ones."""
    inside = st.floats(lo, hi, allow_nan=False)
    return _mix((5, inside), (1, inside.map(np.float64)), (1, st.sampled_from([lo, hi])),
                (1, st.integers(int(math.ceil(lo)), int(math.floor(hi))) if hi - lo >= 1 else st.just(hi)),
                (2, st.sampled_from([lo - 1.0, hi * 10 + 1, -1.0, _NAN, _INF, -_INF])))


def seeds() -> st.SearchStrategy:
    return st.one_of(st.integers(0, 2 ** 32), st.sampled_from([0, 2 ** 63 - 1, 2 ** 64 - 1, 2 ** 64, 2 ** 70, -1]))


OMIT = object()  # a keyword left out of the call


def near(valid: st.SearchStrategy, **alternatives: st.SearchStrategy) -> st.SearchStrategy:
    """``([], kwargs)`` from a valid keyword set; in two draws in three one keyword is replaced by
    an alternative value (often invalid) or by junk. For targets whose arguments must agree
    with each other, where independent draws would almost never be valid together."""
    names = sorted(alternatives)

    @st.composite
    def draw(d):
        kwargs = dict(d(valid))
        if names and d(st.integers(0, 2)) > 0:  # two draws in three change one argument
            key = d(st.sampled_from(names))
            kwargs[key] = d(maybe(alternatives[key], junk_every=3))
        return [], kwargs

    return draw()


def call(*args: st.SearchStrategy, **kwargs: st.SearchStrategy) -> st.SearchStrategy:
    """``(args, kwargs)``: every keyword may also be left out (its default then applies)."""
    kw = {k: st.one_of(st.just(OMIT), v) for k, v in kwargs.items()}
    return st.tuples(st.tuples(*args), st.fixed_dictionaries(kw)).map(
        lambda ak: (list(ak[0]), {k: v for k, v in ak[1].items() if v is not OMIT}))


@dataclass
class Target:
    name: str
    fn: Callable
    args: st.SearchStrategy
    check: Optional[Callable[[Any, list, dict], Optional[str]]] = None
    examples: int = 40
    names: Sequence[str] = ()  # argument names an error may name besides fn's own parameters
    timeout: float = 8.0  # seconds one example may take before it counts as a hang (the slowest takes < 1 s)
    arg_names: List[str] = field(default_factory=list)

    def __post_init__(self):
        from pflcore.experiment_config import parameters

        try:  # a class's constructor parameters, following **kwargs into its base (the presets)
            params = list(parameters(self.fn))
        except (TypeError, ValueError):
            params = []
        self.arg_names = params + list(self.names)


# ---- small valid objects --------------------------------------------------------------------------

@st.composite
def client_data_args(draw, broken: bool = True):
    """(x, y, offsets) of a valid ClientData, then (sometimes) one thing broken."""
    m = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 5), min_size=m, max_size=m))
    N, p = sum(sizes), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    x = torch.randn(N, p, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))).to(dtype)
    y = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=N, max_size=N)), dtype=torch.int64)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)
    kind = draw(st.sampled_from(["none"] * 4 + ["numpy", "float_y", "nan_x", "inf_x", "neg_label", "x_1d",
                                                "x_int", "y_short", "off_start", "off_end", "off_down",
                                                "off_empty", "off_float", "off_2d", "off_one", "y_half", "junk"]))
    if not broken:
        kind = "none"
    if kind == "numpy":
        x, y, offsets = x.numpy(), y.numpy(), offsets.numpy()
    elif kind == "float_y":
        y = y.to(dtype)
    elif kind == "nan_x":
        x[draw(st.integers(0, N - 1)), 0] = _NAN
    elif kind == "inf_x":
        x[0, p - 1] = -_INF
    elif kind == "neg_label":
        y[N - 1] = -2
    elif kind == "x_1d":
        x = x[:, 0].contiguous()
    elif kind == "x_int":
        x = x.to(torch.int32)
    elif kind == "y_short":
        y = y[:-1]
    elif kind == "off_start":
        offsets = offsets + 1
    elif kind == "off_end":
        offsets[-1] = N + 3
    elif kind == "off_down" and m > 1:
        offsets[1] = N
    elif kind == "off_empty":
        offsets = torch.cat([offsets[:1], offsets])
    elif kind == "off_float":
        offsets = offsets.double()
    elif kind == "off_2d":
        offsets = offsets[None]
    elif kind == "off_one":
        offsets = offsets[:1]
    elif kind == "y_half":
        y = y.to(torch.int16)
    elif kind == "junk":
        which = draw(st.integers(0, 2))
        value = draw(junk)
        x, y, offsets = [value if i == which else v for i, v in enumerate((x, y, offsets))]
    return x, y, offsets


@st.composite
def federation_args(draw):
    """Arguments of a valid Federation (train and test of the same clients), then (in two
    draws in three) one of them replaced by a wrong value."""
    m, p = draw(st.integers(1, 4)), draw(st.integers(1, 3))

    def part(n_max):
        sizes = draw(st.lists(st.integers(1, n_max), min_size=m, max_size=m))
        N = sum(sizes)
        return pflcore.ClientData(torch.randn(N, p), torch.tensor(draw(st.lists(st.integers(0, 2), min_size=N,
                                                                                max_size=N)), dtype=torch.int64),
                                  torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64))

    train, test = part(5), part(3)
    w = torch.rand(m, dtype=torch.float64) + 0.1
    kwargs = {"weights": (w / w.sum()).float(), "truth": torch.randn(m, 4), "truth_global": torch.randn(4),
              "name": "fuzz", "meta": {}}
    kwargs = {k: v for k, v in kwargs.items() if draw(st.booleans())}
    args = [train, test, 3]
    change = draw(st.integers(0, 8))
    bad_part = pflcore.ClientData(torch.randn(m + 1, p + 1), torch.zeros(m + 1, dtype=torch.int64),
                                  torch.arange(m + 2, dtype=torch.int64))
    if change == 1:
        args[draw(st.integers(0, 1))] = draw(st.sampled_from([bad_part, None, train.x]))
    elif change == 2:
        args[2] = draw(st.sampled_from([-1, 1.5, True, "3", None, 2 ** 64]))
    elif change == 3:
        kwargs["weights"] = draw(st.sampled_from([torch.ones(m + 1) / (m + 1), torch.full((m,), _NAN),
                                                  torch.full((m,), 2.0), -torch.ones(m), torch.ones(m, 2), "w"]))
    elif change == 4:
        kwargs["truth"] = draw(st.sampled_from([torch.full((m, 4), _NAN), torch.zeros(m + 1, 4), torch.zeros(4),
                                                torch.zeros(m, 4, dtype=torch.int64), "t"]))
    elif change == 5:
        kwargs["truth_global"] = draw(st.sampled_from([torch.tensor([_INF, 0.0]), torch.zeros(2, 2), [1.0, "a"]]))
    elif change == 6:
        kwargs["num_clients_total"] = draw(st.sampled_from([m, m + 2, 0, -1, 2 ** 64, "m"]))
    elif change == 7:
        args[1] = pflcore.ClientData(test.x.double(), test.y, test.offsets)  # dtype unlike train's
    return args, kwargs


def _tiny_federation(seed: int = 0, m: int = 4):
    return D.synthetic(0.5, 0.5, num_clients=m, dim=3, num_classes=3, seed=seed, size_scale=1, max_size=12)


# ---- checks (they run in the worker) --------------------------------------------------------------

def check_client_data(cd, args, kwargs) -> Optional[str]:
    if not isinstance(cd, pflcore.ClientData):
        return f"returned {type(cd).__name__}"
    if cd.offsets.numel() != cd.num_clients + 1 or int(cd.offsets[0]) != 0 or int(cd.offsets[-1]) != cd.num_rows:
        return f"inconsistent offsets {cd.offsets.tolist()} for {cd.num_rows} rows"
    if bool((cd.sizes < 1).any()):
        return "a client with no rows was accepted"
    if not bool(torch.isfinite(cd.x).all()):
        return "non-finite features were accepted"
    if not cd.x.dtype.is_floating_point or cd.x.dim() != 2:
        return f"x accepted with dtype {cd.x.dtype} and shape {list(cd.x.shape)}"
    if not cd.y.dtype.is_floating_point and (cd.y.dtype != torch.int64 or (cd.num_rows and int(cd.y.min()) < 0)):
        return f"labels accepted with dtype {cd.y.dtype}"
    return None


def check_federation(fed, args, kwargs) -> Optional[str]:
    if not isinstance(fed, pflcore.Federation):
        return f"returned {type(fed).__name__}"
    for part in (fed.train, fed.test):
        problem = check_client_data(part, [], {})
        if problem:
            return problem
    if fed.train.num_clients != fed.test.num_clients:
        return "train and test have different clients"
    w = fed.weights
    if w is None or w.shape != (fed.num_clients,) or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        return f"bad client weights {w}"
    for name in ("truth", "truth_global"):
        t = getattr(fed, name)
        if t is not None and not bool(torch.isfinite(t).all()):
            return f"non-finite {name} accepted"
    if "num_clients" in kwargs and fed.num_clients != int(kwargs["num_clients"]):
        return f"asked for {kwargs['num_clients']} clients, got {fed.num_clients}"
    if fed.num_classes > 0 and not fed.train.y.dtype.is_floating_point:
        top = max(int(fed.train.y.max()), int(fed.test.y.max()))
        if top >= fed.num_classes:
            return f"label {top} >= num_classes = {fed.num_classes}"
    return None


def check_model(model, args, kwargs) -> Optional[str]:
    if not (isinstance(model.d, int) and model.d >= 1 and math.isfinite(model.l2) and model.l2 >= 0):
        return f"d = {model.d}, l2 = {model.l2}"
    theta = model.initial(2, seed=0)
    if theta.shape != (2, model.d) or not bool(torch.isfinite(theta).all()):
        return f"initial parameters {list(theta.shape)} for d = {model.d}"
    if isinstance(model, M.GLM) and model.d != (model.p + int(model.fit_intercept)) * model.C:
        return f"d = {model.d} does not match p = {model.p}, C = {model.C}"
    return None


def check_algorithm(alg, args, kwargs) -> Optional[str]:
    """The object's numbers are finite, and it runs two rounds on a small federation: a value the
    constructor accepts must not fail later (a DivergenceError is a fair outcome of a big step)."""
    for k, v in alg.hyperparameters().items():
        if isinstance(v, float) and not math.isfinite(v):
            return f"{k} = {v} was accepted"
    repr(alg)
    fed = _tiny_federation()
    model = M.Softmax(3, 3)
    try:
        pflcore.run(alg, fed, model, rounds=2, clients_per_round=2, progress=False)
    except pflcore.DivergenceError:
        pass
    except ValueError as exc:  # a combination the constructor could not know was bad (more clusters
        # than clients, an exact prox on a model without one) must still name the argument
        names = list(kwargs) + ["clients", "model"]
        return None if any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", str(exc)) for n in names) \
            else f"accepted, then the run raised ValueError: {exc}"
    except Exception as exc:  # noqa: BLE001 - this is what the check looks for
        return f"accepted, then the run raised {type(exc).__name__}: {exc}"
    return None


def check_result(res, args, kwargs) -> Optional[str]:
    rounds = kwargs.get("rounds", 1)
    if not isinstance(res, pflcore.Result) or res.history[-1]["round"] != int(rounds):
        return f"history ends at round {res.history[-1]['round']}, asked for {rounds}"
    return None


def check_parts(parts, args, kwargs) -> Optional[str]:
    labels = np.asarray(args[0] if args else kwargs["labels"])
    m = int(args[1] if len(args) > 1 else kwargs["num_clients"])
    if len(parts) != m:
        return f"{len(parts)} parts for {m} clients"
    rows = np.concatenate(parts)
    if len(np.unique(rows)) != rows.size or rows.min() < 0 or rows.max() >= labels.size:
        return "parts overlap or leave the rows"
    if min(p.size for p in parts) < int(kwargs.get("min_size", 1)):
        return "a part smaller than min_size"
    return None


# ---- wrappers: what some targets call -------------------------------------------------------------

_OK = "<the valid object>"


def run_call(algorithm=_OK, federation=_OK, model=_OK, **kwargs):
    """``pflcore.run`` on a small valid problem, any argument replaced by the drawn one. A
    checkpoint folder is made fresh per call and removed."""
    folder = tempfile.mkdtemp(prefix="pflfuzz")
    try:
        if kwargs.get("checkpoint") == "<folder>":
            kwargs["checkpoint"] = os.path.join(folder, "ck")
        fed = _tiny_federation() if federation is _OK else federation
        mod = M.Softmax(3, 3) if model is _OK else model
        alg = A.FedAvg(lr=0.1) if algorithm is _OK else algorithm
        return pflcore.run(alg, fed, mod, progress=False, **kwargs) if "progress" not in kwargs else \
            pflcore.run(alg, fed, mod, **kwargs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def resume_call(checkpoint, **kwargs):
    folder = tempfile.mkdtemp(prefix="pflfuzz")
    try:
        if checkpoint == "<folder>":  # a real checkpoint folder
            checkpoint = os.path.join(folder, "ck")
            pflcore.run(A.FedAvg(lr=0.1), _tiny_federation(), M.Softmax(3, 3), rounds=2, checkpoint=checkpoint,
                        progress=False)
        elif checkpoint == "<empty>":
            checkpoint = folder
        elif checkpoint == "<file>":
            checkpoint = os.path.join(folder, "f")
            open(checkpoint, "w").close()
        return pflcore.resume(checkpoint, progress=False, **kwargs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


TINY_TOML = """
name = "fuzz"
rounds = 2
seeds = [0]
metrics = ["acc"]
[data]
generator = "synthetic"
alpha = 0.5
beta = 0.5
num_clients = 4
dim = 3
num_classes = 3
size_scale = 1
max_size = 12
[model]
family = "softmax"
[algorithms.FedAvg]
type = "fedavg"
lr = 0.1
[algorithms.pFedMe]
type = "pfedme"
lam = 15.0
lr = 0.01
personal_lr = 0.05
local_rounds = 1
inner_steps = 1
batch_size = 4
"""


def cli_call(*tokens):
    """``pflcore run fuzz.toml --no-progress --out DIR TOKENS...`` in this process: (exit status,
    stderr)."""
    from pflcore.cli import main

    folder = tempfile.mkdtemp(prefix="pflfuzz")
    try:
        path = os.path.join(folder, "fuzz.toml")
        with open(path, "w") as fh:
            fh.write(TINY_TOML)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["run", path, "--no-progress", "--out", os.path.join(folder, "out"), *tokens])
        return code, err.getvalue()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_cli(answer, args, kwargs) -> Optional[str]:
    code, err = answer
    if code == 0:
        return None
    if code == 1 and err.strip() == "pflcore: error: every run diverged (see the table)":
        return None
    if code != 2:
        return f"exit status {code}: {err}"
    if err.count("\n") != 1 or not err.startswith("pflcore: error: ") or "Traceback" in err:
        return f"not one error line: {err!r}"
    return None


# ---- the targets ----------------------------------------------------------------------------------

def _keys():
    """Keys an override may name: real ones, misspelt ones, nonsense."""
    real = ["rounds", "eval_every", "seeds", "clients_per_round", "metrics", "out", "name", "data.num_clients",
            "data.alpha", "data.dim", "data.generator", "data.max_size", "model.family", "model.l2",
            "algorithms.FedAvg.lr", "algorithms.FedAvg.local_steps", "algorithms.pFedMe.lam",
            "algorithms.pFedMe.batch_size", "algorithms.FedAvg.type", "sweep.key", "sweep.values",
            "algorithms.FedAvg.model.family", "plot"]
    wrong = ["roundz", "data.num_clientz", "algorithms.FedAv.lr", "algorithms.FedAvg.lrr", "rounds.x", "",
             ".", "a..b", "data", "algorithms", "algorithms.FedAvg", "model.family.x", "-rounds"]
    return st.sampled_from(real + wrong)


def _values():
    return st.sampled_from(["1", "0", "-1", "2", "0.5", "1e9", "nan", "inf", "true", "\"x\"", "x", "[0]", "[0, 1]",
                            "[]", "{a = 1}", "\"mlp\"", "\"softmax\"", "\"data.alpha\"", "[0.1, 0.5]",
                            "\"acc\"", "[\"acc\"]", "=", "", "\"fedsgd\"", "99999999999999999999"])


override = st.tuples(_keys(), _values()).map(lambda kv: f"{kv[0]}={kv[1]}")
cli_tokens = st.lists(st.one_of(override, override, override, st.sampled_from(
    ["--algo", "FedAvg", "--algo=pfedme", "--algo=Nope", "--bogus", "extra", "--no-progress"])), max_size=4)

# Wrong values for an argument of a kind: what ``near`` swaps in besides the generic junk.
# Sizes >= 2**63 do not fit the int64 every array library counts in. Sizes that fit but exhaust
# memory or time (2**31 local steps) are not wrong values: they are not drawn.
BAD_INT = st.sampled_from([0, -1, 2 ** 63, 2 ** 64, 2 ** 70, 1.5, np.int64(-2), True])
BAD_REAL = st.sampled_from([-1.0, 0.0, _NAN, _INF, -_INF, 1e300, -1e-300, np.float32(_NAN)])


def near_call(valid: dict, bad: dict, *, positional: Sequence[str] = ()) -> st.SearchStrategy:
    """Like ``near``, for a keyword table ``valid`` of strategies (a name mapped to None: left out
    unless drawn bad) with the wrong values ``bad`` per name; ``positional`` names go first,
    positionally."""
    base = st.fixed_dictionaries({k: v for k, v in valid.items() if v is not None})
    return near(base, **{k: v for k, v in bad.items() if v is not None}).map(lambda ak: (
        [ak[1].pop(k) for k in positional if k in ak[1]], ak[1]))


def _int_arg(lo, hi):
    return st.integers(lo, hi), _mix((1, st.sampled_from([lo - 1, hi * 1000 + 1])), (2, BAD_INT))


def _real_arg(lo, hi):
    return st.floats(lo, hi, allow_nan=False), _mix((1, st.sampled_from([lo - 1.0])), (2, BAD_REAL))


def table(**spec):
    """``name=(valid strategy, bad strategy)`` pairs -> (valid, bad) dicts for ``near_call``."""
    return {k: v[0] for k, v in spec.items()}, {k: v[1] for k, v in spec.items()}


def generator(fn, examples=50, positional=(), **spec):
    valid, bad = table(**spec)
    return Target(f"data.{fn.__name__}", fn, near_call(valid, bad, positional=positional), check_federation,
                  examples=examples)


_SEED = (st.integers(0, 2 ** 32), st.sampled_from([-1, 2 ** 64, 2 ** 70, 1.5, "0", None]))
_FRACTION = (st.floats(0.1, 0.9), st.sampled_from([0.0, 1.0, -0.5, 1.5, _NAN]))
_DTYPE = (st.sampled_from([torch.float32, torch.float64]), st.sampled_from([torch.float16, torch.int64, "float32",
                                                                            np.float32]))

CONSTRUCTORS: List[Target] = [
    Target("ClientData", pflcore.ClientData, st.builds(lambda a, fc: (list(a), fc), client_data_args(),
                                                        st.one_of(st.just({}), maybe(ints(0, 5)).map(
                                                            lambda v: {"first_client": v}))),
           check_client_data, examples=80),
    Target("ClientData.from_clients", pflcore.ClientData.from_clients,
           client_data_args().map(lambda t: (
               [[t[0][i:i + 1] for i in range(min(3, len(t[0]) if hasattr(t[0], "__len__") else 0))],
                [t[1][i:i + 1] for i in range(min(3, len(t[1]) if hasattr(t[1], "__len__") else 0))]], {})),
           check_client_data, names=("x", "y", "offsets", "xs", "ys")),
    Target("Federation", pflcore.Federation, federation_args(), check_federation, examples=60,
           names=("x", "y", "offsets")),
    Target("Softmax", M.Softmax, near_call(*table(p=_int_arg(1, 6), C=_int_arg(1, 5), l2=_real_arg(0, 1),
                                                  fit_intercept=(st.booleans(), st.sampled_from([None, "no", 2]))),
                                           positional=("p", "C")), check_model),
    Target("Logistic", M.Logistic, near_call(*table(p=_int_arg(1, 6), l2=_real_arg(0, 1)), positional=("p",)),
           check_model),
    Target("LeastSquares", M.LeastSquares, near_call(*table(p=_int_arg(1, 6), l2=_real_arg(0, 1),
                                                            fit_intercept=(st.booleans(), st.just(None))),
                                                     positional=("p",)), check_model),
    Target("MLP", M.MLP, near_call(*table(
        p=_int_arg(1, 6), hidden=(st.one_of(st.integers(1, 4), st.lists(st.integers(1, 4), max_size=2)),
                                  st.sampled_from([0, -1, [0], [2, -1], [2.5], "4", 2 ** 40])),
        C=_int_arg(1, 4), l2=_real_arg(0, 1)), positional=("p",)), check_model),
    Target("CNN", M.CNN, near(
        st.sampled_from([dict(p=16, C=3, image_shape=(1, 4, 4), channels=(2,), kernel_size=3, padding=1, pool=2,
                              hidden=(3,)),
                         dict(p=36, C=2, image_shape=(1, 6, 6), channels=(2, 3), kernel_size=2, pool=1, hidden=()),
                         dict(p=16, C=4)]),
        p=st.sampled_from([15, 0, 16, 64]), C=ints(1, 4),
        image_shape=st.sampled_from([(4, 4), (1, 6, 6), (2, 3, 3), (0, 4, 4), (1, 4, -4)]),
        channels=st.sampled_from([(), (0,), (-1,), (2.5,), (1, 1, 1, 1)]), kernel_size=ints(1, 6),
        pool=ints(1, 4), padding=ints(0, 3), hidden=st.sampled_from([(0,), 4, (3, 3), (-2,)]), l2=reals(0, 1)),
        check_model, examples=60),
    generator(D.synthetic, examples=60, positional=("alpha", "beta"), alpha=_real_arg(0, 2), beta=_real_arg(0, 2),
              num_clients=_int_arg(1, 6), dim=_int_arg(1, 5), num_classes=_int_arg(2, 5), seed=_SEED,
              size_scale=_int_arg(1, 2), iid=(st.booleans(), st.just("yes")), test_fraction=_FRACTION,
              max_size=(st.one_of(st.none(), st.integers(2, 60)), st.sampled_from([1, 0, -5, 2.5])), dtype=_DTYPE),
    generator(D.logistic_truth, num_clients=_int_arg(1, 6), samples_per_client=_int_arg(2, 30), dim=_int_arg(1, 5),
              R=_real_arg(0, 3), seed=_SEED, labels=(st.sampled_from(["sample", "argmax"]), st.just("soft")),
              test_fraction=_FRACTION, dtype=_DTYPE),
    generator(D.least_squares, num_clients=_int_arg(1, 6), samples_per_client=_int_arg(2, 30), dim=_int_arg(1, 5),
              noise_var=_real_arg(0, 2), shift=_real_arg(0, 2), seed=_SEED, test_fraction=_FRACTION, dtype=_DTYPE),
    generator(D.two_groups, num_clients=_int_arg(1, 6), samples_per_client=_int_arg(2, 30), dim=_int_arg(1, 5),
              mu=(st.floats(-2, 2), st.sampled_from([_NAN, _INF, None])), seed=_SEED, test_fraction=_FRACTION),
    generator(D.contexts, num_clients=_int_arg(4, 8), num_contexts=_int_arg(1, 4), dim=_int_arg(1, 5),
              num_classes=_int_arg(2, 4), client_noise=_real_arg(0, 1), beta=_real_arg(0, 1),
              feature_spread=_real_arg(0, 2),
              sizes=(st.sampled_from([(2, 9), (5, 5), [3, 6]]), st.sampled_from([(1, 9), (9, 2), (2.5, 9), (2,), 5])),
              seed=_SEED, test_fraction=_FRACTION),
    generator(D.digits, examples=20, num_clients=_int_arg(1, 12),
              scheme=(st.sampled_from(["classes", "shards", "dirichlet", "iid"]), st.just("x")),
              classes_per_client=_int_arg(1, 3), num_samples=(st.one_of(st.none(), st.integers(100, 300)),
                                                               st.sampled_from([0, -1, 10 ** 9])),
              test_fraction=_FRACTION, seed=_SEED),
    Target("data.partition", D.partition, near_call(*table(
        labels=(st.lists(st.integers(0, 4), min_size=40, max_size=60).map(np.array),
                st.sampled_from([np.array([]), np.array([[1, 2]]), np.array([0.5, 1.5]), [1, -1, 2], "abc"])),
        num_clients=_int_arg(1, 8), scheme=(st.sampled_from(["classes", "shards", "dirichlet", "iid"]),
                                            st.just("bogus")),
        classes_per_client=_int_arg(1, 3), shards_per_client=_int_arg(1, 3), alpha=_real_arg(0.1, 5),
        min_size=_int_arg(1, 2), sizes=(st.sampled_from([None, (1.0, 3.0)]),
                                        st.sampled_from([(0.0, 1.0), (3.0, 1.0), (1,), (_NAN, 1.0)])),
        seed=_SEED), positional=("labels", "num_clients")), check_parts, examples=60),
]

_ALG_VALID = {  # argument name -> valid values, where the annotation says too little
    "variant": st.sampled_from(["FO", "HF"]), "personal_eval": st.sampled_from(["theta", "local"]),
    "prox": st.sampled_from(["steps"]), "schedule": st.sampled_from(["constant", "inverse", "exponential"]),
    "local_update": st.sampled_from(["prox", "gradient"]), "init": st.sampled_from(["random"]),
    "p": st.floats(0.05, 1.0), "batch_size": st.one_of(st.none(), st.integers(1, 30)),
    "alpha_every": st.integers(1, 3), "warmup_rounds": st.integers(0, 2), "memory": st.integers(1, 4),
}


def _algorithm_strategy(cls) -> st.SearchStrategy:
    """Valid keyword values drawn per parameter (required ones always, optional ones sometimes),
    then, in half of the draws, one of them replaced by a wrong value or junk."""
    import inspect

    from pflcore.experiment_config import parameters

    valid, bad = {}, {}
    for name, param in parameters(cls).items():
        text = str(param.annotation)
        if name in _ALG_VALID:
            good = _ALG_VALID[name]
            wrong = st.sampled_from(["x", 0, -1, 2 ** 64]) if name not in ("batch_size",) else BAD_INT
        elif "int" in text:
            good, wrong = st.integers(1, 4), BAD_INT
        elif "bool" in text:
            good, wrong = st.booleans(), st.sampled_from(["yes", None, 2])
        else:
            good, wrong = st.floats(1e-3, 0.5), BAD_REAL
        bad[name] = wrong
        valid[name] = good if param.default is inspect.Parameter.empty else st.one_of(st.just(OMIT), good)
    return near(st.fixed_dictionaries(valid).map(lambda d: {k: v for k, v in d.items() if v is not OMIT}),
                **bad)


_CLASSES = sorted({cls for cls in A.REGISTRY.values()}, key=lambda c: c.__name__)
ALGORITHMS: List[Target] = [Target(f"algorithms.{cls.__name__}", cls, _algorithm_strategy(cls), check_algorithm,
                                   examples=25) for cls in _CLASSES]
ALGORITHMS.append(Target("algorithms.Accelerated", A.Accelerated, near_call(*table(
    algorithm=(st.sampled_from([A.FedAvg(lr=0.1), A.FedPi(eta=0.2), A.PFedMe(lam=15, lr=0.01, personal_lr=0.05)]),
               st.sampled_from([A.LocalTrain(lr=0.1), "FedAvg", None])),
    memory=_int_arg(1, 5), reg=_real_arg(0, 1e-3), safeguard=(st.booleans(), st.just(None))),
    positional=("algorithm",)), check_algorithm, examples=25))

RUNS: List[Target] = [
    Target("pflcore.run", run_call, near_call(*table(
        rounds=_int_arg(0, 3), clients_per_round=(st.one_of(st.none(), st.integers(1, 4)), BAD_INT),
        seed=_SEED, eval_every=_int_arg(1, 3),
        device=(st.just("cpu"), st.sampled_from(["cuda", "cuda:7", "tpu", "gpu", "", 0, None])),
        progress=(st.booleans(), None),
        checkpoint=(st.sampled_from(["<folder>", None]), st.sampled_from(["", 3, b"x"])),
        checkpoint_every=(st.none(), BAD_INT),
        callbacks=(st.sampled_from([(), [print]]), st.sampled_from([[None], 5, "f"])),
        algorithm=(None, st.sampled_from([A.FedAvg, "FedAvg", None])),
        federation=(None, st.sampled_from([None, _tiny_federation().train])),
        model=(None, st.sampled_from([M.Softmax(4, 3), M.Logistic(3), None, "softmax"])))),
        check_result, examples=80, names=tuple(inspect.signature(pflcore.run).parameters)),
    Target("pflcore.resume", resume_call, call(
        maybe(st.sampled_from(["<folder>", "<empty>", "<file>", "/nonexistent/pfl", ""])),
        rounds=maybe(st.one_of(st.none(), ints(1, 4)))), None, examples=30,
        names=tuple(inspect.signature(pflcore.resume).parameters)),
    Target("pflcore run (CLI overrides)", cli_call, cli_tokens.map(lambda t: (t, {})), check_cli, examples=40),
]

# ---- the ops (pflcore.ops) ----------------------------------------------------------------------------
# Each op's wrapper returns (its result, the reference's result on copies of the same inputs), and the
# check compares them: a value the op accepts must give the reference's answer. Bad values are drawn
# per argument, including ones that are only wrong by value (indices outside a client, labels out of
# range, NaN, offsets changed after the ClientData was built) and arrays the op must not write
# (read-only numpy) or must copy first (an anchor that is a view of theta).

from pflcore import ops as O  # noqa: E402

_OP_NAMES = ("x", "y", "offsets", "theta", "v", "rows", "batches", "anchor", "grad_scale", "data", "model", "clients",
             "points", "centroids", "labels", "weights", "residuals", "u", "tu", "init", "k", "seed", "steps", "lr",
             "prox", "batch_size", "counter", "iters", "tol", "reg", "memory", "safeguard", "safeguard_factor", "updates",
             "clip_norm", "noise_multiplier")


def _gen(draw) -> torch.Generator:
    """A generator seeded from the draw: hypothesis must see the same example when it replays it."""
    return torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))


@st.composite
def _model_case(draw):
    family = draw(st.sampled_from(["softmax", "softmax", "logistic", "least_squares"]))
    p = draw(st.integers(1, 4))
    model = {"softmax": lambda: M.Softmax(p, draw(st.integers(1, 4))), "logistic": lambda: M.Logistic(p),
             "least_squares": lambda: M.LeastSquares(p)}[family]()
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    N, m = sum(sizes), len(sizes)
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    x = torch.randn(N, p, generator=g, dtype=dtype)
    y = torch.randn(N, generator=g, dtype=dtype) if family == "least_squares" else \
        torch.randint(0, model.num_classes, (N,), generator=g)
    data = pflcore.ClientData(x, y, torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64))
    theta = 0.1 * torch.randn(m, model.d, generator=g, dtype=dtype)
    steps = draw(st.integers(0, 3))
    B = draw(st.integers(1, 4))
    batches = O.sample_batches(data, steps=steps, batch_size=B, seed=draw(st.integers(0, 9)), counter=0)
    return dict(model=model, theta=theta, data=data, steps=steps, batches=batches, B=B, m=m, N=N, dtype=dtype)


def _changed_data(case, what: str):
    """A ClientData whose arrays were changed AFTER it was built (the ops must check again)."""
    d = case["data"]
    d = pflcore.ClientData(d.x.clone(), d.y.clone(), d.offsets.clone())
    if what == "offsets_past":
        d.offsets[-1] = 10 ** 9
    elif what == "offsets_back":
        d.offsets[1] = -3
    elif what == "label":
        d.y[0] = 10 ** 6 if not d.y.dtype.is_floating_point else _NAN
    elif what == "nan_x":
        d.x[-1, 0] = _NAN
    elif what == "x_resized":
        d.x = d.x[:, :1].clone() if d.x.shape[1] > 1 else d.x.repeat(1, 2)
    return d


def _bad_theta(case):
    t = case["theta"]
    ro = t.numpy().copy()
    ro.setflags(write=False)
    return st.sampled_from([t[:, :-1], t.T if t.shape[0] > 1 and t.shape[1] > 1 else t[None], t.to(torch.float16),
                            t.clone().fill_(_NAN), ro, t.tolist(), torch.zeros(t.shape[0] + 1, t.shape[1],
                                                                                  dtype=t.dtype)])


def _bad_batches(case):
    b = case["batches"]
    out = b.clone()
    if out.numel():
        out.view(-1)[0] = case["N"] + 7
    return st.sampled_from([out, b.to(torch.int64), b[:, :0] if b.dim() == 3 else b, b - 1000,
                            torch.zeros(b.shape[0] + 1, *b.shape[1:], dtype=torch.int32)])


@st.composite
def _local_steps_args(draw):
    case = draw(_model_case())
    kw = dict(model=case["model"], theta=case["theta"], data=case["data"], steps=case["steps"],
              lr=draw(st.floats(1e-3, 0.5)))
    g = _gen(draw)
    if draw(st.booleans()):
        kw["batches"] = case["batches"]
    if draw(st.booleans()):
        kw["prox"] = draw(st.floats(0, 2))
        kw["anchor"] = draw(st.sampled_from([case["theta"].mean(0), case["theta"].flip(0).contiguous(),
                                             case["theta"][0]]))  # the last: a view of theta itself
    if draw(st.booleans()):
        kw["grad_scale"] = torch.rand(case["m"], dtype=case["dtype"], generator=g) + 0.5
    if draw(st.integers(0, 2)) > 0:  # two draws in three: one argument wrong
        key = draw(st.sampled_from(["theta", "data", "steps", "lr", "prox", "anchor", "batches", "rows", "grad_scale",
                                    "model"]))
        kw[key] = draw({
            "theta": _bad_theta(case),
            "data": st.sampled_from(["offsets_past", "offsets_back", "label", "nan_x", "x_resized"]).map(
                lambda w: _changed_data(case, w)) | junk,
            "steps": BAD_INT, "lr": BAD_REAL, "prox": st.sampled_from([-1.0, _NAN, _INF]),
            "anchor": st.sampled_from([torch.zeros(case["theta"].shape[1] + 1, dtype=case["dtype"]),
                                       torch.full((case["theta"].shape[1],), _NAN, dtype=case["dtype"]), "a"]),
            "batches": _bad_batches(case),
            "rows": st.sampled_from([torch.tensor([case["m"]] * case["m"]), torch.tensor([-1] * case["m"]),
                                     torch.zeros(case["m"] + 1, dtype=torch.int64), [0.5] * case["m"], "r"]),
            "grad_scale": st.sampled_from([torch.full((case["m"],), _INF, dtype=case["dtype"]),
                                           torch.ones(case["m"] + 1, dtype=case["dtype"])]),
            "model": st.sampled_from([M.Softmax(case["model"].p + 1, 2), "softmax", None]),
        }[key] | junk)
    return [], kw


def _copy(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, np.ndarray):
        return v.copy()
    return v


def _local_steps_both(**kw):
    before = {k: _copy(v) for k, v in kw.items()}
    out = O.local_steps(**kw)
    ref = O.local_steps_ref(**before)
    return out, ref


def _pair_check(answer, args, kwargs) -> Optional[str]:
    """The op's result equals the reference's (tuples element by element), to float tolerance."""
    got, want = answer
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for g, w in zip(got, want):
        g, w = torch.as_tensor(np.asarray(g)) if not isinstance(g, torch.Tensor) else g, \
            torch.as_tensor(np.asarray(w)) if not isinstance(w, torch.Tensor) else w
        tol = dict(rtol=1e-3, atol=1e-4) if g.dtype in (torch.float32,) else dict(rtol=1e-8, atol=1e-9)
        try:
            torch.testing.assert_close(g, w, equal_nan=True, check_dtype=True, **(tol if g.is_floating_point() else {}))
        except AssertionError as exc:
            return f"differs from the reference: {str(exc)[:300]}"
    return None


def _model_op_args(with_batches: bool):
    @st.composite
    def draw_args(draw):
        case = draw(_model_case())
        kw = dict(model=case["model"], theta=case["theta"], data=case["data"])
        if with_batches and case["batches"].shape[1] and draw(st.booleans()):
            kw["batches"] = case["batches"][:, 0].contiguous()
        if draw(st.booleans()):
            R = draw(st.integers(1, 3))
            kw["rows"] = torch.randint(0, case["m"], (R,), generator=_gen(draw))
            kw["theta"] = case["theta"][kw["rows"]].contiguous()
            if "batches" in kw:
                kw["batches"] = O.sample_batches(case["data"], steps=1, batch_size=case["B"], seed=1, counter=0,
                                                 clients=kw["rows"])[:, 0].contiguous()
        if draw(st.integers(0, 2)) > 0:
            key = draw(st.sampled_from(["theta", "data", "rows", "batches"] if with_batches else
                                       ["theta", "data", "rows"]))
            kw[key] = draw({
                "theta": _bad_theta(case),
                "data": st.sampled_from(["offsets_past", "offsets_back", "label", "nan_x", "x_resized"]).map(
                    lambda w: _changed_data(case, w)),
                "rows": st.sampled_from([torch.tensor([case["m"]]), torch.tensor([-5]), torch.tensor([[0]])]),
                "batches": _bad_batches(dict(case, batches=case["batches"][:, 0].contiguous()))
                if case["batches"].shape[1] else st.just(torch.zeros(0, dtype=torch.int32)),
            }[key] | junk)
        return [], kw
    return draw_args()


def _ref_of(op, ref):
    def both(**kw):
        before = {k: _copy(v) for k, v in kw.items()}
        return op(**kw), ref(**before)
    both.__name__ = op.__name__
    return both


@st.composite
def _hvp_args(draw):
    case = draw(_model_case())
    b = O.sample_batches(case["data"], steps=1, batch_size=case["B"], seed=2, counter=0)[:, 0].contiguous()
    kw = dict(model=case["model"], theta=case["theta"], v=case["theta"].flip(0).contiguous(), data=case["data"],
              batches=b)
    if draw(st.integers(0, 2)) > 0:
        key = draw(st.sampled_from(["theta", "v", "batches", "data"]))
        kw[key] = draw({"theta": _bad_theta(case), "v": _bad_theta(case),
                        "batches": _bad_batches(dict(case, batches=b)) | st.just(None),
                        "data": st.sampled_from(["offsets_past", "label", "nan_x"]).map(
                            lambda w: _changed_data(case, w))}[key] | junk)
    return [], kw


@st.composite
def _points_args(draw, with_k: bool):
    N, d = draw(st.integers(1, 12)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = _gen(draw)
    pts = torch.randn(N, d, generator=g, dtype=dtype)
    if with_k:
        kw = dict(points=pts, k=draw(st.integers(1, N)), seed=draw(st.integers(0, 2 ** 32)),
                  iters=draw(st.integers(0, 10)))
        if draw(st.booleans()):
            kw["weights"] = torch.rand(N, dtype=dtype, generator=g) + 0.1
    else:
        kw = dict(points=pts, centroids=pts[: draw(st.integers(1, N))].clone())
    if draw(st.integers(0, 2)) > 0:
        bad_pts = pts.clone()
        bad_pts[-1, 0] = _NAN
        choices = {"points": st.sampled_from([bad_pts, pts[:, 0], pts.to(torch.int64), pts.tolist()]) | junk}
        if with_k:
            choices.update(k=st.sampled_from([0, N + 1, -1, 2 ** 64, 1.5, "2"]), seed=_SEED[1], iters=BAD_INT,
                           weights=st.sampled_from([-torch.ones(N, dtype=dtype), torch.zeros(N, dtype=dtype),
                                                    torch.full((N,), _NAN, dtype=dtype), torch.ones(N + 1)]) | junk,
                           init=st.sampled_from(["random", torch.zeros(2, d + 1, dtype=dtype),
                                                 torch.full((1, d), _INF, dtype=dtype)]))
        else:
            bad_c = kw["centroids"].clone()
            bad_c[0, -1] = _INF
            choices["centroids"] = st.sampled_from([bad_c, torch.zeros(2, d + 1, dtype=dtype),
                                                    torch.zeros(0, d, dtype=dtype), bad_c.to(torch.float16)]) | junk
        key = draw(st.sampled_from(sorted(choices)))
        kw[key] = draw(choices[key])
    return [], kw


def _kmeans_check(res, args, kwargs) -> Optional[str]:
    pts = kwargs["points"]
    labels, cent = res.labels, res.centroids
    if labels.min() < 0 or labels.max() >= cent.shape[0]:
        return f"labels outside [0, {cent.shape[0]})"
    want = ((pts[:, None].double() - cent[None].double()) ** 2).sum(-1).min(1).values
    w = kwargs.get("weights")
    inertia = float(want.sum() if w is None else (want * w.double()).sum())
    if not math.isclose(inertia, res.inertia, rel_tol=1e-3, abs_tol=1e-6):
        return f"inertia {res.inertia} != recomputed {inertia}"
    if any(b > a * (1 + 1e-5) + 1e-9 for a, b in zip(res.history, res.history[1:])):
        return f"the inertia increased: {res.history}"
    return None


@st.composite
def _average_args(draw):
    m, d = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = _gen(draw)
    theta = torch.randn(m, d, dtype=dtype, generator=g)
    kw = dict(theta=theta, weights=torch.rand(m, dtype=dtype, generator=g) + 0.1)
    if draw(st.booleans()):
        kw["rows"] = torch.randint(0, m, (draw(st.integers(1, 4)),), generator=g)
    if draw(st.integers(0, 2)) > 0:
        key = draw(st.sampled_from(["theta", "weights", "rows"]))
        bad_theta = theta.clone()
        bad_theta[0, 0] = _NAN
        kw[key] = draw({"theta": st.sampled_from([bad_theta, theta[0], theta.to(torch.int32)]),
                        "weights": st.sampled_from([-torch.ones(m, dtype=dtype), torch.zeros(m, dtype=dtype),
                                                    torch.full((m,), _INF, dtype=dtype), torch.ones(m + 1)]),
                        "rows": st.sampled_from([torch.tensor([m]), torch.tensor([-1]), torch.tensor([0.5])])}[key]
                       | junk)
    return [], kw


@st.composite
def _clip_args(draw):
    R, d = draw(st.integers(0, 6)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = _gen(draw)
    updates = torch.randn(R, d, dtype=dtype, generator=g) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    kw = dict(updates=updates, clip_norm=draw(st.floats(1e-3, 10.0)), noise_multiplier=draw(st.floats(0.0, 2.0)),
              seed=draw(st.integers(0, 2 ** 64 - 1)), counter=draw(st.integers(0, 2 ** 64 - 1)))
    if draw(st.booleans()):
        kw["weights"] = torch.rand(R, dtype=dtype, generator=g)
    if draw(st.integers(0, 2)) > 0:
        key = draw(st.sampled_from(["updates", "weights", "clip_norm", "noise_multiplier", "seed", "counter"]))
        bad_u = torch.randn(max(R, 1), d, dtype=dtype, generator=g)
        bad_u[0, 0] = _NAN
        kw[key] = draw({"updates": st.sampled_from([bad_u, updates.reshape(-1), updates.to(torch.int32)]),
                        "weights": st.sampled_from([torch.full((R,), 1.5, dtype=dtype), -torch.ones(R, dtype=dtype),
                                                    torch.full((R,), _NAN, dtype=dtype), torch.ones(R + 1)]),
                        "clip_norm": BAD_REAL, "noise_multiplier": st.sampled_from([-1.0, _NAN, _INF]),
                        "seed": st.sampled_from([-1, 2 ** 64, 1.5]), "counter": st.sampled_from([-1, 2 ** 64, 1.5])}[key]
                       | junk)
    return [], kw


@st.composite
def _sample_args(draw):
    case = draw(_model_case())
    kw = dict(data=case["data"], steps=draw(st.integers(0, 3)), batch_size=draw(st.integers(1, 4)),
              seed=draw(st.integers(0, 2 ** 32 - 1)), counter=draw(st.integers(0, 2 ** 32 - 1)))
    if draw(st.booleans()):
        kw["clients"] = torch.randint(0, case["m"], (draw(st.integers(0, 3)),), generator=_gen(draw))
    if draw(st.integers(0, 2)) > 0:
        key = draw(st.sampled_from(["data", "steps", "batch_size", "seed", "counter", "clients"]))
        kw[key] = draw({"data": st.sampled_from(["offsets_past", "offsets_back"]).map(lambda w: _changed_data(case, w)),
                        "steps": BAD_INT, "batch_size": BAD_INT, "seed": st.sampled_from([-1, 2 ** 32, 1.5]),
                        "counter": st.sampled_from([-1, 2 ** 32]),
                        "clients": st.sampled_from([torch.tensor([case["m"]]), torch.tensor([-1]), [0.5]])}[key]
                       | junk)
    return [], kw


def _sample_check(answer, args, kwargs) -> Optional[str]:
    got, want = answer
    if not torch.equal(got, want):
        return "differs from the reference's draw"
    d = kwargs["data"]
    clients = kwargs.get("clients", torch.arange(d.num_clients))
    for r, i in enumerate(torch.as_tensor(clients).tolist()):
        lo, hi = int(d.offsets[i]), int(d.offsets[i + 1])
        if got[r].numel() and (int(got[r].min()) < lo or int(got[r].max()) >= hi):
            return f"row {r} drew outside client {i}'s rows"
    return None


@st.composite
def _anderson_args(draw):
    k, D = draw(st.integers(1, 5)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    R = torch.randn(k, D, dtype=dtype, generator=_gen(draw))
    kw = dict(residuals=R, reg=draw(st.floats(0, 1e-3)))
    if draw(st.integers(0, 2)) > 0:
        bad = R.clone()
        bad[-1, -1] = _NAN
        key = draw(st.sampled_from(["residuals", "reg"]))
        kw[key] = draw({"residuals": st.sampled_from([bad, R[0], R[:0], R.to(torch.int64)]),
                        "reg": st.sampled_from([-1.0, _NAN, "r"])}[key] | junk)
    return [], kw


def _anderson_steps(memory=3, reg=1e-8, safeguard=True, pairs=()):
    """Several Anderson steps on drawn (u, T(u)) pairs, against the reference backend's."""
    outs = []
    for impl in (None, "reference"):
        acc = O.Anderson(memory=memory, reg=reg, safeguard=safeguard)
        run = []
        for u, tu in pairs:
            if impl is None:
                run.append(acc.step(_copy(u), _copy(tu)))
            else:
                from pflcore import backend

                with backend.use("reference"):
                    run.append(acc.step(_copy(u), _copy(tu)))
        outs.append(run)
    return outs[0], outs[1]


@st.composite
def _anderson_step_args(draw):
    # Valid draws keep the least-squares problem well posed (D > memory + 1 random residuals, a
    # normal reg): an ill-posed one has many minimizers, and two correct solvers may pick others.
    memory, n = draw(st.integers(0, 4)), draw(st.integers(1, 6))
    D = draw(st.integers(memory + 2, memory + 6))
    dtype = torch.float64
    g = _gen(draw)
    pairs = [(torch.randn(D, dtype=dtype, generator=g), torch.randn(D, dtype=dtype, generator=g)) for _ in range(n)]
    kw = dict(memory=memory, reg=draw(st.floats(1e-10, 1e-4)), safeguard=draw(st.booleans()), pairs=pairs)
    if draw(st.integers(0, 2)) > 0:
        key = draw(st.sampled_from(["memory", "reg", "pairs"]))
        bad_pairs = [(torch.zeros(D, dtype=dtype), torch.full((D,), _NAN, dtype=dtype))]
        kw[key] = draw({"memory": BAD_INT, "reg": BAD_REAL,
                        "pairs": st.sampled_from([bad_pairs, [(torch.zeros(D), torch.zeros(D + 1))],
                                                  [(torch.zeros(D), "tu")], [(torch.zeros(D), torch.zeros(D)),
                                                                             (torch.zeros(D + 1), torch.zeros(D + 1))]])}[key])
    return [], kw


def _anderson_weights_check(answer, args, kwargs) -> Optional[str]:
    """π sums to 1 and reaches the reference's objective ‖Σ π_j r_j‖² + λ‖π‖² (with reg = 0 and
    fewer independent residuals than k, the minimizer is not unique: compare the minimum)."""
    got, want = (torch.as_tensor(np.asarray(a)).double() for a in answer)
    R = torch.as_tensor(np.asarray(kwargs["residuals"])).double()
    lam = float(kwargs.get("reg", 1e-8)) * float((R * R).sum())

    def objective(pi):
        return float(((pi @ R) ** 2).sum()) + lam * float((pi * pi).sum())
    if abs(float(got.sum()) - 1.0) > 1e-6:
        return f"the weights sum to {float(got.sum())}"
    a, b = objective(got), objective(want)
    if a > b * (1 + 1e-4) + 1e-6 * float((R * R).sum()):
        return f"objective {a} above the reference's {b}"
    return None


OPS: List[Target] = [
    Target("ops.local_steps", _local_steps_both, _local_steps_args(), _pair_check, examples=60, names=_OP_NAMES),
    Target("ops.gradients", _ref_of(O.gradients, O.gradients_ref), _model_op_args(True), _pair_check, examples=50,
           names=_OP_NAMES),
    Target("ops.evaluate", _ref_of(O.evaluate, O.evaluate_ref), _model_op_args(False), _pair_check, examples=50,
           names=_OP_NAMES),
    Target("ops.hvp", _ref_of(O.hvp, O.hvp_ref), _hvp_args(), _pair_check, examples=40, names=_OP_NAMES),
    Target("ops.sample_batches", _ref_of(O.sample_batches, O.sample_batches_ref), _sample_args(), _sample_check,
           examples=40, names=_OP_NAMES),
    Target("ops.kmeans_assign", _ref_of(O.kmeans_assign, O.kmeans_assign_ref), _points_args(False), _pair_check,
           examples=40, names=_OP_NAMES),
    Target("ops.kmeans", O.kmeans, _points_args(True), _kmeans_check, examples=40, names=_OP_NAMES),
    Target("ops.average", _ref_of(O.average, O.average_ref), _average_args(), _pair_check, examples=40,
           names=_OP_NAMES),
    Target("ops.clip_and_sum", _ref_of(O.clip_and_sum, O.clip_and_sum_ref), _clip_args(), _pair_check,
           examples=40, names=_OP_NAMES),
    Target("ops.anderson_weights", _ref_of(O.anderson_weights, O.anderson_weights_ref), _anderson_args(),
           _anderson_weights_check, examples=40, names=_OP_NAMES),
    Target("ops.Anderson", _anderson_steps, _anderson_step_args(), _pair_check, examples=30, names=_OP_NAMES),
]

TARGETS = {t.name: t for t in CONSTRUCTORS + ALGORITHMS + RUNS + OPS}

# Findings in code outside the suite's own files that are known and not fixed yet: an example
# whose failure matches one of its target's patterns is listed in a warning instead of failing the
# test; any other failure fails it. Empty: every finding so far has been fixed.
KNOWN: dict = {}


def execute(case: dict) -> dict:
    """Runs one case (in the worker): the outcome and, for a result, what its check found."""
    target = TARGETS[case["target"]]
    try:
        result = target.fn(*case["args"], **case["kwargs"])
    except ValueError as exc:
        return {"outcome": "ValueError", "type": type(exc).__name__, "message": str(exc), "problem": None}
    except Exception as exc:  # noqa: BLE001 - every other exception is what the suite looks for
        import traceback

        return {"outcome": "error", "type": type(exc).__name__, "message": str(exc),
                "problem": "".join(traceback.format_exception(exc)[-6:])}
    try:
        problem = target.check(result, case["args"], case["kwargs"]) if target.check else None
    except Exception as exc:  # noqa: BLE001
        import traceback

        problem = f"the check raised {type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-4:])
    return {"outcome": "ok", "type": None, "message": None, "problem": problem}
