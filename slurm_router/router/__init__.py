"""Pure routing core: which device computes which samples of a global batch, in how many micro-batches.

No torch here (policies are pure functions over lengths and device state); see docs/design/router.md, "The router".
"""

from .memory_model import MemoryModel
from .packing import sample_costs, split_for_oom
from .policies import POLICIES, affinity, balanced, least_loaded, round_robin
from .router import Router
from .speed_model import SpeedModel
from .types import POLICY_NAMES, Assignment, DeviceState, MicroBatch, RouterSettings

__all__ = [
    "Assignment",
    "DeviceState",
    "MemoryModel",
    "MicroBatch",
    "POLICIES",
    "POLICY_NAMES",
    "Router",
    "RouterSettings",
    "SpeedModel",
    "affinity",
    "balanced",
    "least_loaded",
    "round_robin",
    "sample_costs",
    "split_for_oom",
]
