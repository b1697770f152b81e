"""Check that the quick run (``pytest -m "not slow"``) still executes every product module.

    python3 scripts/quick_coverage.py [PYTEST_ARGS...]

Runs the quick selection under coverage.py (>= 7.10, ``pip install coverage``), the ranks and
subprocesses it starts included (coverage's ``patch = subprocess``), then lists every module of
gradcomp/, hooks/, csrc/ and experiments/ with the number of its lines that ran. Exits 1 when a
module ran no line at all, naming it; the studies that only slow tests run (or none), listed in
``NOT_QUICK``, are only reported. Extra arguments go to pytest. Takes a few minutes
more than the quick run itself.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("gradcomp", "hooks", "csrc", "experiments")
# Studies and tools that no quick test runs, now or before the quick selection was trimmed (no quick test
# imports them or starts them with -m): run only by slow tests (test_convergence.py, whose every test is
# slow, and test_compare_tiny_writes_results_and_plots) or by none. Reported, not failed.
NOT_QUICK = {
    "experiments/compile_step_time.py", "experiments/convergence.py", "experiments/convergence_ddp.py",
    "experiments/exit_codes.py", "experiments/fsdp_memory.py", "experiments/fsdp_train.py", "experiments/gpt.py",
    "experiments/gpu_selfcheck.py", "experiments/images.py", "experiments/loop.py", "experiments/readme_tables.py",
    "experiments/simrun.py", "experiments/step_times.py", "experiments/study_report.py", "experiments/suite.py",
    "experiments/time_to_accuracy.py",
}  # fmt: skip

RCFILE = """\
[run]
source = {sources}
parallel = true
data_file = {data}
patch = subprocess
    _exit
"""


def product_modules() -> list:
    return sorted(str(path.relative_to(REPO)) for top in PRODUCT for path in (REPO / top).rglob("*.py")
                  if "results" not in path.relative_to(REPO).parts)  # fmt: skip


def main(pytest_args) -> int:
    work = Path(tempfile.mkdtemp(prefix="quick-coverage-"))
    rc = work / "coveragerc"
    rc.write_text(RCFILE.format(sources=",".join(str(REPO / top) for top in PRODUCT), data=work / ".coverage"))
    command = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-m", "not slow",
               "tests", "-p", "no:cacheprovider", *pytest_args]  # fmt: skip
    tests = subprocess.run(command, cwd=REPO).returncode
    print(f"pytest exited with {tests}; coverage data in {work}")
    return report(rc)


def report(rc: Path) -> int:
    """Combine the processes' data files beside ``rc``'s data file, print each module's lines that ran;
    1 if a module outside ``NOT_QUICK`` ran none."""
    import coverage

    cov = coverage.Coverage(config_file=str(rc))
    cov.load()  # what an earlier report combined; combine() adds the processes' files to it
    if list(rc.parent.glob(".coverage.*")):
        cov.combine(strict=True)
        cov.save()
    data = cov.get_data()
    ran = {os.path.relpath(path, REPO): len(data.lines(path) or ()) for path in data.measured_files()}
    missing = []
    for module in product_modules():
        statements = len(cov.analysis2(str(REPO / module))[1])
        lines = ran.get(module, 0)
        note = ""
        if lines == 0 and statements > 0:
            note = "  (NOT_QUICK: slow tests only)" if module in NOT_QUICK else "  <-- NOT EXECUTED by the quick run"
            if module not in NOT_QUICK:
                missing.append(module)
        print(f"{lines:5d} / {statements:5d} lines  {module}{note}")
    if missing:
        print(f"{len(missing)} product module(s) that no quick test executes: {', '.join(missing)}")
        return 1
    stale = sorted(m for m in NOT_QUICK if ran.get(m, 0))
    if stale:
        print(f"now run by the quick selection, so no longer needed in NOT_QUICK: {', '.join(stale)}")
    print(f"every product module but the {len(NOT_QUICK)} of NOT_QUICK ran in the quick run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
