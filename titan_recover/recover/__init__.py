"""The resilience layer, one package per concern (docs/architecture.md).

``modes/`` wires the others into TorchTitan's step and is imported only by the trainer; ``invariant/``,
``phoenix/``, ``scout/``, ``diloco/`` and ``chaos/`` are components that import ``groups/`` and ``ftpg/`` below
them, never a mode; ``config.py`` composes the ``[recover]`` section from the sections declared next to each
component. This module imports nothing, so that importing one package loads only what it uses.
"""
