"""The diloco syncer process: global parameters, the outer optimizer, and the merges (docs/diloco.md).

``python -m titan_recover.recover.diloco.syncer`` runs :mod:`.__main__` (the launcher starts it). Modules:
:mod:`.service` the :class:`Syncer` (start, loop, merge, end), :mod:`.inbox` deltas read from its store,
:mod:`.rounds` each fragment's round and when it merges, :mod:`.global_model` the global fragments and outer
optimizers, :mod:`.liveness` which learners are expected, :mod:`.checkpoint` its files, :mod:`.metrics` progress
and metrics, :mod:`.evaluation` the validation loss.
"""
