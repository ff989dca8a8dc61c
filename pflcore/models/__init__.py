"""Model families. GLMs run in the native kernels; torch nets run through torch.func, vmapped
over the model rows (DESIGN.md §3)."""
from pflcore.models.glm import GLM, LeastSquares, Logistic, Softmax
from pflcore.models.nets import CNN, MLP, TorchNet

__all__ = ["CNN", "GLM", "LeastSquares", "Logistic", "MLP", "Softmax", "TorchNet"]
