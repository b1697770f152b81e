"""The comparison's outputs (:mod:`experiments.compare`): one record per run from its log, the
noop floor, the table and the files.

* :func:`summarize_log`: medians over the steps after the warm-up, the final evaluation.
* :func:`add_floor_fields`: compute, communication and the step time over the noop floor.
* :func:`write_results`: ``summary.json``, ``summary.csv``, ``meta.json`` and ``results.md``.
"""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
from typing import List, Optional

from experiments.catalog import RECORD_FIELDS, link_key, read_log

__all__ = ["summarize_log", "add_floor_fields", "fmt", "markdown_table", "write_results", "WARMUP_SKIP"]

WARMUP_SKIP = 5  # steps left out of medians (capped at half the run)


def _median(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def summarize_log(path: str) -> dict:
    """Medians over the steps after warm-up, the final evaluation, and run metadata."""
    records = read_log(path)
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    config = next((r for r in records if r.get("event") == "config"), {})
    summary = next((r for r in records if r.get("event") == "summary"), {})
    skip = min(WARMUP_SKIP, len(steps) // 2)
    timed = steps[skip:]
    out = {
        "params": config.get("params"),
        "step_time_s": _median([s["step_time_s"] for s in timed]),
        "compress_s": _median([s.get("compress_s", 0.0) for s in timed]),
        "bytes_per_step": _median([s.get("bytes_sent") for s in timed]),
        "dense_bytes_per_step": _median([s.get("dense_bytes") for s in timed]),
        "wire_bytes_per_step": _median([s.get("wire_bytes") for s in timed]),
        "train_time_s": steps[-1]["train_time_s"] if steps else None,
        "final_train_loss": summary.get("final_train_loss"),
        "final_loss": evals[-1]["eval_loss"] if evals else None,
        "accuracy": evals[-1].get("accuracy") if evals else None,
        "twobit_threshold": summary.get("twobit_threshold"),
    }
    sent, dense = out["bytes_per_step"], out["dense_bytes_per_step"]
    out["compression_ratio"] = dense / sent if sent and dense else None
    return out


def add_floor_fields(records: List[dict]) -> None:
    """``compute_s``, ``comm_s`` and ``step_time_over_floor`` from each group's noop run."""
    floors = {
        (r["workload"], link_key(r)): r["step_time_s"]
        for r in records
        if r["method"] == "noop" and r.get("step_time_s") and r["status"] == "ok"
    }
    for r in records:
        floor = floors.get((r["workload"], link_key(r)))
        step, compress = r.get("step_time_s"), r.get("compress_s") or 0.0
        if floor and step:
            r["compute_s"] = floor if r["method"] != "noop" else step
            r["step_time_over_floor"] = step / floor
            r["comm_s"] = max(0.0, step - floor - compress) if r["method"] != "noop" else 0.0
        else:
            r["compute_s"] = r["comm_s"] = r["step_time_over_floor"] = None


def fmt(value, digits=3, scale=1.0, suffix=""):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value * scale:.{digits}f}{suffix}"


def markdown_table(records: List[dict]) -> str:
    header = (
        "| workload | link | method | step time (s) | × noop floor | compute (s) | compress (s) | comm (s) "
        "| sent MB/step | ratio | wire MB/step | held-out loss | accuracy | status |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in records:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["workload"],
                    link_key(r),
                    r["method"],
                    fmt(r.get("step_time_s")),
                    fmt(r.get("step_time_over_floor"), 2, suffix="×"),
                    fmt(r.get("compute_s")),
                    fmt(r.get("compress_s"), 4),
                    fmt(r.get("comm_s")),
                    fmt(r.get("bytes_per_step"), 3, 1e-6),
                    fmt(r.get("compression_ratio"), 1, suffix="×"),
                    fmt(r.get("wire_bytes_per_step"), 3, 1e-6),
                    fmt(r.get("final_loss")),
                    fmt(r.get("accuracy"), 3),
                    r["status"],
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def write_results(out: str, records: List[dict], meta: dict) -> str:
    """``summary.json``, ``summary.csv``, ``meta.json`` and ``results.md``; returns the table."""
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(RECORD_FIELDS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    table = markdown_table(records)
    fallback = [r for r in records if r.get("link_fallback")]
    notes = [
        f"# gradcomp comparison ({meta['mode']})",
        "",
        f"{meta['started']} · {meta['host']} · {meta['cpus']} CPUs · torch {meta['torch']} · "
        f"{meta['nproc']} ranks × {meta['threads']} thread(s) · Gloo · load average {meta['load_before']} before, "
        f"{meta['load_after']} after · {meta['wall_s']:.0f} s",
        "",
    ]
    if fallback:
        notes += [
            "> **WARNING: link shaping was not available; runs asked for a shaped link ran on the UNSHAPED "
            f"loopback** ({fallback[0].get('link_fallback_reason')}). Their step times do not reflect that link.",
            "",
        ]
    notes += [
        table,
        "",
        "* **step time**: median wall time of forward + backward (including the completed collectives) + "
        f"optimizer step on rank 0, over the steps after the first {WARMUP_SKIP} (capped at half the run).",
        "* **× noop floor**: ÷ the step time of torch's `noop_hook` (no communication) on the same workload and link.",
        "* **compute** = the noop step time; **compress** = time inside the compression hook on the training thread "
        "(gradcomp: its own timer; fp16/PowerSGD: the hook's synchronous part, so PowerSGD's matmuls in its "
        "callbacks count as comm); **comm** = step − compute − compress (exposed communication, decompression, "
        "waiting).",
        "* **sent MB/step**: bytes each rank hands to collectives per step; with 2 ranks equal to its bytes on the "
        "wire. **wire MB/step**: measured on the namespace loopback (shaped links only), per rank.",
        "* **links**: a tbf-shaped loopback in a private network namespace; both ranks share it, so the rate is the "
        "aggregate of both directions (a shared medium, harsher than full-duplex NICs of that rate).",
        "* **held-out loss**: charlm: nats per byte on held-out stdlib files; digits: test cross-entropy. The noop "
        "run does not average gradients, so its loss is not a data-parallel result.",
        "* 2-bit threshold: 4 × the RMS of the averaged gradient after the dense warm-up (see experiments/train.py).",
    ]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(notes) + "\n")
    return table
