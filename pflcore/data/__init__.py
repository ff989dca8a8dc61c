"""Client data: the ragged layout (DESIGN.md §2) and, later, generators and data sets (§6)."""
from pflcore.data.client_data import ClientData

__all__ = ["ClientData"]
