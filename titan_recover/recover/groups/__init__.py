"""Replica groups: who is a member of which epoch, and the commit point every member agrees on.

Owns the coordinator process (store host, liveness judge, epoch former), a rank's membership client (registration,
heartbeats, epoch waits), the store keys and pure decisions they share, and the step's cross-replica reduction and
commit barrier. May import: ``ftpg``, ``phoenix.state_transfer`` (what an admission streams), ``events``.
"""
