"""The fault-tolerant process group: collectives across replica groups that end in an error, never a hang.

May import: ``groups.protocol`` (store keys) only.
"""
