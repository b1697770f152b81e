"""A study reuses a complete log only when the current code made it (experiments.fingerprint)."""
import json

from experiments import convergence, fingerprint

MODULE = '''"""A module."""
RATE = 0.1  # the rate


def f(x):
    """Scale x."""
    return x * RATE
'''


def test_prose_edits_keep_the_fingerprint_and_code_edits_change_it():
    same = MODULE.replace('"""Scale x."""', '"""Scale x by the rate."""').replace("# the rate", "# why")
    assert fingerprint.source_hash(same) == fingerprint.source_hash(MODULE)
    assert fingerprint.source_hash(MODULE.replace("0.1", "0.2")) != fingerprint.source_hash(MODULE)
    assert fingerprint.source_hash(MODULE.replace("x * RATE", "RATE * x")) != fingerprint.source_hash(MODULE)
    assert len(fingerprint.code()) == 16 and fingerprint.code() == fingerprint.code()


def test_a_complete_log_from_other_code_is_run_again_and_one_from_this_code_is_reused(tmp_path, capsys):
    specs = convergence.plan(False, [0], ("dense",), ["charlm-small"], 10, ("adamw",))
    (spec,) = specs

    def write(code):
        records = [{"event": "config", "code": code}, {"event": "step", "step": 0}, {"event": "done"}]
        (tmp_path / f"{spec.stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write(fingerprint.code())
    assert convergence._pending(specs, str(tmp_path)) == []
    write("0123456789abcdef")
    assert convergence._pending(specs, str(tmp_path)) == [spec]
    assert "made by other code" in capsys.readouterr().out
    (tmp_path / f"{spec.stem}.jsonl").write_text(json.dumps({"event": "config"}) + "\n")  # cut off, no code
    assert convergence._pending(specs, str(tmp_path)) == []  # written just now: another study's run in progress


def test_aggregate_keeps_the_rows_whose_log_is_gone_and_rebuilds_those_whose_log_is_here(tmp_path):
    # Logs are not committed: a study continued on a fresh clone must not drop the runs made before.
    from experiments.study_report import aggregate

    specs = convergence.plan(False, [0, 1], ("dense",), ["charlm-small"], 4, ("adamw",))
    runs = tmp_path / "runs"
    runs.mkdir()

    def write(spec, loss):
        records = [{"event": "config", "code": fingerprint.code(), **spec.__dict__}]
        records += [{"event": "step", "step": i, "loss": loss, "step_time_s": 0.1, "train_time_s": 0.1 * (i + 1),
                     "bytes_sent": 8, "dense_bytes": 8} for i in range(4)]
        records += [{"event": "eval", "step": 3, "train_time_s": 0.4, "eval_loss": loss}, {"event": "done"}]
        (runs / f"{spec.stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write(specs[0], 2.0)
    write(specs[1], 3.0)
    aggregate(str(tmp_path), specs, convergence.RunSpec, convergence.METHODS.index)
    (runs / f"{specs[1].stem}.jsonl").unlink()  # seed 1's log is gone (another machine)
    write(specs[0], 1.5)  # seed 0 run again
    rows = aggregate(str(tmp_path), specs, convergence.RunSpec, convergence.METHODS.index)
    assert sorted((r["seed"], r["final_loss"]) for r in rows) == [(0, 1.5), (1, 3.0)]
    assert all(r["code"] == fingerprint.code() for r in rows)


def test_the_machine_fingerprint_is_stable_and_a_gap_across_machines_says_so():
    from experiments.study_report import _gap, add_dense_comparisons

    assert len(fingerprint.machine()) == 16 and int(fingerprint.machine(), 16) >= 0
    assert fingerprint.machine() == fingerprint.machine()

    def row(method, seed, loss, machine):
        return {"workload": "w", "optimizer": "sgdm", "method": method, "seed": seed, "steps": 4, "final_loss": loss,
                "final_accuracy": None, "train_time_s": 1.0, "evals": [(3, 1.0, loss)], "machine": machine}

    rows = [row("dense", 0, 1.0, "a"), row("topk", 0, 1.1, "a"), row("dense", 1, 1.0, "a"), row("topk", 1, 1.2, "b"),
            row("dense", 2, 1.0, None), row("topk", 2, 0.9, "a")]
    add_dense_comparisons(rows)
    assert [r["same_machine_as_dense"] for r in rows if r["method"] == "topk"] == [True, False, None]
    assert [round(r["gap_to_dense"], 3) for r in rows if r["method"] == "topk"] == [0.1, 0.2, -0.1]
    assert [_gap(r) for r in rows if r["method"] == "topk"] == ["+10.0%", "+20.0% (dense: another machine)", "-10.0%"]


def test_dense_here_adds_dense_beside_a_compressed_run_unless_this_machine_made_it(tmp_path, capsys):
    """--dense-here: a compressed run's dense counterpart runs on this machine unless a current log or a row of the
    study's convergence.json says this machine made it; another machine's log or row does not count."""
    from dataclasses import asdict, replace

    (topk,) = convergence.plan(False, [0], ("topk",), ["charlm-small"], 10, ("adamw",))
    dense = replace(topk, method="dense")
    runs = tmp_path / "runs"
    runs.mkdir()

    def log(machine):
        records = [{"event": "config", "code": fingerprint.code(), "machine": machine}, {"event": "done"}]
        (runs / f"{dense.stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def rows(machine):
        (tmp_path / "convergence.json").write_text(json.dumps([{**asdict(dense), "machine": machine}]))

    assert convergence.dense_here([topk], str(runs), str(tmp_path)) == [dense]
    assert "this machine made no dense run" in capsys.readouterr().out
    assert convergence.dense_here([topk, dense], str(runs), str(tmp_path)) == []  # already pending
    assert convergence.dense_here([dense], str(runs), str(tmp_path)) == []  # a dense run needs no other
    log("0123456789abcdef")
    assert convergence.dense_here([topk], str(runs), str(tmp_path)) == [dense]
    log(fingerprint.machine())
    assert convergence.dense_here([topk], str(runs), str(tmp_path)) == []
    (runs / f"{dense.stem}.jsonl").unlink()  # a fresh clone: the logs are gone, the rows stay
    rows("0123456789abcdef")
    assert convergence.dense_here([topk], str(runs), str(tmp_path)) == [dense]
    rows(fingerprint.machine())
    assert convergence.dense_here([topk], str(runs), str(tmp_path)) == []
    other_seed = replace(topk, seed=1)
    assert convergence.dense_here([other_seed], str(runs), str(tmp_path)) == [replace(dense, seed=1)]
