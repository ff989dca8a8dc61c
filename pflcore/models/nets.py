"""Torch nets trained for all clients at once (DESIGN.md §3): ``MLP`` and ``CNN``.

A net has no native kernel. The ops (``ops.local_steps``, ``ops.gradients``, ``ops.evaluate``)
run it for every model row in one call with ``torch.func`` (``functional_call`` + ``vmap`` +
``grad``, ``pflcore/backends/nets.py``), on the same stacked parameters ``theta [m, d]`` as the GLMs.

Parameter layout: row θ_r is the concatenation, in ``module().named_parameters()`` order, of
every parameter flattened row-major, i.e. ``torch.nn.utils.parameters_to_vector(module.parameters())``
of the equivalent ``torch.nn`` module returned by ``net.module()``. For a Linear layer that is
its weight ``[out, in]`` then its bias ``[out]``; for a Conv2d layer its weight
``[out_ch, in_ch, k, k]`` then its bias ``[out_ch]``; layers in forward order.

Loss: cross-entropy of the logits over C classes; each client objective is
``f_i(θ) = mean loss over the client's rows + l2/2·‖θ‖²`` (every parameter, biases included,
as for the GLMs). Labels are int64 in ``[0, C)``.
"""
from __future__ import annotations

import copy
import math
import threading
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pflcore._checks import check_real

MAX_SIZE = 2**31 - 1


def _positive_int(value, name: str) -> int:
    # sizes past 2**31 could not be allocated anyway; bounded here so the error names the argument
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        raise ValueError(f"{name}: expected an integer in [1, {MAX_SIZE}], got {value!r}")
    return value


def _int_tuple(value, name: str, *, allow_empty: bool = True) -> Tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (tuple, list)) or (not value and not allow_empty):
        raise ValueError(f"{name}: expected an integer or a sequence of integers >= 1, got {value!r}")
    return tuple(_positive_int(v, f"{name}[{i}]") for i, v in enumerate(value))


