"""What an experiment file may say, checked before anything runs (``pflcore run``).

``check(cfg)`` walks a parsed experiment (TOML file plus ``key=value`` overrides) and raises
``ConfigError`` (a ``ValueError``) naming the dotted key: an unknown key comes with the closest
known one ("unknown key 'roundz' (did you mean 'rounds'?)"), a value of the wrong type with the
expected type. The keys a ``[data]``, ``[model]`` or ``[algorithms.X]`` table accepts are the
parameters of the generator, model class or algorithm class it names, so a new algorithm needs
no entry here. Values the callee validates itself (ranges, strings with meanings) are left to
it; ``pflcore.experiments`` prefixes its errors with the table they came from.
"""
from __future__ import annotations

from dataclasses import fields as dataclass_fields

import difflib
import importlib
import inspect
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from pflcore import algorithms as A
from pflcore._checks import MAX_COUNT
from pflcore import models as M


class ConfigError(ValueError):
    """A bad experiment configuration; ``key`` is the dotted key at fault (or None)."""

    def __init__(self, message: str, key: Optional[str] = None):
        super().__init__(message)
        self.key = key


# Metrics the round loop records (pflcore.run.evaluate_round), and "acc": the accuracy of the
# model each client uses (its personalized model, else the global model).
METRICS = ("acc", "personalized_acc", "personalized_acc_std", "personalized_acc_p10", "personalized_loss",
           "global_acc", "global_acc_std", "global_acc_p10", "global_loss", "train_loss", "stat_error_local",
           "stat_error_global", "optimality_gap", "residual", "seconds", "client_steps_per_s",
           "bytes_sent_per_round", "epsilon", "clip_norm")

MODEL_FAMILIES = {"softmax": M.Softmax, "logistic": M.Logistic, "least_squares": M.LeastSquares, "mlp": M.MLP,
                  "cnn": M.CNN}
# Keys of an [algorithms.X] table that are not the algorithm's own parameters.
ALGORITHM_EXTRAS = ("type", "model", "anderson", "anderson_reg", "private")
# String values some numeric parameters accept (pflcore.experiments.build_algorithm).
SPECIAL_STRINGS = {("fedprox", "lam"): ("adaptive",), ("fedprox", "local_lr"): ("auto",)}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _got(value: Any) -> str:
    return f"got {value!r} ({_kind(value)})"


