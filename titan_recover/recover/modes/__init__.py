"""Training modes (``[recover] mode``): how TorchTitan's step becomes a resilient one, registered by name.

A mode is built by the trainer from its config sections and wires the components of the other packages into
TorchTitan's step; it is the only package that imports them all. Nothing imports a mode but the trainer.
"""
