"""Check that the quick run (``pytest -m "not slow"``) still executes every product module.

    python3 scripts/quick_coverage.py [PYTEST_ARGS...]

Runs the quick selection under coverage.py (>= 7.10, ``pip install coverage``), the ranks and
subprocesses it starts included (coverage's ``patch = subprocess``), then lists every module of
gradcomp/, hooks/, csrc/ and experiments/ with the number of its lines that ran. Exits 1 when a
module ran no line at all, naming it; the experiments that no test runs, quick or slow, are
listed in ``NOT_TESTED`` and only reported. Extra arguments go to pytest. Takes a few minutes
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
# Tools and studies that no test in tests/ runs or imports (the full suite does not execute them either).
NOT_TESTED = {
    "experiments/bench_kernels.py", "experiments/compile_step_time.py", "experiments/exit_codes.py",
    "experiments/fsdp_memory.py", "experiments/gpu_selfcheck.py", "experiments/readme_tables.py",
    "experiments/step_times.py", "experiments/study_report.py",
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
    import coverage

    work = Path(tempfile.mkdtemp(prefix="quick-coverage-"))
    rc = work / "coveragerc"
    rc.write_text(RCFILE.format(sources=",".join(str(REPO / top) for top in PRODUCT), data=work / ".coverage"))
    command = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-m", "not slow",
               "tests", "-p", "no:cacheprovider", *pytest_args]  # fmt: skip
    tests = subprocess.run(command, cwd=REPO).returncode
    cov = coverage.Coverage(config_file=str(rc))
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
            note = "  (no test runs it)" if module in NOT_TESTED else "  <-- NOT EXECUTED by the quick run"
            if module not in NOT_TESTED:
                missing.append(module)
        print(f"{lines:5d} / {statements:5d} lines  {module}{note}")
    print(f"pytest exited with {tests}; data in {work}")
    if missing:
        print(f"{len(missing)} product module(s) that no quick test executes: {', '.join(missing)}")
        return 1
    print("every tested product module ran in the quick run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