def suggest(word: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _qualified(hint: str, prefix: str) -> str:
    """``(did you mean 'rounds'?)`` with the table's prefix on the suggestion."""
    if hint.startswith(" (did you mean '"):
        return f" (did you mean '{prefix}{hint[len(' (did you mean ' + chr(39)):]}"
    return hint


# ---- value types ------------------------------------------------------------------------------

def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_count(v, minimum: int = 0) -> bool:
    """An integer in [minimum, MAX_COUNT]: every count of an experiment (rounds, clients, steps,
    sizes) has the ops' bound, so a typo such as 99999999999999999999 is refused, not run."""
    return is_int(v) and minimum <= v <= MAX_COUNT


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _expect(ok: bool, key: str, what: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: expected {what}, {_got(value)}", key=key)


def _list_of(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(pred(x) for x in v)


TOP: Dict[str, tuple] = {  # key: (check, description)
    "name": (lambda v: isinstance(v, str), "a string"),
    "description": (lambda v: isinstance(v, str), "a string"),
    "rounds": (is_count, f"an integer in [0, {MAX_COUNT}]"),
    "clients_per_round": (lambda v: is_count(v, 1), f"an integer in [1, {MAX_COUNT}]"),
    "eval_every": (lambda v: is_count(v, 1), f"an integer in [1, {MAX_COUNT}]"),
    "seeds": (lambda v: isinstance(v, list) and len(v) > 0 and all(is_int(x) and 0 <= x < 2**64 for x in v),
              "a non-empty array of integers >= 0 and < 2**64 (e.g. seeds = [0, 1, 2])"),
    "out": (lambda v: isinstance(v, str), "a string (a folder)"),
    "metrics": (_list_of(lambda x: isinstance(x, str)), "an array of metric names"),
    "plot": (_list_of(lambda x: isinstance(x, str)), "an array of metric names"),
    "data": (lambda v: isinstance(v, dict), "a table"),
    "model": (lambda v: isinstance(v, dict), "a table"),
    "algorithms": (lambda v: isinstance(v, dict) and len(v) > 0, "a table of one table per algorithm"),
    "sweep": (lambda v: isinstance(v, dict), "a table"),
    "privacy": (lambda v: isinstance(v, dict), "a table (pflcore.Privacy's settings: clip_norm, noise_multiplier or "
                                               "epsilon, delta, sampling, accountant, adaptive ...)"),
}
SWEEP: Dict[str, tuple] = {
    "key": (lambda v: isinstance(v, str) and v != "", "a dotted key (e.g. \"data.R\")"),
    "values": (lambda v: isinstance(v, list) and len(v) > 0, "a non-empty array"),
    "metric": (lambda v: isinstance(v, str), "a metric name"),
    "log_y": (lambda v: isinstance(v, bool), "true or false"),
}
TABLES = ("data", "model", "algorithms", "sweep", "privacy")  # top-level keys that hold tables


def _annotation_check(annotation: Any) -> Optional[tuple]:
    """(check, description) from a parameter's annotation, for the simple types; None = let the
    callee check it."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = text.replace("typing.", "")
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional["):-1]
    bounded = (lambda v: is_int(v) and -MAX_COUNT <= v <= MAX_COUNT, f"an integer in [-{MAX_COUNT}, {MAX_COUNT}]")
    return {"int": bounded, "float": (is_number, "a number"), "bool": (lambda v: isinstance(v, bool),
            "true or false"), "str": (lambda v: isinstance(v, str), "a string")}.get(text)


def parameters(fn: Callable, *, skip: Sequence[str] = ()) -> Dict[str, inspect.Parameter]:
    """The keyword parameters of ``fn`` (a class: of its constructor), following ``**kwargs``
    into the base class' constructor (the grand scheme's presets)."""
    sig = inspect.signature(fn)
    out = {k: p for k, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) and inspect.isclass(fn):
        for base in fn.__mro__[1:]:
            if "__init__" in vars(base) and base is not object:
                inherited = parameters(base)
                # A preset `__init__(self, eta, **kw)` that calls `super().__init__(a, b, c, eta, **kw)`
                # fixes the base's parameters before its own first one: those are not its to take.
                order = list(inherited)
                first = min((order.index(k) for k in out if k in order), default=0)
                out = {**{k: v for k, v in inherited.items() if order.index(k) >= first}, **out}
                break
    return {k: p for k, p in out.items() if k not in skip and k != "self"}


def _check_table(table: Dict[str, Any], params: Dict[str, inspect.Parameter], where: str, extras: Sequence[str] = (),
                 special: Optional[Dict[str, Sequence[str]]] = None) -> None:
    known = list(params) + list(extras)
    for key, value in table.items():
        if key in extras:
            continue
        if key not in params:
            raise unknown_key(where, key, known)
        if special and key in special and value in special[key]:
            continue
        check = _annotation_check(params[key].annotation)
        if key == "seed" and check is not None and check[0](0):  # a seed is not a count: run takes [0, 2**64)
            check = (lambda v: is_int(v) and 0 <= v < 2**64, "an integer in [0, 2**64)")
        if check is not None:
            ok, what = check
            if special and key in special:
                what += " or " + " or ".join(repr(s) for s in special[key])
            _expect(ok(value), f"{where}.{key}", what, value)


def unknown_key(where: str, name: str, known: Sequence[str]) -> ConfigError:
    prefix = f"{where}." if where else ""
    return ConfigError(f"unknown key '{prefix}{name}'{_qualified(suggest(name, known), prefix)}", key=prefix + name)


def check_data(spec: Dict[str, Any], generators: Dict[str, Callable]) -> None:
    name = spec.get("generator")
    if name is None:
        raise ConfigError(f"data.generator: missing; expected one of {', '.join(sorted(generators))}",
                          key="data.generator")
    if not isinstance(name, str) or name not in generators:
        hint = suggest(str(name), generators)
        raise ConfigError(f"data.generator: unknown generator {name!r}{hint or ''}; known: "
                          f"{', '.join(sorted(generators))}", key="data.generator")
    params = parameters(generators[name])
    spec = {k: v for k, v in spec.items() if k != "generator"}
    for key, p in params.items():  # no default: the readers' root, synthetic's alpha and beta
        if p.default is inspect.Parameter.empty and key not in spec:
            what = f'{key} = "<folder>" (the folder holding its files)' if key == "root" else f"{key} (no default)"
            raise ConfigError(f"data.{key}: missing; the {name} generator needs {what}", key=f"data.{key}")
    if "dtype" in spec:
        _expect(spec["dtype"] in ("float32", "float64"), "data.dtype", "\"float32\" or \"float64\"", spec["dtype"])
        spec.pop("dtype")
    _check_table(spec, params, "data", extras=("generator",))


def check_model(spec: Any, where: str) -> None:
    _expect(isinstance(spec, dict), where, "a table", spec)
    family = spec.get("family", "softmax")
    if not isinstance(family, str) or family not in MODEL_FAMILIES:
        raise ConfigError(f"{where}.family: unknown model family {family!r}{suggest(str(family), MODEL_FAMILIES)}; "
                          f"known: {', '.join(MODEL_FAMILIES)}", key=f"{where}.family")
    # p and C come from the data; "hidden" may be an integer or an array for the nets
    params = parameters(MODEL_FAMILIES[family], skip=("p", "C"))
    _check_table({k: v for k, v in spec.items() if k != "family"}, params, where, extras=("family",))


# Installed packages register algorithms under this entry point group (pyproject.toml:
# [project.entry-points."pflcore.algorithms"] fedrep = "fedrep_alg:FedRep"); their names are
# accepted by `type` like the built-in ones.
ENTRY_POINT_GROUP = "pflcore.algorithms"


def _normal(name: str) -> str:
    """The form a name of ``type`` is compared in: "Per-FedAvg", "per_fedavg" and "perfedavg" alike."""
    return name.lower().replace("-", "").replace("_", "")


def is_import_path(kind: str) -> bool:
    """``"package.module:Class"``: a class to import rather than a registered name."""
    return ":" in kind


def algorithm_kind(label: str, spec: Dict[str, Any]) -> str:
    """The registered name ``type`` (else the label) names, normalized; an import path
    ("package.module:Class") as written, modules and classes being case-sensitive."""
    kind = str(spec.get("type", label))
    return kind.strip() if is_import_path(kind) else _normal(kind)


def _entry_points() -> Dict[str, List[Any]]:
    """Normalized name -> the entry points of group ``pflcore.algorithms`` of that name (read
    anew each time: a package installed meanwhile counts; not loaded: loading imports it)."""
    from importlib import metadata

    try:
        found = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python 3.9: a dict of groups
        found = metadata.entry_points().get(ENTRY_POINT_GROUP, [])
    out: Dict[str, List[Any]] = {}
    for ep in found:
        out.setdefault(_normal(ep.name), [])
        if all(e.value != ep.value for e in out[_normal(ep.name)]):  # one dist seen on two paths: once
            out[_normal(ep.name)].append(ep)
    return out


def _as_algorithm(obj: Any, key: str, source: str) -> type:
    if not (inspect.isclass(obj) and issubclass(obj, A.Algorithm)):
        raise ConfigError(f"{key}: {source} is {obj!r}, expected a subclass of pflcore.algorithms.base.Algorithm "
                          "(init, round, personalized/global_model)", key=key)
    return obj


def import_algorithm(path: str, key: str) -> type:
    """The Algorithm subclass ``"package.module:Class"`` names (``Class`` may be dotted: a nested
    class), imported with importlib; a ConfigError naming ``key`` when the module cannot be
    imported, has no such attribute, or it is not an Algorithm."""
    module_name, _, qualname = path.partition(":")
    module_name, qualname = module_name.strip(), qualname.strip()
    if not module_name or not qualname or ":" in qualname:
        raise ConfigError(f"{key}: expected an algorithm name or an import path \"package.module:Class\", got {path!r}",
                          key=key)
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # not found, or the module itself fails (SyntaxError, NameError ...) on import
        raise ConfigError(f"{key}: cannot import the module {module_name!r} of {path!r} ({type(exc).__name__}: "
                          f"{exc}); expected \"package.module:Class\" with the module installed or on the Python "
                          "path (PYTHONPATH)", key=key) from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: the module {module_name!r} has no {qualname!r} (from {path!r})", key=key)
        obj = getattr(obj, part)
    return _as_algorithm(obj, key, repr(path))


def algorithm_class(label: str, spec: Dict[str, Any]) -> type:
    """The Algorithm class the table ``[algorithms.<label>]`` names by ``type`` (else by its
    label): a built-in name, an installed package's entry point (group ``pflcore.algorithms``),
    or an import path "package.module:Class". A built-in name takes precedence over an entry
    point of the same name (with a warning: the package's class is not the one run)."""
    key = f"algorithms.{label}.type"
    kind = algorithm_kind(label, spec)
    if is_import_path(kind):
        return import_algorithm(kind, key)
    plugins = _entry_points()
    if kind in A.REGISTRY:
        if kind in plugins:
            warnings.warn(f"{key}: {kind!r} is a built-in algorithm and also the entry point "
                          f"{plugins[kind][0].value!r} of group {ENTRY_POINT_GROUP!r}: the built-in one runs "
                          "(name the package's class by its import path to run it)", RuntimeWarning, stacklevel=2)
        return A.REGISTRY[kind]
    if kind in plugins:
        if len(plugins[kind]) > 1:
            raise ConfigError(f"{key}: {kind!r} is registered by several packages (entry points "
                              f"{', '.join(repr(e.value) for e in plugins[kind])} of group {ENTRY_POINT_GROUP!r}); "
                              "name the one to run by its import path \"package.module:Class\"", key=key)
        ep = plugins[kind][0]
        try:
            obj = ep.load()
        except Exception as exc:  # the package is broken or half-installed: say which entry point
            raise ConfigError(f"{key}: cannot load the entry point {ep.name} = {ep.value!r} of group "
                              f"{ENTRY_POINT_GROUP!r} ({type(exc).__name__}: {exc})", key=key) from None
        return _as_algorithm(obj, key, f"the entry point {ep.name} = {ep.value!r}")
    known = sorted(set(A.REGISTRY) | set(plugins))
    what = f"type = {spec['type']!r}" if "type" in spec else f"no type, and the label {label!r} names none"
    raise ConfigError(f"{key}: unknown algorithm ({what}){suggest(kind, known)}; known: {', '.join(known)}, or an "
                      "import path \"package.module:Class\"", key=key)


def check_algorithm(label: str, spec: Any) -> None:
    where = f"algorithms.{label}"
    _expect(isinstance(spec, dict), where, "a table (e.g. [algorithms.FedAvg] with type = \"fedavg\")", spec)
    kind = algorithm_kind(label, spec)
    cls = algorithm_class(label, spec)
    if "anderson" in spec:
        _expect(is_int(spec["anderson"]) and spec["anderson"] >= 1, f"{where}.anderson",
                "an integer >= 1 (the Anderson memory)", spec["anderson"])
    if "anderson_reg" in spec:
        _expect(is_number(spec["anderson_reg"]), f"{where}.anderson_reg", "a number", spec["anderson_reg"])
    if "model" in spec:
        check_model(spec["model"], f"{where}.model")
    special = {k[1]: v for k, v in SPECIAL_STRINGS.items() if k[0] == kind}
    _check_table(spec, parameters(cls), where, extras=ALGORITHM_EXTRAS, special=special)


def check(cfg: Dict[str, Any], generators: Dict[str, Callable]) -> None:
    """Raises ConfigError for the first unknown key or ill-typed value of an experiment."""
    for key, value in cfg.items():
        if key not in TOP:
            raise unknown_key("", key, list(TOP))
        ok, what = TOP[key]
        _expect(ok(value), key, what, value)
    for key in ("rounds", "algorithms", "data"):
        if key not in cfg:
            raise ConfigError(f"{key}: missing (an experiment needs rounds, [data] and [algorithms.NAME] tables)",
                              key=key)
    for key in ("metrics", "plot"):
        for name in cfg.get(key, []):
            if name not in METRICS:
                raise ConfigError(f"{key}: unknown metric {name!r}{suggest(name, METRICS)}", key=key)
    check_data(cfg["data"], generators)
    if "model" in cfg:
        check_model(cfg["model"], "model")
    for label, spec in cfg["algorithms"].items():
        check_algorithm(label, spec)
    if "privacy" in cfg:
        privacy_settings(cfg["privacy"])
    for label, spec in cfg["algorithms"].items():
        if "private" in spec and not isinstance(spec["private"], bool):
            _expect(False, f"algorithms.{label}.private", "true or false (false: this algorithm runs without the "
                    "[privacy] setting)", spec["private"])
    sweep = cfg.get("sweep")
    if sweep is not None:
        for key, value in sweep.items():
            if key not in SWEEP:
                raise unknown_key("sweep", key, list(SWEEP))
            ok, what = SWEEP[key]
            _expect(ok(value), f"sweep.{key}", what, value)
        for key in ("key", "values"):
            if key not in sweep:
                raise ConfigError(f"sweep.{key}: missing (a sweep needs key and values)", key=f"sweep.{key}")
        if "metric" in sweep and sweep["metric"] not in METRICS:
            raise ConfigError(f"sweep.metric: unknown metric {sweep['metric']!r}{suggest(sweep['metric'], METRICS)}",
                              key="sweep.metric")


def privacy_settings(table: Dict[str, Any]):
    """``pflcore.Privacy`` from an experiment's [privacy] table (ConfigError naming the key)."""
    from pflcore.privacy import Privacy
    known = [f.name for f in dataclass_fields(Privacy)]
    for key in table:
        if key not in known:
            raise unknown_key("privacy", key, known)
    try:
        return Privacy(**table)
    except ValueError as exc:
        raise ConfigError(str(exc), key="privacy") from None


def set_key(cfg: Dict[str, Any], key: str, value: Any, *, strict: bool = True) -> None:
    """``cfg[a][b][c] = value`` for ``key = "a.b.c"``. Strict (command-line overrides): the
    tables on the way must exist or be tables an experiment may add (``sweep``, ``model``, an
    algorithm's ``model``), so a misspelt table is an error rather than a new table."""
    parts = key.strip().split(".")
    if any(p == "" for p in parts):
        raise ConfigError(f"{key!r}: expected a dotted key such as rounds or algorithms.FedAvg.lr", key=key)
    node: Dict[str, Any] = cfg
    for i, part in enumerate(parts[:-1]):
        path = ".".join(parts[: i + 1])
        if part not in node:
            creatable = (i == 0 and part in TABLES) or (i == 2 and parts[0] == "algorithms" and part == "model")
            if strict and not creatable:
                if i == 0:
                    raise unknown_key("", part, list(TOP))
                if parts[0] == "algorithms" and i == 1:
                    raise ConfigError(f"unknown algorithm '{part}' in algorithms.{part}{suggest(part, node)}; this "
                                      f"experiment has {', '.join(node) or 'none'}", key=path)
                raise unknown_key(".".join(parts[:i]), part, list(node))
            node[part] = {}
        elif not isinstance(node[part], dict):
            raise ConfigError(f"{key}: '{path}' is {_kind(node[part])} ({node[part]!r}), not a table, so it has no "
                              f"key '{parts[i + 1]}'", key=path)
        node = node[part]
    node[parts[-1]] = value


def parse_value(raw: str) -> Any:
    """A TOML value (number, boolean, string, array, inline table), or the text itself."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(cfg: Dict[str, Any], overrides: List[str], *, strict: bool = True) -> Dict[str, Any]:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. rounds=50)")
        key, raw = item.split("=", 1)
        try:
            set_key(cfg, key, parse_value(raw), strict=strict)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in the override {item!r})", key=exc.key) from None
    return cfg
