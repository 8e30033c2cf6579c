"""The fault-tolerant process group: collectives across replica groups that end in an error, never a hang.

Owns the contract (``base``: :class:`FaultTolerantGroup`, :class:`FaultDetected`), the registry of backends, the
``[recover.ftpg]`` section and :func:`build_group`, and the backends (``gloo``: polled gloo collectives). Every
module of this package is imported with it, so a backend registers by being here (docs/configuration.md).
May import: ``groups.keys`` (store keys, the fault flag), ``registry``.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
