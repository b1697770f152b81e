"""Which code made a study's run: a hash of the source that decides its numbers.

A study resumes from its complete logs (``experiments.convergence``, ``compare --quick``), so a log
made before a change of the recipe would otherwise be reused as if the new code had made it. Each run
records :func:`code` in its ``config`` record, and a complete log is reused only when its ``code``
is the current one (:func:`experiments.study_report.is_current`).

The hash covers the package (``gradcomp/``, ``hooks/``) and the experiments' modules a run executes
(:data:`RUN_MODULES`), each parsed, with comments and docstrings left out: an edit of prose keeps
the logs, any edit of code, a constant included, does not.

:func:`machine` says which machine made a run: the same code and seed part on two machines whose vector units
round differently, within a few dozen steps, and on a workload near the edge of stability end tens of percent
apart (shapes under SGD-momentum: dense's held-out loss 0.0139 on one machine and 0.0183 on another, seed 0,
``experiments/results/research-shapes-sgd-seeds/``). So a method's run is compared with dense's of the same
machine, or the comparison says it is not (:func:`experiments.study_report.add_dense_comparisons`).
"""
from __future__ import annotations

import ast
import functools
import glob
import hashlib
import os
import platform
from typing import List

__all__ = ["code", "machine", "source_hash", "RUN_MODULES"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The experiments' modules whose code shapes a run's numbers (the rest report, plot or launch).
RUN_MODULES = ("loop", "suite", "workloads", "objectives", "gpt", "images", "methods", "catalog", "simrun",
               "simulate", "runner", "convergence_ddp", "fsdp_train", "horovod_train")


def _without_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with the docstring of every module, class and function removed (mutated in place)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                  str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def source_hash(text: str) -> str:
    """The SHA-256 of a module's syntax tree without comments and docstrings (hex)."""
    return hashlib.sha256(ast.dump(_without_docstrings(ast.parse(text))).encode()).hexdigest()


def _files() -> List[str]:
    found = []
    for package in ("gradcomp", "hooks"):
        found += glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True)
    found += [os.path.join(ROOT, "experiments", f"{name}.py") for name in RUN_MODULES]
    return sorted(path for path in found if os.path.exists(path))


@functools.lru_cache(maxsize=1)
def code() -> str:
    """The fingerprint of the code a run executes now: 16 hex digits."""
    digest = hashlib.sha256()
    for path in _files():
        with open(path, encoding="utf-8") as f:
            digest.update(os.path.relpath(path, ROOT).encode() + b"\0" + source_hash(f.read()).encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def machine() -> str:
    """What rounds a run's floats on this machine, as 16 hex digits: the CPU's model and flags (``/proc/cpuinfo``, else
    :func:`platform.processor`), the vector unit torch dispatches to, and torch's version."""
    import torch

    described = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
        described += sorted({line.split(":", 1)[1].strip() for line in lines
                             if line.split(":", 1)[0].strip() in ("model name", "flags")})
    except OSError:  # not Linux: the processor's name alone
        pass
    described += [torch.backends.cpu.get_cpu_capability(), torch.__version__]
    return hashlib.sha256("\0".join(described).encode()).hexdigest()[:16]
