"""titan_recover: resilient LLM pre-training on TorchTitan.

Importing the package imports nothing from TorchTitan: the device has to be chosen
(:mod:`titan_recover.platform`) before TorchTitan's trainer is imported.
"""

__version__ = "0.1.0"
