"""Model families. GLMs run in the native kernels (DESIGN.md §3)."""
from pflcore.models.glm import GLM, LeastSquares, Logistic, Softmax

__all__ = ["GLM", "LeastSquares", "Logistic", "Softmax"]
