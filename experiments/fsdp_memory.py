"""What error feedback costs under FSDP: residual bytes per rank for each residual option, measured.

Each option trains charlm (the 10.8M-parameter transformer) for a few steps under ``fully_shard`` through
:mod:`experiments.fsdp_train` (the one-call recipe, ``--steps`` long: its dense start, then compression) and
reads what the run logged at its end: the bytes of the residuals a rank keeps between steps
(``CompactResiduals.nbytes()``), the most bytes its float32 working pair took while one FSDP module was
exchanged, and the bytes the rank handed to collectives in its last step against FSDP's dense reduce-scatter.
For scale, the table also gives FSDP's own state per rank under AdamW (parameter, gradient and two moment
shards: 16 bytes per parameter / P) and the engine's default error feedback (a committed and a spare
float32 buffer: 8 bytes per parameter, as DDP keeps it).

Output (``--out``): ``fsdp_memory.json`` (one row per run) and ``fsdp_memory.md``. Example::

    python -m experiments.fsdp_memory --out experiments/results/fsdp-memory --nproc 2,4
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.catalog import read_log

#: (label, --residual-dtype, --residual-share)
OPTIONS = (("float32", "float32", 1.0), ("bfloat16", "bfloat16", 1.0), ("float32, largest 90%", "float32", 0.9),
           ("float32, largest 50%", "float32", 0.5))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(method: str, option: tuple, nproc: int, steps: int, out: str) -> dict:
    """One run of ``method`` with the residual ``option``; its row."""
    label, dtype, share = option
    log = os.path.join(out, "runs", f"{method}__{dtype}__{share}__p{nproc}.jsonl")
    command = [sys.executable, "-m", "experiments.fsdp_train", "--workload", "charlm", "--compressor", method,
               "--steps", str(steps), "--nproc", str(nproc), "--eval-windows", "16", "--no-progress", "--log", log,
               "--residual-dtype", dtype, "--residual-share", str(share), "--max-time", "1800"]
    status = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1900).returncode
    records = read_log(log)
    config = next((r for r in records if r.get("event") == "config"), {})
    summary = next((r for r in records if r.get("event") == "summary"), {})
    last = [r for r in records if r.get("event") == "step"][-1:] or [{}]
    params = config.get("params")
    return {"method": method, "option": label, "nproc": nproc, "status": status, "params": params,
            "residual_bytes": summary.get("residual_bytes"), "working_peak_bytes": summary.get(
                "residual_working_peak_bytes"), "bytes_sent": last[0].get("bytes_sent"),
            "dense_bytes": last[0].get("dense_bytes"),
            "fsdp_adamw_state_bytes": 16 * params // nproc if params else None,
            "engine_default_bytes": 8 * params if params else None}


def markdown(rows) -> str:
    lines = ["| ranks | method | residuals | kept per rank (MB) | bytes / parameter | while a module is exchanged "
             "(MB) | sent / FSDP dense | FSDP's AdamW state per rank (MB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["residual_bytes"] is None:
            lines.append(f"| {r['nproc']} | {r['method']} | {r['option']} | failed ({r['status']}) | | | | |")
            continue
        lines.append(f"| {r['nproc']} | {r['method']} | {r['option']} | {r['residual_bytes'] / 1e6:.2f} | "
                     f"{r['residual_bytes'] / r['params']:.2f} | +{r['working_peak_bytes'] / 1e6:.2f} | "
                     f"{r['bytes_sent'] / r['dense_bytes']:.3f} | {r['fsdp_adamw_state_bytes'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--nproc", default="2", help="comma-separated world sizes")
    parser.add_argument("--methods", default="topk,twobit")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (a dense start, then compressed)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    rows = []
    for nproc in (int(n) for n in args.nproc.split(",")):
        for method in args.methods.split(","):
            for option in OPTIONS:
                rows.append(measure(method, option, nproc, args.steps, args.out))
                print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "fsdp_memory.json"), "w") as f:
        json.dump(rows, f, indent=1)
    table = markdown(rows)
    with open(os.path.join(args.out, "fsdp_memory.md"), "w") as f:
        f.write("# Residual memory under FSDP (charlm, measured)\n\n" + table)
    print(table)
    return 0 if all(r["residual_bytes"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
