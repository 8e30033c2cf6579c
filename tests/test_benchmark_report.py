"""benchmarks/report.py: what a benchmark prints is written to its results file under a header naming the command,
the date, the commit and the wall time; nothing is written for a failed run or with ``--out -``; the default
folder moves with ``TITAN_RECOVER_RESULTS_DIR``; edits outside docs/ mark the commit as not the whole story."""

from __future__ import annotations

import datetime
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "rejoin.py"


def _git(cwd: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_recorded_writes_what_was_printed_under_a_header(tmp_path, capsys):
    out = tmp_path / "sub" / "rejoin.txt"
    with report.recorded(SCRIPT, ["--rounds", "5", "--note", "two words"], str(out)) as path:
        print("a table line")
        print("transfer_ratio=0.9", flush=True)
    assert path == out
    assert "a table line\ntransfer_ratio=0.9\n" in capsys.readouterr().out  # still printed
    first, *rest = out.read_text().splitlines()
    assert rest == ["a table line", "transfer_ratio=0.9"]
    match = re.fullmatch(r"\$ python benchmarks/rejoin\.py --rounds 5 --note 'two words'  # "
                         r"(\d{4}-\d\d-\d\d \d\d:\d\d) UTC, (commit [0-9a-f]{10}.*|unknown commit), (\d+) s", first)
    assert match, first
    when = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M").replace(tzinfo=datetime.timezone.utc)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - when) < datetime.timedelta(minutes=5)
    assert match[2] == report.commit()


def test_a_failed_run_or_out_dash_writes_nothing(tmp_path):
    out = tmp_path / "kept.txt"
    out.write_text("the committed result\n")
    with pytest.raises(RuntimeError):
        with report.recorded(SCRIPT, [], str(out)):
            print("half a table")
            raise RuntimeError("the benchmark failed")
    assert out.read_text() == "the committed result\n"
    with report.recorded(SCRIPT, [], report.NO_FILE) as path:
        print("only printed")
    assert path is None


def test_default_path_follows_the_environment_and_out_wins(tmp_path, monkeypatch):
    monkeypatch.delenv(report.RESULTS_ENV, raising=False)
    assert report.default_path(SCRIPT) == ROOT / "docs" / "results" / "rejoin.txt"
    monkeypatch.setenv(report.RESULTS_ENV, str(tmp_path / "elsewhere"))
    assert report.default_path("benchmarks/quota_balance.py") == tmp_path / "elsewhere" / "quota_balance.txt"
    with report.recorded(SCRIPT, []) as path:
        print("x")
    assert path == tmp_path / "elsewhere" / "rejoin.txt" and path.read_text().endswith("\nx\n")
    with report.recorded(SCRIPT, [], str(tmp_path / "explicit.txt")) as path:
        print("y")
    assert path == tmp_path / "explicit.txt" and path.exists()


def test_commit_names_head_and_flags_edits_outside_the_results(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "x.txt").write_text("old\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "--short=10", "HEAD")
    assert report.commit(tmp_path) == f"commit {head}"
    (tmp_path / "docs" / "results" / "x.txt").write_text("new\n")  # a benchmark's own output: still that commit
    (tmp_path / "docs" / "page.md").write_text("a page being written\n")
    _git(tmp_path, "add", "docs/page.md")
    (tmp_path / "untracked.py").write_text("")
    assert report.commit(tmp_path) == f"commit {head}"
    (tmp_path / "code.py").write_text("a = 2\n")
    assert report.commit(tmp_path) == f"commit {head} + uncommitted changes"
    assert report.commit(tmp_path / "docs" / "results") == f"commit {head} + uncommitted changes"  # from any folder
