"""The project's torchrun entry (titan_recover/torchrun.py): torchrun's own ``main``, then the exit status Python
would give, without the interpreter's teardown."""

from __future__ import annotations

import signal

import pytest
from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException

from titan_recover import torchrun


class Left(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@pytest.fixture
def ended(monkeypatch):
    """Runs torchrun.main with torchrun's ``main`` replaced by ``behaviour``; returns the code ``leave`` got."""
    def leave(code):
        raise Left(code)

    monkeypatch.setattr(torchrun, "leave", leave)

    def run_with(behaviour, argv=("--standalone", "-m", "x")):
        seen = []
        monkeypatch.setattr(run, "main", lambda args: (seen.append(args), behaviour())[1])
        with pytest.raises(Left) as left:
            torchrun.main(list(argv))
        assert seen == [list(argv)]  # torchrun got the arguments as given
        return left.value.code

    return run_with


def raising(error):
    def behaviour():
        raise error
    return behaviour


def test_the_exit_status_is_the_one_python_gives(ended, capsys):
    assert ended(lambda: None) == 0
    assert ended(raising(SystemExit(3))) == 3
    assert ended(raising(SystemExit(None))) == 0
    assert ended(raising(SystemExit("bad arguments"))) == 1
    assert "bad arguments" in capsys.readouterr().err
    assert ended(raising(RuntimeError("a worker failed"))) == 1
    err = capsys.readouterr().err  # printed with its traceback, as an uncaught one is
    assert "Traceback" in err and "RuntimeError: a worker failed" in err
    # torchrun ended the workers on a signal: one sentence, and 128 + the signal
    assert ended(raising(SignalException("Process 7 got signal: 15", sigval=signal.SIGTERM))) == 128 + 15
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "titan_recover.torchrun: SIGTERM: the workers were ended without a checkpoint" in err, err

