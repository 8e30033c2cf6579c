"""``[recover]``: configuration of the resilience layer.

A real section of the trainer's config (strictly parsed, printed by ``--print-config``, saved with the run) that
holds no settings yet: with no ``[recover]`` settings a run is plain TorchTitan training. The coordinator,
fault-tolerant groups, quota policies and recovery settings arrive here as they are built.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RecoverConfig:
    """``[recover]``: resilience settings (none yet; an unknown key here is an error like anywhere else)."""
