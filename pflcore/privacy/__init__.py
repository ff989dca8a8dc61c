"""Client-level differential privacy (issue 27): the run setting ``Privacy``, the accounting
(``epsilon``, ``noise_multiplier_for`` over Google's dp-accounting) and, in ``pflcore.ops``, the
batched mechanism ``clip_and_sum``."""
from pflcore.privacy.accounting import epsilon, noise_multiplier_for
from pflcore.privacy.mechanism import Mechanism, Privacy

__all__ = ["Privacy", "Mechanism", "epsilon", "noise_multiplier_for"]