class TorchNet:
    """Base class of the torch nets: the attributes the ops and algorithms read from a model
    (``p``, ``C``, ``d``, ``l2``, ``num_classes``, ``is_classifier``, ``family``, ``initial``,
    ``zeros``) and the pieces the ops call (``module``, ``param_shapes``, ``split``,
    ``logits``)."""

    family: str = ""
    is_classifier = True
    fit_intercept = True  # every layer has a bias (read by code written for the GLMs)

    def __init__(self, p: int, C: int, *, l2: float = 0.0):
        self.p = _positive_int(p, "p")
        self.C = _positive_int(C, "C")
        if self.C < 2:
            raise ValueError(f"C: a classifier net needs at least 2 classes, got {C!r}")
        self.l2 = check_real(l2, "l2", minimum=0.0)

    # ---- subclasses -------------------------------------------------------------------------

    def _build(self) -> nn.Module:
        raise NotImplementedError

    def _config(self) -> tuple:
        raise NotImplementedError

    def input_view(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x [B, p]`` as the module's input (``[B, p]`` for an MLP, images for a CNN)."""
        return x

    @property
    def activation_size(self) -> int:
        """Numbers a forward pass keeps per input row (layer outputs), to size work chunks."""
        raise NotImplementedError

    # ---- derived ----------------------------------------------------------------------------

    @property
    def num_classes(self) -> int:
        """Labels must lie in [0, num_classes)."""
        return self.C

    def module(self, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
        """A fresh ``torch.nn`` module computing the same function (its own default
        initialization; load a row with ``torch.nn.utils.vector_to_parameters(theta[r], m.parameters())``)."""
        return self._build().to(dtype=dtype, device=device)

    def _template(self) -> nn.Module:
        """A cached module whose parameters ``torch.func.functional_call`` replaces: one per
        thread, since functional_call swaps them on the module for the duration of the call
        (the ops run chunks of model rows on several threads). Each is a copy of one prototype
        built once, so no thread draws from the global RNG."""
        cache = self.__dict__.setdefault("_cache", {})
        if "prototype" not in cache:
            with torch.random.fork_rng(devices=[]):  # its throwaway init must not move the global RNG
                cache["prototype"] = self._build()
        local = cache.setdefault("templates", threading.local())
        if not hasattr(local, "module"):
            local.module = copy.deepcopy(cache["prototype"])
        return local.module

    @property
    def param_shapes(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(name, shape) of every parameter, in layout order."""
        cache = self.__dict__.setdefault("_cache", {})
        if "shapes" not in cache:
            cache["shapes"] = [(n, tuple(t.shape)) for n, t in self._template().named_parameters()]
        return cache["shapes"]

    @property
    def d(self) -> int:
        return sum(math.prod(s) for _, s in self.param_shapes)

    def split(self, theta: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Views ``{name: [R, *shape]}`` into the rows of ``theta [R, d]`` (no copy)."""
        out, o = {}, 0
        R = theta.shape[0]
        for name, shape in self.param_shapes:
            k = math.prod(shape)
            out[name] = theta[:, o:o + k].view(R, *shape)
            o += k
        return out

    def flatten(self, params: Dict[str, torch.Tensor]) -> torch.Tensor:
        """``[R, d]`` from ``{name: [R, *shape]}`` (the inverse of ``split``; a copy)."""
        return torch.cat([params[n].reshape(params[n].shape[0], -1) for n, _ in self.param_shapes], dim=1)

    def logits(self, params: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C]`` of ONE model (params ``{name: shape}``) on rows ``x [B, p]``; the
        ops vmap this over model rows."""
        return torch.func.functional_call(self._template(), params, (self.input_view(x),))

    def row_losses(self, params: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of every row ``[B]`` of one model."""
        return F.cross_entropy(self.logits(params, x), y, reduction="none")

    # ---- parameters of m models -------------------------------------------------------------

    def zeros(self, m: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        """``[m, d]`` all-zero parameters (a saddle of a net: use ``initial`` to train)."""
        return torch.zeros(m, self.d, dtype=dtype, device=device)

    def initial(self, m: int, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> torch.Tensor:
        """``[m, d]``: m copies of ONE random initialization drawn from ``seed``.

        Every weight and bias of a layer with fan-in k is drawn from U(−1/√k, 1/√k) (PyTorch's
        default for Linear and Conv2d), in float64 from a ``torch.Generator`` seeded with
        ``seed`` on the CPU and then rounded to ``dtype``: the same seed gives the same start
        on every device and thread count, and the global RNG is not touched.
        """
        m = _positive_int(m, "m")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
        g = torch.Generator().manual_seed(seed)
        parts = []
        for name, shape in self.param_shapes:
            bound = 1.0 / math.sqrt(self._fan_in(name))
            parts.append((torch.rand(math.prod(shape), generator=g, dtype=torch.float64) * 2 - 1) * bound)
        row = torch.cat(parts).to(dtype)
        return row.to(device).expand(m, self.d).contiguous()

    def _fan_in(self, name: str) -> int:
        layer = name.rsplit(".", 1)[0]
        w = dict(self.param_shapes)[f"{layer}.weight"]
        return math.prod(w[1:])

    # ---- identity ---------------------------------------------------------------------------

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_cache", None)  # modules are rebuilt on first use
        return state

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._config() == other._config()

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._config())


class MLP(TorchNet):
    """Fully connected net: ``p → hidden[0] → … → hidden[-1] → C`` with ReLU between layers
    (none after the last), trained with cross-entropy. ``hidden = ()`` is multinomial logistic
    regression (weight ``[C, p]`` then bias ``[C]``).

    pFedMe's DNN on MNIST is ``MLP(784, 100, 10)`` (d = 79,510); CGPFL's is ``MLP(784, 128, 10)``.
    """

    family = "mlp"

    def __init__(self, p: int, hidden=100, C: int = 10, *, l2: float = 0.0):
        super().__init__(p, C, l2=l2)
        self.hidden = _int_tuple(hidden, "hidden")

    def _build(self) -> nn.Module:
        sizes = (self.p,) + self.hidden + (self.C,)
        layers: List[nn.Module] = []
        for j in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[j], sizes[j + 1]))
            if j < len(sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def _config(self) -> tuple:
        return (self.p, self.hidden, self.C, self.l2)

    @property
    def activation_size(self) -> int:
        return 2 * sum(self.hidden) + 2 * self.C

    def __repr__(self) -> str:
        return f"MLP(p={self.p}, hidden={list(self.hidden)}, C={self.C}, l2={self.l2})"


class CNN(TorchNet):
    """Convolutional net on rows reshaped to images ``[channels, height, width]``.

    The default is the MNIST model of "A Unifying Framework for Federated Learning", Table 1
    (11,910 parameters)::

        input (1, 28, 28) → Conv2d(1→10, 5×5) ReLU → MaxPool 2 → Conv2d(10→20, 5×5) ReLU
        → MaxPool 2 → flatten 320 → Linear(320→20) ReLU → Linear(20→10)

    Args:
        p: features per row; ``image_shape`` defaults to ``(1, s, s)`` with s² = p (28×28 MNIST,
            8×8 scikit-learn digits).
        C: classes.
        channels: output channels of the conv layers (each followed by ReLU and max-pooling).
        kernel_size, padding: of every conv layer (stride 1); pool: the max-pool window and
            stride. For 8×8 digits use e.g. ``kernel_size=3, padding=1`` (8 → 4 → 2).
        hidden: sizes of the fully connected layers after flattening (ReLU after each).
    """

    family = "cnn"

    def __init__(self, p: int = 784, C: int = 10, *, image_shape: Sequence[int] = None, channels=(10, 20),
                 kernel_size: int = 5, pool: int = 2, padding: int = 0, hidden=(20,), l2: float = 0.0):
        super().__init__(p, C, l2=l2)
        if image_shape is None:
            side = math.isqrt(self.p)
            if side * side != self.p:
                raise ValueError(f"image_shape: p = {self.p} is not a square number of pixels; pass "
                                 f"image_shape=(channels, height, width)")
            image_shape = (1, side, side)
        self.image_shape = _int_tuple(image_shape, "image_shape")
        if len(self.image_shape) != 3 or math.prod(self.image_shape) != self.p:
            raise ValueError(f"image_shape: expected (channels, height, width) with product p = {self.p}, "
                             f"got {tuple(image_shape)!r}")
        self.channels = _int_tuple(channels, "channels", allow_empty=False)
        self.kernel_size = _positive_int(kernel_size, "kernel_size")
        self.pool = _positive_int(pool, "pool")
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"padding: expected an integer >= 0, got {padding!r}")
        self.padding = padding
        self.hidden = _int_tuple(hidden, "hidden")
        h, w = self.image_shape[1:]
        act = 0
        for j, cout in enumerate(self.channels):  # spatial size after each conv + pool
            h, w = h + 2 * padding - kernel_size + 1, w + 2 * padding - kernel_size + 1
            act += 2 * cout * h * w + cout * (h // self.pool) * (w // self.pool)
            if h < 1 or w < 1 or h // self.pool < 1 or w // self.pool < 1:
                raise ValueError(f"kernel_size: conv layer {j} (kernel {kernel_size}, padding {padding}, pool "
                                 f"{pool}) leaves no pixels of the {self.image_shape} input; use a smaller "
                                 f"kernel, more padding or fewer conv layers")
            h, w = h // self.pool, w // self.pool
        self.flat_features = self.channels[-1] * h * w
        self._activations = act + 2 * sum(self.hidden) + 2 * C

    @property
    def activation_size(self) -> int:
        return self._activations

    def input_view(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[:-1] + self.image_shape)

    def _build(self) -> nn.Module:
        layers: List[nn.Module] = []
        cin = self.image_shape[0]
        for cout in self.channels:
            layers += [nn.Conv2d(cin, cout, self.kernel_size, padding=self.padding), nn.ReLU(), nn.MaxPool2d(self.pool)]
            cin = cout
        layers.append(nn.Flatten())
        sizes = (self.flat_features,) + self.hidden + (self.C,)
        for j in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[j], sizes[j + 1]))
            if j < len(sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def _config(self) -> tuple:
        return (self.p, self.C, self.image_shape, self.channels, self.kernel_size, self.pool, self.padding,
                self.hidden, self.l2)

    def __repr__(self) -> str:
        return (f"CNN(p={self.p}, C={self.C}, image_shape={self.image_shape}, channels={list(self.channels)}, "
                f"kernel_size={self.kernel_size}, pool={self.pool}, padding={self.padding}, "
                f"hidden={list(self.hidden)}, l2={self.l2})")
