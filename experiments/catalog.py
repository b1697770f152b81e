"""What the experiments compare and record, in one place: the gradient-communication
methods (names, order, colours, the gradcomp compressor behind each), the fields of a
comparison record, and the reading of a run's JSON-lines log.

``train`` runs one method, ``compare`` runs many and summarizes their logs, ``plots``
draws them; all three take their tables from here, so a new method is added once.
This module imports neither torch nor gradcomp: launchers that only start processes
stay fast.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass(frozen=True)
class Method:
    """One way of exchanging gradients in a DDP run.

    ``compressor`` is the gradcomp registry name (``gradcomp.compressors.from_spec``) for
    gradcomp's methods and ``None`` for torch's own; ``setting`` is the ``train``
    argument that completes the spec (``topk`` + ``--density 0.01`` -> ``"topk:0.01"``).
    ``timing`` methods take part in the step-time comparison on every link; the others
    are about convergence only. ``recipe`` methods register through the one-call recipe
    (``optimizer=``, ``total_steps=``, ``scheduler=``: the schedule and optimizer stage derived
    from the run); the others are plain error feedback into the optimizer, kept as ablations.
    """

    name: str
    description: str
    color: str
    compressor: Optional[str] = None
    setting: Optional[str] = None
    error_feedback: bool = True
    timing: bool = True
    recipe: bool = True

    @property
    def dashed(self) -> bool:
        """Drawn dashed: the variants without error feedback share their method's colour."""
        return self.compressor is not None and not self.error_feedback


_METHODS = (
    Method("noop", "torch's noop_hook: no communication, so gradients are not averaged; the compute floor of "
           "step times (its loss is not a data-parallel result)", "#7f7f7f"),
    Method("dense", "DDP's built-in allreduce (no hook)", "#1f77b4"),
    Method("fp16", "torch's fp16_compress_hook", "#17becf"),
    Method("powersgd", "torch's powerSGD_hook, rank 4, error feedback and warm start", "#9467bd"),
    Method("topk", "gradcomp top-k (--density), the one-call recipe for the optimizer", "#d62728", "topk",
           "density"),
    Method("twobit", "gradcomp 2-bit (--threshold, default rms), the one-call recipe for the optimizer", "#2ca02c",
           "twobit", "threshold"),
    Method("auto", "gradcomp.Auto with the top-k recipe: per bucket the fastest of dense, fp16, 2-bit and top-k "
           "on the link it measured during warm-up, each running its recipe", "#ff7f0e"),
    Method("topk-noef", "the top-k recipe without error feedback", "#d62728", "topk", "density", False, False),
    Method("twobit-noef", "the 2-bit recipe without error feedback", "#2ca02c", "twobit", "threshold", False, False),
    Method("topk-naive", "top-k with plain error feedback into the optimizer, 2 dense steps, whole buckets (no "
           "recipe)", "#8c564b", "topk", "density", True, False, False),
    Method("twobit-naive", "2-bit with plain error feedback into the optimizer, 2 dense steps, whole buckets (no "
           "recipe)", "#bcbd22", "twobit", "threshold", True, False, False),
)  # fmt: skip

#: Every method by name, in the order tables and plots show them.
METHODS: Dict[str, Method] = {method.name: method for method in _METHODS}
ALL_METHODS = tuple(METHODS)
TIMING_METHODS = tuple(name for name, method in METHODS.items() if method.timing)
GRADCOMP_METHODS = tuple(name for name, method in METHODS.items() if method.compressor)

#: The fields of a comparison record (``summary.json``/``summary.csv``), in column order.
RECORD_FIELDS = (
    "workload", "method", "parallel", "link", "link_requested", "shaped", "link_fallback", "status",
    "steps", "step_time_s", "step_time_over_floor", "compute_s", "compress_s", "comm_s",
    "bytes_per_step", "dense_bytes_per_step", "compression_ratio", "wire_bytes_per_step",
    "final_loss", "final_train_loss", "accuracy", "train_time_s", "twobit_threshold",
    "params", "nproc", "threads", "wall_s", "load_avg_1m", "log",
)  # fmt: skip


def method_order(name: str) -> int:
    """Sort key: a method's place in :data:`METHODS` (unknown names last)."""
    return ALL_METHODS.index(name) if name in METHODS else len(ALL_METHODS)


def link_key(record: dict) -> str:
    """How a record's link is shown: its label, or ``unshaped (asked 1gbit)`` on fallback."""
    if record.get("link_fallback"):
        return f"unshaped (asked {record.get('link_requested')})"
    return record["link"]


def read_log(path: str) -> List[dict]:
    """The records of a ``train`` log (a missing file gives none, a truncated one what
    precedes the broken line)."""
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    except FileNotFoundError:
        pass
    return records
