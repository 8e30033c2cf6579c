"""SCOUT: faults named by strict-majority consensus, not guessed (docs/scout.md).

Owns signatures and votes (pure), a rank's witness duties, verified checkpoints, progress beacons and the hang
observer process (``[recover.localize]``). May import: ``groups`` (store keys), ``events``.
"""
