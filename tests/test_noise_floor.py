"""The noise-floor benchmark: rows of round medians whose spread is the step-time benchmark's."""
import json

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
