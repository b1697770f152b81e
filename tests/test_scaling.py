"""The scaling study's script: model mode (figures and crossovers, :mod:`experiments.scaling`) and the
measuring mode end to end (:mod:`experiments.scaling_measure`)."""
import json
import os

import pytest

from experiments import scaling, scaling_measure


def test_charlm_is_the_10_8m_model():
    assert 10_500_000 < scaling.charlm_numel() < 11_100_000


def test_study_shapes_and_crossovers(tmp_path):
    rows = scaling.study(None, 800.0, world_sizes=(2, 16, 64, 1024))
    assert len(rows) == 2 * len(scaling.RATES_GBIT) * len(scaling.CURVES) * 4

    def row(label, p, rate=1, model="charlm 10.8M"):
        wanted = (model, label, p, rate)
        return next(r for r in rows if (r["model"], r["label"], r["world_size"], r["rate_gbit"]) == wanted)

    # Two-phase bytes per rank stay flat in P; allgather bytes grow with P.
    assert row("2-bit two-phase", 1024)["received_bytes"] < 1.1 * row("2-bit two-phase", 16)["received_bytes"]
    assert row("2-bit allgather", 1024)["received_bytes"] > 50 * row("2-bit allgather", 16)["received_bytes"]
    verdicts = {(c["model"], c["rate_gbit"], c["label"]): c["verdict"] for c in scaling.crossovers(rows)}
    assert verdicts[("charlm 10.8M", 1, "2-bit allgather")] == "stops at P=64"
    assert verdicts[("charlm 10.8M", 1, "2-bit two-phase")] == "beats dense up to P=1024"
    scaling.write_markdown(rows, str(tmp_path / "s.md"), None, 800.0)
    assert "Crossover" in (tmp_path / "s.md").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_measure_mode_runs_two_ranks(tmp_path):
    records = scaling_measure.measure(str(tmp_path), ["unshaped"], [2], numel=4096, repeats=1, bench=None,
                                      timeout_s=240)
    assert len(records) == 1 and "error" not in records[0], records
    record = records[0]
    assert set(record["measured_s"]) == set(record["predicted_s"])
    assert all(value > 0 for value in record["measured_s"].values())
    assert json.load(open(os.path.join(tmp_path, "validation.json")))[0]["world_size"] == 2
