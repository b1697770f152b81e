"""Smoke tests of the experiments: the DDP runner, the comparison and link emulation.

They run real 2-rank Gloo jobs over the loopback for a few steps (about a minute in
all); timings are never asserted here.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import catalog, compare, compare_report, netem, netem_probe

# An edit of the module search path, in any file (the pattern itself is not such an edit).
PATH_EDIT = re.compile(r"sys\.path\.(insert|append)\(")

# The experiments run as modules of the experiments package, from the repository root.
ROOT = Path(__file__).resolve().parents[1]
TINY_CHARLM = ["--workload", "charlm", "--small", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16",
               "--eval-windows", "8"]  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env():
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_train(tmp_path, *args):
    log = tmp_path / "log.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", *args, "--log", str(log), "--no-progress", "--max-time", "150",
         "--timeout", "60"],
        capture_output=True, text=True, timeout=200, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return events_of(log)


def events_of(log: Path) -> dict:
    """A JSON-lines log's records by their ``event``."""
    by_event = {}
    for record in map(json.loads, log.read_text().splitlines()):
        by_event.setdefault(record["event"], []).append(record)
    return by_event


def _check_compressed_bytes(steps, method):
    # The recipe starts with 2 dense steps on these short runs (the LR warm-up and 5% of the run are
    # shorter), then ramps: every later step sends less than dense.
    for step in steps:
        if method == "dense" or step["step"] < 2:
            assert step["bytes_sent"] == step["dense_bytes"]
        else:
            assert step["bytes_sent"] < step["dense_bytes"]


