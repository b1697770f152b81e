"""The convergence study's real-DDP runs (:mod:`experiments.convergence`): one run's ranks over Gloo.

The study runs torch's hooks (``fp16``, ``powersgd``) and ``auto`` (which measures a link) as real
DDP, 2 ranks x 1 thread, on the shaped link; the study starts each run as
``python -m experiments.convergence --worker SPEC --log PATH`` inside the link, which calls
:func:`run_worker`. It spawns the local ranks (:func:`experiments.launch.spawn_ranks`); each is
:func:`experiments.runner.run_rank` with :class:`StudyRun`: the workload and its loop
(:mod:`experiments.suite`, :mod:`experiments.loop`), the model in DDP with its default buckets, the
method (:func:`experiments.methods.attach_study_method`), the workload's own loop, held-out metrics
evaluated over every rank; rank 0 writes the run's JSON-lines log, the same kinds of record
(``config``, ``step``, ``eval``, ``done``) as the simulated runs' (:mod:`experiments.simrun`).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from typing import TYPE_CHECKING

from experiments import launch, methods
from experiments.runner import Run, run_rank

if TYPE_CHECKING:
    from experiments.convergence import RunSpec

#: How the runs bucket their gradients (recorded in every row): DDP's default buckets.
BUCKETS = "default"
RANK_TIMEOUT_S = 300.0  # the process group's timeout


class StudyRun(Run):
    """A real-DDP run of the study (``args.spec``): DDP's default buckets, as a user has them (the engine
    compresses each parameter of a bucket on its own: its own top-k budget and 2-bit scale); no wire
    bytes in its records, no summary."""

    wire_bytes = False

    def attach(self):
        spec = self.args.spec
        return methods.attach_study_method(self.model, spec.method, self.optimizer, self.scheduler, spec.steps,
                                           spec.seed)

    def config(self, backend: str) -> dict:
        import torch

        from experiments import fingerprint

        return {**asdict(self.args.spec), "buckets": BUCKETS, "engine": "ddp", "loop": self.loop.describe(),
                "code": fingerprint.code(), "machine": fingerprint.machine(),
                "world_size": self.world_size, "batch_size": self.batch_size,
                "link": os.environ.get("GRADCOMP_LINK", "unshaped"), "torch": torch.__version__,
                "params": sum(p.numel() for p in self.net.parameters())}


def run_worker(spec: RunSpec, log_path: str, nproc: int, timeout_s: float) -> int:
    """Spawn ``nproc`` local ranks of ``spec``, bounded by ``timeout_s``; the exit status (0 when every
    rank succeeded)."""
    args = argparse.Namespace(spec=spec, suite_spec=asdict(spec), eval_every=spec.eval_every, log=log_path,
                              threads=1, timeout=RANK_TIMEOUT_S)
    return launch.spawn_ranks(run_rank, nproc, (StudyRun, args), max_time=timeout_s, name="convergence")
