"""pflcore: a fast core for personalized federated learning research.

Every simulated client is a row of a batch: the data of all clients is one ragged array
(``ClientData``) and the models of all clients one ``[m, d]`` matrix, so one kernel call runs a
local step for thousands of clients. Compiled backends load lazily (``pflcore.backend``).
"""
__version__ = "0.1.0"

from pflcore import algorithms, backend, data, models, ops  # noqa: E402
from pflcore.client_data import ClientData  # noqa: E402
from pflcore.data.federation import Federation  # noqa: E402
from pflcore.privacy import Privacy  # noqa: E402
from pflcore.result import Result  # noqa: E402
from pflcore.run import DivergenceError, resume, run  # noqa: E402
from pflcore.backend import get_num_threads, set_num_threads  # noqa: E402

__all__ = ["ClientData", "DivergenceError", "Federation", "Privacy", "Result", "algorithms", "backend", "data",
           "models", "ops", "get_num_threads", "resume", "run", "set_num_threads", "__version__"]