@pytest.mark.multiprocess
# Training runs are slow; the quick run starts train.py for --help and for refused arguments only.
@pytest.mark.slow
@pytest.mark.parametrize("method", ["dense", "topk"])
def test_train_charlm_tiny(tmp_path, method):
    events = run_train(tmp_path, *TINY_CHARLM, "--compressor", method, "--steps", "6", "--lr", "3e-3")
    (config,) = events["config"]
    assert config["world_size"] == 2 and config["model"]["d_model"] == 32
    steps = events["step"]
    assert [s["step"] for s in steps] == list(range(6))
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) / 2 < losses[0], losses
    assert all(s["step_time_s"] > 0 for s in steps)
    _check_compressed_bytes(steps, method)
    assert math.isfinite(events["eval"][-1]["eval_loss"])
    assert events["summary"][0]["method"] == method


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("method", ["dense", "topk", "twobit"])
def test_train_digits(tmp_path, method):
    # SGD-momentum: a 24-step run under AdamW gives the recipe's frozen variance 2 steps of samples, and the
    # MLP's later gradients then step it off (diverged or dead at chance, wide top-k and compact alike).
    events = run_train(tmp_path, "--workload", "digits", "--compressor", method, "--steps", "24", "--optimizer", "sgd")
    losses = [s["loss"] for s in events["step"]]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6, losses
    _check_compressed_bytes(events["step"], method)
    final = events["eval"][-1]  # ln(10) = 2.303 and 0.1 at chance; every method measured 2.02-2.12 and 0.37-0.56
    assert final["eval_loss"] < 2.25 and final["accuracy"] > 0.2, final
    if method == "twobit":  # the recipe's 2-bit scale is per parameter and step: no threshold is chosen
        assert "threshold" not in events and events["summary"][0]["twobit_threshold"] == "rms"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_exit_code_stress_jobs_run_on_the_runner_and_end_cleanly():
    # Each job's ranks are the runner's run_rank with exit_codes.StressRun; the script's table is unchanged.
    result = subprocess.run(
        [sys.executable, "-m", "experiments.exit_codes", "--jobs", "1", "--steps", "6", "--recipes", "dense",
         "topk_adamw", "--timeout-s", "120"],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "dense job 1/1: exit codes [0, 0]" in result.stdout, result.stdout[-3000:]
    assert "topk_adamw job 1/1: exit codes [0, 0]" in result.stdout, result.stdout[-3000:]
    table = result.stdout.split("recipe        clean  aborts  other exit codes\n")[1].split()
    assert table == ["dense", "1", "0", "-", "topk_adamw", "1", "0", "-"], result.stdout[-3000:]


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.slow
def test_horovod_train_runs_on_the_runner_with_its_log_and_evaluation(tmp_path):
    # HorovodRun: the runner's loop, evaluation and records under horovodrun; 2-bit with the threshold
    # from a first gradient averaged over the ranks (a Horovod allreduce before the first step).
    import multiprocess

    log = tmp_path / "log.jsonl"
    # One shell word: horovodrun reads "--log" after the command as an abbreviation of its own --log-* options.
    command = (f"{sys.executable} -m experiments.horovod_train --compressor twobit --steps 4 --eval-every 2 "
               f"--log {log}")
    output = multiprocess.horovodrun_argv(["sh", "-c", command], 2)
    assert "done: eval_loss" in output and output.count("ratio") == 4, output[-3000:]
    by_event = events_of(log)
    (config,) = by_event["config"]
    assert config["world_size"] == 2 and config["method"].startswith("TwoBit")
    steps = by_event["step"]
    assert [s["step"] for s in steps] == list(range(4))
    assert all(math.isfinite(s["loss"]) and s["step_time_s"] > 0 for s in steps)
    assert all(s["bytes_sent"] < s["dense_bytes"] for s in steps)
    assert [e["step"] for e in by_event["eval"]] == [1, 3] and 0 <= by_event["eval"][-1]["accuracy"] <= 1
    (summary,) = by_event["summary"]
    assert summary["accuracy"] == by_event["eval"][-1]["accuracy"] and summary["train_time_s"] > 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compare_tiny_writes_results_and_plots(tmp_path):
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.compare", "--tiny", "--out", str(out)],
        # Six runs of a few seconds each; the bound leaves room for a machine shared with other jobs.
        capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = json.loads((out / "summary.json").read_text())
    assert isinstance(records, list) and records
    required = {"workload", "method", "link", "step_time_s", "step_time_over_floor", "final_loss", "bytes_per_step",
                "compute_s", "compress_s", "comm_s", "link_fallback"}  # fmt: skip
    for record in records:
        assert required <= set(record), required - set(record)
        assert record["status"] == "ok" and record["link"] == "unshaped" and record["link_fallback"] is False
        assert record["step_time_s"] > 0 and math.isfinite(record["final_loss"])
    assert {r["workload"] for r in records} == {"charlm-tiny", "digits"}
    assert {r["method"] for r in records} == {"noop", "dense", "topk"}
    for record in records:
        if record["method"] == "noop":
            assert record["step_time_over_floor"] == pytest.approx(1.0) and record["bytes_per_step"] == 0
        if record["method"] == "topk":
            assert record["compression_ratio"] > 10
    digits = [r for r in records if r["workload"] == "digits"]
    assert all(0 <= r["accuracy"] <= 1 for r in digits)
    assert (out / "summary.csv").read_text().startswith("workload,method,parallel,link")
    assert "| workload | link | method |" in (out / "results.md").read_text()
    assert "| workload | link | method |" in result.stdout  # the table is printed at the end
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 8, pngs  # 4 plots x 2 workloads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for png in pngs:
        assert png.read_bytes()[:8] == PNG_MAGIC
        height, width = plt.imread(png).shape[:2]
        assert height > 200 and width > 200


@pytest.mark.multiprocess
@pytest.mark.parametrize("module", ["compare", "train", "plots", "netem", "horovod_train"])
def test_modules_run_with_dash_m_from_the_repository_root(module):
    result = subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: ") and "--help" in result.stdout


def test_no_module_edits_the_import_path():
    """Packages import each other by name: the experiments as ``python -m experiments.X``,
    the tests with the repository root and tests/ on the path (pytest's configuration)."""
    offenders = []
    for path in sorted(ROOT.glob("**/*.py")):
        parts = path.relative_to(ROOT).parts
        if {"results", "build", "site-packages"} & set(parts) or any(part.startswith(".") for part in parts):
            continue  # not the project's modules: outputs, builds, .git, a virtualenv (.venv)
        text = path.read_text(errors="replace")
        for line_number, line in enumerate(text.splitlines(), 1):
            if PATH_EDIT.search(line) and path.name != "test_experiments.py":
                offenders.append(f"{path.relative_to(ROOT)}:{line_number}")
    assert not offenders, offenders


@pytest.mark.multiprocess
def test_train_help_lists_every_method_of_the_catalog():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    for method in catalog.METHODS.values():
        assert f"  {method.name:12s} {method.description[:20]}" in result.stdout


@pytest.mark.multiprocess
def test_bad_arguments_are_refused_before_any_rank_starts():
    for bad, message in [
        (["--threshold", "fast"], "--threshold must be"),
        (["--backend", "gpu"], "--backend must be one of"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "experiments.train", *bad], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_gradcomp_methods_build_their_compressor_from_the_registry():
    from experiments import launch, methods

    args = launch.parse_args(["--compressor", "topk", "--density", "0.003", "--threshold", "0.02"])
    assert methods.compressor_for(catalog.METHODS["topk"], args).spec == "topk:0.003"
    with pytest.raises(SystemExit):  # one name: --density
        launch.parse_args(["--compressor", "topk", "--ratio", "0.003"])
    assert methods.compressor_for(catalog.METHODS["twobit-noef"], args).spec == "twobit:0.019999999552965164"
    assert methods.compressor_for(catalog.METHODS["twobit"], args, 0.25).spec == "twobit:0.25"
    rms = launch.parse_args(["--threshold", "rms"])
    assert methods.compressor_for(catalog.METHODS["twobit"], rms).spec == "twobit:rms"
    assert methods.compressor_for(catalog.METHODS["twobit"], launch.parse_args([])).spec == "twobit:rms"  # the default
    auto = launch.parse_args(["--threshold", "auto"])  # auto: a placeholder until the warm-up ends
    assert methods.compressor_for(catalog.METHODS["twobit-naive"], auto).spec == "twobit:1.0"


def test_catalog_orders_every_method_once():
    assert catalog.ALL_METHODS[0] == "noop" and set(catalog.TIMING_METHODS) < set(catalog.ALL_METHODS)
    assert catalog.GRADCOMP_METHODS == ("topk", "twobit", "topk-noef", "twobit-noef", "topk-naive", "twobit-naive")
    assert all(catalog.METHODS[m].recipe for m in ("topk", "twobit", "auto"))
    assert not any(catalog.METHODS[m].recipe for m in ("topk-naive", "twobit-naive"))
    assert sorted(catalog.ALL_METHODS, key=catalog.method_order) == list(catalog.ALL_METHODS)
    assert catalog.method_order("unknown") == len(catalog.ALL_METHODS)


def test_plan_runs_puts_noop_first_and_noef_on_the_first_link_only():
    args = compare.parse_args(["--matrix", "--links", "unshaped,1gbit"])
    runs = compare.plan_runs(args)
    keys = [(r.plan.name, r.link_name, r.method) for r in runs]
    assert len(keys) == len(set(keys))
    assert {m for _, link, m in keys if link == "1gbit"} == set(compare.TIMING_METHODS)
    assert not any(w == "charlm-small" for w, link, _ in keys if link == "1gbit")
    for workload, link in {(w, link) for w, link, _ in keys}:
        group = [m for w, lk, m in keys if (w, lk) == (workload, link)]
        assert group[0] == "noop"
    only_dense = compare.plan_runs(compare.parse_args(["--tiny", "--methods", "dense", "--workloads", "digits"]))
    assert [r.method for r in only_dense] == ["noop", "dense"]


def test_floor_fields_split_the_step_time():
    records = [
        {"workload": "w", "link": "1gbit", "method": "noop", "status": "ok", "step_time_s": 1.0, "compress_s": 0.0},
        {"workload": "w", "link": "1gbit", "method": "topk", "status": "ok", "step_time_s": 1.5, "compress_s": 0.2},
        {"workload": "w", "link": "unshaped", "method": "dense", "status": "ok", "step_time_s": 2.0, "compress_s": 0.0},
    ]
    compare_report.add_floor_fields(records)
    noop, topk, no_floor = records
    assert noop["step_time_over_floor"] == 1.0 and noop["comm_s"] == 0.0
    assert topk["compute_s"] == 1.0 and topk["step_time_over_floor"] == 1.5
    assert topk["comm_s"] == pytest.approx(0.3)
    assert no_floor["step_time_over_floor"] is None  # no noop run on that link


def test_rates_are_validated():
    assert netem.parse_rate("1gbit") == "1gbit"
    assert netem.parse_rate("100MBit") == "100mbit"
    for unshaped in (None, "", "unshaped", "none"):
        assert netem.parse_rate(unshaped) is None
    for bad in ("1gb", "fast", "1gbit; reboot", "-5mbit"):
        with pytest.raises(ValueError):
            netem.parse_rate(bad)


def test_the_bucket_holds_a_millisecond_of_the_rate():
    from experiments import netem_tbf

    # tc's units: "bit" rates are bits a second, "bps" rates bytes a second, the prefixes decimal.
    assert netem_tbf.rate_bytes_per_s("10mbit") == 1.25e6
    assert netem_tbf.rate_bytes_per_s("1.5Gbit") == 1.875e8
    assert netem_tbf.rate_bytes_per_s("100mbps") == 1e8
    assert netem_tbf.burst_bytes("1gbit") == 125_000 and netem_tbf.burst_bytes("10gbit") == 1_250_000
    assert netem_tbf.burst_bytes("100mbit") == 12_500
    # Slow links keep two packets of the MTU: a packet larger than the bucket would never pass.
    assert netem_tbf.burst_bytes("10mbit") == netem_tbf.MIN_BURST >= 2 * netem_tbf.MTU
    assert netem_tbf.tbf_args("100mbit") == ["tbf", "rate", "100mbit", "burst", "12500", "limit", netem_tbf.LIMIT]
    with pytest.raises(ValueError):
        netem_tbf.rate_bytes_per_s("1gb")
    # A sender's offload packets and queued bytes: 4 ms of the rate, whole packets, within the defaults.
    assert netem_tbf.stack_settings("10mbit", 4 << 20) == (4, netem_tbf.MIN_QUEUED)
    assert netem_tbf.stack_settings("100mbit", 4 << 20) == (34, 50_000)
    assert netem_tbf.stack_settings("1gbit", 4 << 20) == (334, 500_000)
    assert netem_tbf.stack_settings("10gbit", 1 << 20) == (3334, 1 << 20)
    assert netem_tbf.stack_settings("1tbit", 4 << 20) == (netem_tbf.GSO_MAX_SEGS, 4 << 20)


def test_unshaped_link_runs_commands_unchanged():
    with netem.link("unshaped") as link:
        assert not link.shaped and not link.fallback and link.label == "unshaped"
        assert link.command(["python", "x.py"]) == ["python", "x.py"]
        env = link.env({"GRADCOMP_NETNS": "stale"})
        assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["MASTER_ADDR"] == "127.0.0.1"
        assert "GRADCOMP_NETNS" not in env
        assert link.record()["link"] == "unshaped" and link.record()["link_fallback"] is False


def test_shaping_falls_back_loudly_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    before = netem.list_namespaces()
    with netem.link("1gbit") as link:
        assert not link.shaped and link.fallback and link.label == "unshaped"
        assert link.command(["true"]) == ["true"]
        record = link.record()
        assert record["link"] == "unshaped" and record["link_fallback"] is True and record["link_requested"] == "1gbit"
    assert "UNSHAPED" in capsys.readouterr().err
    assert netem.list_namespaces() == before


needs_root = pytest.mark.skipif(
    netem.shaping_unavailable_reason() is not None,
    reason=f"link shaping unavailable: {netem.shaping_unavailable_reason()}",
)


@needs_root
@pytest.mark.multiprocess
def test_shaped_namespace_is_created_and_always_removed():
    with pytest.raises(RuntimeError, match="inside"):
        with netem.link("200mbit") as link:
            if link.fallback:
                pytest.skip(f"ip netns failed here: {link.fallback_reason}")
            name = link.namespace
            assert link.shaped and link.label == "200mbit" and name.startswith(netem.PREFIX + "-")
            assert name in netem.list_namespaces()
            qdisc = subprocess.run(
                link.command(["tc", "qdisc", "show", "dev", "lo"]), capture_output=True, text=True, timeout=20
            )
            assert "tbf" in qdisc.stdout and "200Mbit" in qdisc.stdout
            # Shaping is in effect: one TCP stream gets at most the rate (generous lower
            # bound: the machine may be busy).
            assert 0.05 < netem_probe.measure_gbit_s(link, nbytes=4 << 20) < 0.23
            raise RuntimeError("an error inside the with block")
    assert name not in netem.list_namespaces()


@needs_root
@pytest.mark.multiprocess
def test_stale_namespaces_of_dead_processes_are_cleaned():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = f"{netem.PREFIX}-{dead.pid}-abc123"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=20)
    try:
        assert stale in netem.clean_stale()
        assert stale not in netem.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=20)
