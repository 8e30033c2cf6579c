"""Replica groups: who is a member of which epoch, and the commit point every member agrees on.

Owns the coordinator (liveness judge, epoch former; a client of the job's store), a rank's membership client
(registration, heartbeats, epoch waits), what both sides share (``keys``: store keys, the fault flag, join and drop
records; ``protocol``: pure decisions; ``liveness``: heartbeats and the watch over them), and the step's
cross-replica reduction and commit barrier. The coordinator imports only ``keys``, ``protocol`` and ``liveness`` of
this package, never a rank's module. May import: ``stores`` (the job's store, opened by URL: ``stores.connect``),
``ftpg`` (the step's reduction only), ``phoenix.state_transfer`` (what an admission streams), ``events``.
"""
