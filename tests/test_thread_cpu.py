"""scripts/thread_cpu.py: the CPU time of named threads of a run's processes, found from /proc."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import thread_cpu  # noqa: E402

CHILD = textwrap.dedent("""
    import ctypes, hashlib, sys, threading, time
    def named(name, work):
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: the thread's comm
        end, data = time.monotonic() + 30, bytes(1 << 20)
        while time.monotonic() < end:
            if work == "spin":
                pass
            elif work == "hash":  # busy without the GIL
                hashlib.sha256(data).digest()
            else:
                time.sleep(0.05)
    for name, work in (("spinner", "spin"), ("spinner", "idle"), ("other", "hash")):
        threading.Thread(target=named, args=(name, work), daemon=True).start()
    print("ready", flush=True)
    time.sleep(30)  # thread_cpu_marker
""")


def test_the_named_threads_cpu_is_told_apart_per_run_folder(tmp_path, capsys):
    """A process of a run (its TITAN_RECOVER_RUN_DIR) with one busy and one idle thread of the watched name and a
    busy thread of another name: the tally counts the watched threads only (their CPU and their number), names
    the busy one as the busiest, and attributes them to the run's folder."""
    env = {"TITAN_RECOVER_RUN_DIR": str(tmp_path / "run_a"), "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        out = tmp_path / "threads.json"
        assert thread_cpu.main(["--match", "thread_cpu_marker", "--thread", "spinner", "--every", "0.2",
                                "--seconds", "0.8", "--out", str(out)]) == 0
    finally:
        child.kill()
        child.wait()
    runs = json.loads(out.read_text())
    assert list(runs) == [str(tmp_path / "run_a")]
    run = runs[str(tmp_path / "run_a")]
    spun = run["thread_user_s"] + run["thread_kernel_s"]
    # compared within the run, not with the clock (the host may be busy): the busy spinner is the busiest, the idle
    # one adds little, and the other busy thread is the process's, not the tally's (counted, it would add about
    # as much as the spinner)
    assert 0.05 < run["busiest_thread_s"] <= spun < run["process_s"], run
    assert spun - run["busiest_thread_s"] < run["busiest_thread_s"] / 5, run
    assert run["most_threads"] == 2 and run["most_fds"] >= 3, run  # two threads of the name; stdin, out, err
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("runs=1 thread_cpu_s=")
