"""The exceptions pflcore raises across its packages (public: catch them by these names).

Every bad argument is a ``ValueError`` naming the argument, the expected and the actual value;
the classes below refine it or name failures that are not about an argument.
"""
from __future__ import annotations


class NonFiniteError(ValueError):
    """An argument holds NaN or infinite values (inside a training run: a divergence)."""


class BackendUnavailable(RuntimeError):
    """A backend that was asked for by name cannot run the call; the message says why."""


class CudaKernelError(RuntimeError):
    """A kernel of pflcore._core_cuda could not be launched (or a CUDA call around it failed)."""


__all__ = ["NonFiniteError", "BackendUnavailable", "CudaKernelError"]
