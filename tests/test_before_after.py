"""benchmarks/before_after.py: how a key's runs are summarised on one side, runs that did not measure it included."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling module report.py
_spec = importlib.util.spec_from_file_location("before_after", ROOT / "benchmarks" / "before_after.py")
before_after = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(before_after)


def test_runs_that_did_not_measure_a_key_are_left_out_of_its_median_and_counted():
    assert before_after.summary([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0, 3)
    assert before_after.summary([math.nan, 1.3, 1.6, math.nan, 1.0]) == (1.3, 1.0, 1.6, 3)
    median, low, high, measured = before_after.summary([math.nan, math.nan])
    assert measured == 0 and all(math.isnan(x) for x in (median, low, high))
    assert before_after.cell([3.0, 1.0, 2.0]) == "2 [1, 3]"
    assert before_after.cell([math.nan, 1.3, 1.6, math.nan, 1.0]) == "1.3 [1, 1.6] (3 of 5 runs)"
    assert before_after.cell([math.nan, math.nan]) == "nan (0 of 2 runs)"


def test_the_headline_is_the_last_line_with_key_value_pairs():
    output = "round 0\nmembers=4 epoch_s=nan note=x\n\n"
    values = before_after.headline(output)
    assert values["members"] == 4 and math.isnan(values["epoch_s"]) and "note" not in values


def test_a_run_gives_its_headline_and_keeps_its_whole_output_when_asked(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text('print("size 4: the look found the flag raised")\nprint("members=4 epoch_s=nan")\n')
    kept = tmp_path / "kept" / "round0_before.txt"
    values = before_after.run(tmp_path, [str(script)], timeout=60, keep=kept)
    assert values["members"] == 4 and math.isnan(values["epoch_s"])
    assert "the look found the flag raised" in kept.read_text()
