"""What a benchmark prints, kept: the same text written to ``docs/results/<script>.txt`` under one header line that
names the command, the date, the commit and the wall time, so docs/benchmarks.md quotes a file, not pasted text.

    from report import add_out_argument, recorded

    parser = argparse.ArgumentParser()
    add_out_argument(parser, __file__)           # --out, default docs/results/<script>.txt ("-": no file)
    args = parser.parse_args(argv)
    with recorded(__file__, argv, args.out):
        ...print the measurements and the headline...

The file is written when the block ends without an exception (a failed run leaves the committed result alone).
Its first line::

    $ python benchmarks/rejoin.py --rounds 5  # 2025-01-31 12:00 UTC, commit 96378b8c1d, 312 s

``+ uncommitted changes`` follows the commit when tracked files outside docs/ differed from it when the run started:
the figures then belong to no commit (pages and results under docs/ do not change what is measured). ``TITAN_RECOVER_RESULTS_DIR`` moves the default folder (benchmarks/before_after.py
sets it so the runs it makes leave docs/results/ alone); an explicit ``--out`` wins over it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import pathlib
import shlex
import subprocess
import sys
import time
from typing import Iterator, TextIO

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
RESULTS_ENV = "TITAN_RECOVER_RESULTS_DIR"
NO_FILE = "-"


def default_path(script: str | os.PathLike) -> pathlib.Path:
    """``docs/results/<script stem>.txt``, or the same name under ``$TITAN_RECOVER_RESULTS_DIR`` when it is set."""
    folder = pathlib.Path(os.environ[RESULTS_ENV]) if os.environ.get(RESULTS_ENV) else RESULTS
    return folder / f"{pathlib.Path(script).stem}.txt"


def add_out_argument(parser: argparse.ArgumentParser, script: str | os.PathLike) -> None:
    """Add ``--out FILE`` (default ``default_path(script)``; ``-`` prints only) to a benchmark's parser."""
    parser.add_argument("--out", default=None,
                        help=f"write what is printed to this file (default docs/results/{pathlib.Path(script).stem}"
                             f".txt; '{NO_FILE}': print only)")


def commit(root: pathlib.Path = ROOT) -> str:
    """The checked-out commit (10 hex digits), ``+ uncommitted changes`` when tracked files outside docs/ differ
    from it, ``unknown commit`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=10", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)docs")
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {head}" + (" + uncommitted changes" if dirty else "")


def header(script: str | os.PathLike, argv: list[str], started: datetime.datetime, wall_s: float,
           at_commit: str, root: pathlib.Path = ROOT) -> str:
    """The results file's first line: ``$ python <script relative to the repository> <argv>  # <date>,
    <at_commit>, <wall> s``."""
    path = pathlib.Path(script).resolve()
    shown = path.relative_to(root) if path.is_relative_to(root) else path
    command = shlex.join(["python", str(shown), *argv])
    return f"$ {command}  # {started:%Y-%m-%d %H:%M} UTC, {at_commit}, {wall_s:.0f} s"


def write_result(path: str | os.PathLike, script: str | os.PathLike, argv: list[str], text: str,
                 started: datetime.datetime, wall_s: float, at_commit: str) -> pathlib.Path:
    """Write ``header(...)`` and ``text`` to ``path`` (its folder created) and return the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header(script, argv, started, wall_s, at_commit) + "\n" + text.rstrip("\n") + "\n")
    return path


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, stream: TextIO):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def recorded(script: str | os.PathLike, argv: list[str] | None = None, out: str | None = None
             ) -> Iterator[pathlib.Path | None]:
    """Print as usual inside the block; at its end (no exception) write what was printed to ``out`` (default
    ``default_path(script)``; ``"-"``: no file) under ``header`` (the commit as the block began). ``argv``: the script's arguments (default
    ``sys.argv[1:]``). Yields the path that will be written, or None."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = None if out == NO_FILE else pathlib.Path(out) if out else default_path(script)
    started, clock, at_commit = datetime.datetime.now(datetime.timezone.utc), time.monotonic(), commit()
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield path
    if path is not None:
        write_result(path, script, argv, tee.copy.getvalue(), started, time.monotonic() - clock, at_commit)
        print(f"(written to {path})", file=sys.stderr)
