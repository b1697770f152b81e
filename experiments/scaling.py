"""Scaling study from the cost model (:mod:`gradcomp.costmodel`), and its validation on this machine.

Model mode (no processes, seconds)::

    python -m experiments.scaling --out experiments/results/scaling

writes ``scaling.json`` (every prediction), ``scaling.md`` (table and crossover points) and
``scaling.png`` (bytes received per rank and predicted communication time vs P, log P): the
10.8M-parameter charlm transformer (counted from :mod:`experiments.workloads`) and a 350M-parameter
model; P = 2 .. 1024; links of 1, 10 and 100 Gbit/s. Flat exchanges (dense fp32 ring, fp16,
2-bit, the recipe's 3-bit and top-k 1% by allgather and by two-phase) run with one rank per node, every link at
the rate; the hierarchical exchange runs with 8 ranks per node (intra-node link
``--intra-gbit``, default 800 Gbit/s as NVLink-class; the node's link at the rate, shared by its
8 ranks). Gradients travel in DDP's 25 MB buckets, each one exchange (latency per bucket).
Kernel time is charged from ``bench_kernels`` JSON (``--bench``; CPU numba rates of this
machine by default; ``--no-compute`` leaves it out).

Validation mode (real Gloo ranks on loopback; :mod:`experiments.scaling_measure`)::

    python -m experiments.scaling --measure --out DIR [--links unshaped,1gbit] [--world-sizes 2,4]

times each exchange's collectives and the whole engine exchange on real ranks, over the unshaped
loopback and a link shaped by :mod:`experiments.netem`, and writes ``validation.json`` and
``validation.md`` (the model's prediction vs the measured time, from the link's own calibrated
alpha and beta). This module keeps the model study (predictions, tables, plot) and the command
line of both modes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence

from gradcomp import FP16, ThreeBit, TopK, TwoBit, exchanges
from gradcomp.costmodel import Cluster, Kernels, Link, gbit, predict

#: Kernel rates: the numba kernels on one thread (as each rank of the validation runs them) at 2^22 elements,
#: on the 2-core machine of ``results/scaling/validation/`` (``python -m experiments.bench_kernels --threads 1
#: --sizes 4194304 --backends numba --dtypes float32 --dists gaussian --densities 0.01``).
DEFAULT_BENCH = os.path.join(os.path.dirname(__file__), "results", "scaling", "bench_kernels_1thread.json")
WORLD_SIZES = tuple(2**i for i in range(1, 11))
RATES_GBIT = (1, 10, 100)
RANKS_PER_NODE = 8
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
LATENCY_S = 50e-6  # per message on Ethernet (TCP/Gloo-class)
INTRA_LATENCY_S = 5e-6
LARGE_MODEL = 350_000_000

#: The exchanges of the study, named by the registry (gradcomp.exchanges) after what they are.
DENSE, SUMMED = exchanges.names(sends_gradient=True)[0], exchanges.names(automatic=True, sends_gradient=False)[0]
FLAT, NODE_AWARE = exchanges.names(selectable=True), exchanges.names(node_aware=True)
#: (label, key, factory) of the compressors that the flat and node-aware exchanges carry: MXNet's 2-bit code with a
#: scale per tensor, the 3-bit code the recipe sends for "twobit" under SGD and Adam (1.7x its bytes), top-k 1 %.
COMPRESSED = (("2-bit", "twobit", lambda: TwoBit("rms")), ("3-bit (the recipe's)", "threebit", ThreeBit),
              ("top-k 1%", "topk", lambda: TopK(0.01)))
#: (label, exchange, compressor factory) of every curve: dense, fp16, each compressor by each flat
#: exchange, then 2-bit by each node-aware exchange.
CURVES = (("dense fp32", DENSE, None), ("fp16", SUMMED, FP16),
          *((f"{label} {exchanges.get(name).label}", name, factory)
            for label, _, factory in COMPRESSED for name in FLAT),
          *((f"{COMPRESSED[0][0]} {exchanges.get(name).label} ({RANKS_PER_NODE}/node)", name, COMPRESSED[0][2])
            for name in NODE_AWARE))


def charlm_numel() -> int:
    """Parameters of the default charlm transformer (tied embedding counted once)."""
    from experiments.workloads import CHARLM_PRESETS, CharTransformer

    return sum(p.numel() for p in CharTransformer(CHARLM_PRESETS["default"]).parameters())


def buckets(numel: int, element: int = 4) -> List[int]:
    """DDP-style buckets of at most :data:`BUCKET_BYTES`."""
    per = BUCKET_BYTES // element
    return [per] * (numel // per) + ([numel % per] if numel % per else [])


def kernels_for(exchange: str, factory, bench: Optional[str]) -> Kernels:
    if bench is None or factory is None or factory().summable:
        return Kernels()
    compressor = factory()
    if isinstance(compressor, TopK):
        return Kernels.from_bench(bench, "topk", density=compressor.density)
    return Kernels.from_bench(bench, "threebit" if isinstance(compressor, ThreeBit) else "twobit")


def predict_step(label: str, exchange: str, factory, numel: int, world_size: int, rate_gbit: float,
                 intra_gbit: float, kernels: Kernels) -> dict:
    """One curve's point: the sum over the model's buckets."""
    compressor = factory() if factory else None
    inter = Link(LATENCY_S, gbit(rate_gbit))
    if exchanges.get(exchange).node_aware:
        local = min(RANKS_PER_NODE, world_size)
        cluster = Cluster(world_size, Link(INTRA_LATENCY_S, gbit(intra_gbit)), inter, ranks_per_node=local)
    else:
        cluster = Cluster(world_size, inter, inter, ranks_per_node=1)
    totals = {"received_bytes": 0.0, "sent_bytes": 0.0, "comm_s": 0.0, "compute_s": 0.0}
    for size in buckets(numel):
        cost = predict(exchange, compressor, size, cluster, kernels)
        for key in totals:
            totals[key] += getattr(cost, key)
    return {"label": label, "exchange": exchange, "numel": numel, "world_size": world_size,
            "rate_gbit": rate_gbit, **totals, "total_s": totals["comm_s"] + totals["compute_s"]}


def study(bench: Optional[str], intra_gbit: float, world_sizes: Sequence[int] = WORLD_SIZES) -> List[dict]:
    models = {"charlm 10.8M": charlm_numel(), "350M": LARGE_MODEL}
    rows = []
    for model, numel in models.items():
        for rate in RATES_GBIT:
            for label, exchange, factory in CURVES:
                kernels = kernels_for(exchange, factory, bench)
                for p in world_sizes:
                    rows.append({"model": model, **predict_step(label, exchange, factory, numel, p, rate,
                                                                intra_gbit, kernels)})
    return rows


def crossovers(rows: List[dict]) -> List[dict]:
    """Per model, rate and curve: the smallest P at which it no longer beats dense fp32 (total time)."""
    found = []
    keys = sorted({(r["model"], r["rate_gbit"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for model, rate in keys:
        dense = {r["world_size"]: r["total_s"] for r in rows if (r["model"], r["rate_gbit"], r["label"])
                 == (model, rate, "dense fp32")}
        for label, _, _ in CURVES[1:]:
            points = sorted((r["world_size"], r["total_s"]) for r in rows
                            if (r["model"], r["rate_gbit"], r["label"]) == (model, rate, label))
            beats = [p for p, t in points if t < dense[p]]
            loses = [p for p, t in points if t >= dense[p]]
            if not beats:
                verdict = "never beats dense"
            elif not loses or max(beats) > max(loses):
                later = [p for p in loses if p > min(beats)]
                verdict = f"beats dense up to P={points[-1][0]}" if not later else f"stops at P={min(later)}"
            else:
                verdict = f"stops at P={min(p for p in loses if p > min(beats))}"
            found.append({"model": model, "rate_gbit": rate, "label": label, "verdict": verdict})
    return found


def _fmt_bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def write_markdown(rows: List[dict], path: str, bench: Optional[str], intra_gbit: float) -> None:
    present = sorted({r["world_size"] for r in rows})
    shown = [p for p in (2, 8, 32, 128, 512, 1024) if p in present] or present
    lines = ["# Scaling study (cost model)", "",
             f"alpha-beta model of gradcomp.costmodel; latency {LATENCY_S * 1e6:.0f} us per message; DDP buckets of "
             f"25 MB; flat exchanges one rank per node; hierarchical {RANKS_PER_NODE} ranks per node, intra-node "
             f"{intra_gbit:g} Gbit/s. Kernel time: {os.path.relpath(bench) if bench else 'left out'}.", "",
             "Predicted communication + kernel seconds per step (bytes received per rank in brackets; for the "
             "hierarchical exchange they include the dense intra-node traffic). Kernel rates measured on one "
             "thread of a 2-core CPU (numba) make compression look costly at 100 Gbit/s; GPU kernels are about two "
             "orders of magnitude faster. The dense ring is latency-bound at large P (2 (P - 1) messages per "
             "bucket); NCCL's trees would lower that part.", ""]
    for model in sorted({r["model"] for r in rows}):
        for rate in RATES_GBIT:
            lines += [f"## {model}, {rate} Gbit/s", "",
                      "| exchange | " + " | ".join(f"P={p}" for p in shown) + " |",
                      "|---|" + "---|" * len(shown)]
            for label, _, _ in CURVES:
                cells = []
                for p in shown:
                    row = next(r for r in rows if (r["model"], r["rate_gbit"], r["label"], r["world_size"])
                               == (model, rate, label, p))
                    cells.append(f"{row['total_s']:.3g} s ({_fmt_bytes(row['received_bytes'])})")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["## Crossover points (where an exchange stops beating dense fp32)", "",
              "| model | link | exchange | verdict |", "|---|---|---|---|"]
    for item in crossovers(rows):
        lines.append(f"| {item['model']} | {item['rate_gbit']} Gbit/s | {item['label']} | {item['verdict']} |")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def write_plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), len(RATES_GBIT) + 1, figsize=(5 * (len(RATES_GBIT) + 1), 4 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for column in range(len(RATES_GBIT) + 1):
            axis = axes[i][column]
            for label, _, _ in CURVES:
                rate = RATES_GBIT[max(column - 1, 0)]
                points = sorted((r["world_size"], r["received_bytes"] if column == 0 else r["total_s"]) for r in rows
                                if (r["model"], r["rate_gbit"], r["label"]) == (model, rate, label))
                axis.plot([p for p, _ in points], [v for _, v in points], marker=".", label=label)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("ranks P")
            if column == 0:
                axis.set_title(f"{model}: bytes received per rank per step")
            else:
                axis.set_title(f"{model}: predicted step comm time, {RATES_GBIT[column - 1]} Gbit/s")
                axis.set_ylabel("seconds")
            axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Here, not at the top: scaling_measure imports this module's curves.
    from experiments.scaling_measure import REPEATS, VALIDATION_NUMEL, measure, measure_worker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("experiments", "results", "scaling"))
    parser.add_argument("--bench", default=DEFAULT_BENCH, help="bench_kernels JSON for kernel throughputs")
    parser.add_argument("--no-compute", action="store_true", help="model communication only")
    parser.add_argument("--intra-gbit", type=float, default=800.0, help="intra-node link of the hierarchical case")
    parser.add_argument("--measure", action="store_true", help="validate the model on this machine")
    parser.add_argument("--links", default="unshaped,1gbit")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--numel", type=int, default=VALIDATION_NUMEL)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per measured run")
    parser.add_argument("--measure-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bench = None if args.no_compute else args.bench
    if args.measure_worker:
        return measure_worker(args.world_size, args.numel, args.repeats, args.json, args.timeout)
    os.makedirs(args.out, exist_ok=True)
    if args.measure:
        records = measure(args.out, [s.strip() for s in args.links.split(",") if s.strip()],
                          [int(p) for p in args.world_sizes.split(",")], args.numel, args.repeats, bench, args.timeout)
        print(open(os.path.join(args.out, "validation.md")).read())
        return 0 if all("error" not in r for r in records) else 1
    rows = study(bench, args.intra_gbit)
    with open(os.path.join(args.out, "scaling.json"), "w") as handle:
        json.dump({"rows": rows, "crossovers": crossovers(rows)}, handle, indent=1)
    write_markdown(rows, os.path.join(args.out, "scaling.md"), bench, args.intra_gbit)
    write_plot(rows, os.path.join(args.out, "scaling.png"))
    print(f"wrote {args.out}/scaling.json, scaling.md, scaling.png")
    for item in crossovers(rows):
        print(f"{item['model']:>13} {item['rate_gbit']:>4} Gbit/s  {item['label']:<28} {item['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
