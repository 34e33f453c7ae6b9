"""The data plane: executes the directory's plans on bounded thread pools and reports every step.

`mover` holds the pools, the store queue and the entry points; `handlers` one handler per (source medium,
destination medium); `shared` the batched traffic of a shared tier; `copy` the bit-exact byte copies between
the caller's tensors and host slots; `pages` an engine's KV pages, whose batches move as plain memory copies.
"""

from kvtier.mover.copy import CallerBlock
from kvtier.mover.handlers import Reporter
from kvtier.mover.mover import Loaded, Mover

__all__ = ["CallerBlock", "Loaded", "Mover", "Reporter"]
