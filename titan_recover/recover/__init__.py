"""The resilience layer: replica groups, fault-tolerant reduction, in-step recovery (see docs/)."""

from titan_recover.recover.config import RecoverConfig

__all__ = ["RecoverConfig"]
