"""The noise-floor benchmark: rows of round medians whose spread is the step-time benchmark's."""
import json
import os

from experiments import noise_floor


def test_spread_is_the_range_of_the_round_medians_over_their_median():
    assert noise_floor.spread([1.0, 1.1, 0.9]) == (1.1 - 0.9) / 1.0


def test_each_process_times_every_round_and_reports_its_spread(tmp_path):
    out = tmp_path / "floor.json"
    assert noise_floor.main(["--procs", "2", "--rounds", "3", "--round-seconds", "0.2", "--width", "16",
                             "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["proc"] for row in rows] == [0, 1]
    for row in rows:
        assert len(row["rounds"]) == 3 and all(median > 0 for median in row["rounds"])
        assert all(count > 1 for count in row["steps_per_round"])
        assert row["spread"] == noise_floor.spread(row["rounds"])


def test_pin_puts_each_process_on_a_core_of_its_own(tmp_path):
    out = tmp_path / "floor.json"
    assert noise_floor.main(["--procs", "2", "--rounds", "2", "--round-seconds", "0.1", "--width", "16", "--pin",
                             "--out", str(out)]) == 0
    allowed = sorted(os.sched_getaffinity(0))
    rows = json.loads(out.read_text())
    assert [row["cores"] for row in rows] == [[allowed[0]], [allowed[1 % len(allowed)]]]
