"""Fault injection (``[chaos]``): faults at a replica, rank, step and phase, or a wall-clock offset, registered by
kind. Acts at the edges (hooks, the step's phases); production code never reads its state. May import: ``events``,
``registry``.
"""
