"""Two group members' calls run side by side in threads of the test process (tests/test_ftpg.py,
tests/test_overlap.py)."""

from __future__ import annotations

import threading
import time


def run_both(fn_0, fn_1, timeout_s: float = 120.0) -> tuple[dict[int, object], float]:
    """Each member's result (or the error it raised) by member, and the wall time of the slower; a member still
    running after ``timeout_s`` fails the test."""
    results: dict[int, object] = {}
    start = time.monotonic()

    def run(key, fn):
        try:
            results[key] = fn()
        except Exception as error:  # handed to the test
            results[key] = error

    threads = [threading.Thread(target=run, args=(k, f), daemon=True) for k, f in ((0, fn_0), (1, fn_1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, timeout_s - (time.monotonic() - start)))
    assert not any(t.is_alive() for t in threads), f"a member's call did not return within {timeout_s} s"
    return results, time.monotonic() - start
