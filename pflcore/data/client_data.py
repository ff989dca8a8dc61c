"""``ClientData`` lives in ``pflcore.client_data`` (below both the ops and the data package);
this name stays so that objects pickled before the move still load."""
from pflcore.client_data import ClientData

__all__ = ["ClientData"]
