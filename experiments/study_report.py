"""The convergence study's outputs: one row per run from its log, the table, the plots.

:func:`aggregate` reads every complete log of a study directory and writes ``convergence.json``
(one row per run), ``convergence.md`` (the table, and a summary per cell: the gap to dense and the
compression, with the spread over seeds) and held-out loss plots per workload and optimizer.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict
from typing import Dict, List, Optional

__all__ = ["read_log", "is_complete", "is_current", "summarize", "aggregate", "markdown", "cell_summary"]

def read_log(path: str) -> List[dict]:
    records = []
    if not os.path.exists(path):
        return records
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a run cut off mid-line
    return records


def is_complete(path: str) -> bool:
    return any(r.get("event") == "done" for r in read_log(path))


def is_current(path: str) -> bool:
    """Whether the log at ``path`` is complete and was made by the code a run executes now
    (:func:`experiments.fingerprint.code` in its ``config``); a study reuses only such a log."""
    from experiments import fingerprint

    records = read_log(path)
    config = next((r for r in records if r.get("event") == "config"), {})
    return any(r.get("event") == "done" for r in records) and config.get("code") == fingerprint.code()


def summarize(spec, path: str) -> Optional[dict]:
    """One row from a complete log (``None`` if the log is incomplete)."""
    records = read_log(path)
    if not any(r.get("event") == "done" for r in records):
        return None
    config = next(r for r in records if r.get("event") == "config")
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval" and r["step"] >= 0]
    final = evals[-1]
    bytes_total = sum(r["bytes_sent"] for r in steps)
    dense_total = sum(r["dense_bytes"] for r in steps)
    skip = min(len(steps) // 2, 5)
    return {
        **asdict(spec),
        "buckets": config.get("buckets", "default"),
        "engine": config.get("engine", "ddp"),
        "parallel": config.get("parallel", "ddp"),
        "code": config.get("code"),
        "machine": config.get("machine"),  # None in logs from before experiments.fingerprint.machine
        "final_loss": final["eval_loss"],
        "final_accuracy": final.get("accuracy"),
        "bytes_total": bytes_total,
        "dense_bytes_total": dense_total,
        "compression": dense_total / bytes_total if bytes_total else None,
        "train_time_s": steps[-1]["train_time_s"],
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steps[skip:]),
        "final_eval": {k: v for k, v in final.items() if k not in ("event", "step", "train_time_s")},
        "final_train_loss": statistics.fmean(r["loss"] for r in steps[-max(1, min(50, len(steps) // 5)) :]),
        "link": config.get("link"),
        "evals": [(r["step"], r["train_time_s"], r["eval_loss"]) for r in evals],
        # Bytes by eval, for time on a link (experiments.time_to_accuracy): the dense start and the ramp
        # send more than the final setting, so the final setting's step time alone would flatter a run.
        "bytes_to_eval": _bytes_to(steps, [r["step"] for r in evals]),
        "start_to_eval": _bytes_to([r for r in steps if _is_cast(r)], [r["step"] for r in evals], count=True),
        "final_bytes_share": steps[-1]["bytes_sent"] / steps[-1]["dense_bytes"] if steps[-1]["dense_bytes"] else 1.0,
        "eval_accuracy": [r["accuracy"] for r in evals] if "accuracy" in final else None,
        "log": os.path.relpath(path),
    }


def _bytes_to(steps: List[dict], at: List[int], count: bool = False) -> List[List[int]]:
    """``[sent, dense]``: the bytes sent and the bytes dense would have sent in steps ``0..a`` for
    each ``a`` of ``at`` (ascending); ``count``: ``[steps, sent, dense]``."""
    out, sent, dense, index = [], 0, 0, 0
    for a in at:
        while index < len(steps) and steps[index]["step"] <= a:
            sent, dense, index = sent + steps[index]["bytes_sent"], dense + steps[index]["dense_bytes"], index + 1
        out.append([index, sent, dense] if count else [sent, dense])
    return out


def _is_cast(step: dict) -> bool:
    """Whether a step's record is one of the recipe's dense start in fp16: half of dense's bytes or more, not
    all (a compressed step sends a quarter at most, the ramp's densest top-k, with the small tensors dense)."""
    return step["dense_bytes"] > 0 and 0.5 <= step["bytes_sent"] / step["dense_bytes"] < 1.0


def same_machine(row: dict, reference: dict) -> Optional[bool]:
    """Whether one machine made both runs (``None`` where either does not say)."""
    if row.get("machine") and reference.get("machine"):
        return row["machine"] == reference["machine"]
    return None


def add_dense_comparisons(rows: List[dict]) -> None:
    """``time_to_dense_loss_s`` and ``gap_to_dense`` against the dense run of the same
    workload, optimizer, seed, steps and parallelism (DDP or FSDP), and ``same_machine_as_dense``: whether one
    machine made both (``None`` where either row does not say; :func:`experiments.fingerprint.machine`)."""
    def cell(r):  # FSDP runs compare with FSDP's dense
        return r["workload"], r["optimizer"], r["seed"], r["steps"], r.get("parallel", "ddp")

    dense = {cell(r): r for r in rows if r["method"] == "dense"}
    for row in rows:
        reference = dense.get(cell(row))
        row["time_to_dense_loss_s"] = None
        row["gap_to_dense"] = None
        row["time_vs_dense"] = None
        row["accuracy_gap"] = None
        row["same_machine_as_dense"] = None
        if reference is None:
            continue
        row["same_machine_as_dense"] = same_machine(row, reference)
        target = reference["final_loss"]
        row["gap_to_dense"] = row["final_loss"] / target - 1
        if row.get("final_accuracy") is not None and reference.get("final_accuracy") is not None:
            row["accuracy_gap"] = row["final_accuracy"] - reference["final_accuracy"]
        for _, train_time, loss in row["evals"]:
            if loss <= target:
                row["time_to_dense_loss_s"] = train_time
                break
        if row["time_to_dense_loss_s"] is not None and reference["train_time_s"]:
            row["time_vs_dense"] = row["time_to_dense_loss_s"] / reference["train_time_s"]


def _fmt(value, pattern="{:.3f}") -> str:
    return "–" if value is None else pattern.format(value)


#: What a table appends to a figure whose run and dense's were made on two machines.
OTHER_MACHINE = " (dense: another machine)"


def _gap(row: dict) -> str:
    """The gap to dense, said to be across machines where it is (a run parts from another machine's)."""
    gap = _fmt(row["gap_to_dense"], "{:+.1%}")
    return gap + OTHER_MACHINE if row.get("same_machine_as_dense") is False else gap


def markdown(rows: List[dict]) -> str:
    """Every run: final held-out loss (and accuracy), the gap to dense, the bytes."""
    lines = ["| workload | optimizer | method | seed | steps | final loss | gap to dense | accuracy | "
             "dense bytes / sent | engine |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['optimizer']} | {r['method']} | {r['seed']} | {r['steps']} | "
            f"{_fmt(r['final_loss'])} | {_gap(r)} | {_fmt(r['final_accuracy'], '{:.3f}')} | "
            f"{_fmt(r['compression'], '{:.1f}x')} | {r['engine']} |")
    return "\n".join(lines) + "\n"


def cell_summary(rows: List[dict]) -> List[dict]:
    """One entry per workload x optimizer x method: the median gap to dense over seeds (accuracy
    points for classifiers), its range, the seeds, the least compression."""
    cells: Dict[tuple, List[dict]] = {}
    for row in rows:
        cells.setdefault((row["workload"], row["optimizer"], row["method"]), []).append(row)
    summary = []
    for (workload, optimizer, method), members in sorted(cells.items()):
        gaps = [r["gap_to_dense"] for r in members if r["gap_to_dense"] is not None]
        points = [r["accuracy_gap"] for r in members if r.get("accuracy_gap") is not None]
        summary.append({"workload": workload, "optimizer": optimizer, "method": method,
                        "seeds": sorted(r["seed"] for r in members),
                        "gap_median": statistics.median(gaps) if gaps else None,
                        "gap_range": (min(gaps), max(gaps)) if gaps else None,
                        "accuracy_points_median": statistics.median(points) if points else None,
                        "loss_median": statistics.median(r["final_loss"] for r in members),
                        "compression_min": min((r["compression"] or 0) for r in members)})
    return summary


def cell_markdown(summary: List[dict]) -> str:
    lines = ["| workload | optimizer | method | held-out loss (median) | gap to dense (median, range) | "
             "accuracy vs dense (points) | dense bytes / sent (least) | seeds |", "|---|---|---|---|---|---|---|---|"]
    for c in summary:
        gap = "–" if c["gap_median"] is None else (f"{c['gap_median']:+.1%} ({c['gap_range'][0]:+.1%} .. "
                                                   f"{c['gap_range'][1]:+.1%})")
        points = "–" if c["accuracy_points_median"] is None else f"{c['accuracy_points_median'] * 100:+.1f}"
        lines.append(f"| {c['workload']} | {c['optimizer']} | {c['method']} | {c['loss_median']:.3f} | {gap} | "
                     f"{points} | {c['compression_min']:.1f}x | {','.join(map(str, c['seeds']))} |")
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], out: str, method_order) -> List[str]:
    """Held-out loss vs step and vs training time, one figure per workload x optimizer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["optimizer"]), []).append(row)
    for (workload, optimizer), members in sorted(groups.items()):
        for axis, index, label in (("step", 0, "step"),):  # time on a link: experiments.time_to_accuracy
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for row in sorted(members, key=lambda r: (method_order(r["method"]), r["seed"])):
                xs = [e[index] for e in row["evals"]]
                ys = [e[2] for e in row["evals"]]
                style = "--" if ("noef" in row["method"] or "plain" in row["method"]) else "-"
                ax.plot(xs, ys, style, label=f"{row['method']} s{row['seed']}", linewidth=1.2)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out loss")
            ax.set_title(f"{workload}, {optimizer}")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            path = os.path.join(out, f"{workload}_{optimizer}_loss_vs_{axis}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def _kept_rows(out: str, logs: set) -> List[dict]:
    """The rows of ``out/convergence.json`` whose log is not in ``logs`` (file names): the logs are not
    committed, so a study continued on another machine keeps the runs made before (each row's ``code``
    says which code made it)."""
    path = os.path.join(out, "convergence.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [row for row in json.load(f) if os.path.basename(row.get("log") or "") not in logs]


def aggregate(out: str, specs: list, spec_type, method_order) -> List[dict]:
    """Rows from every complete log in ``out/runs`` (those of ``specs`` first), and those of the existing
    ``convergence.json`` whose log is not here (:func:`_kept_rows`); writes the JSON, the table and the
    plots."""
    runs_dir = os.path.join(out, "runs")
    rows = []
    seen = set()
    known = {spec.stem: spec for spec in specs}
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        if not name.endswith(".jsonl"):
            continue
        stem = name[: -len(".jsonl")]
        spec = known.get(stem)
        if spec is None:
            config = next((r for r in read_log(os.path.join(runs_dir, name)) if r.get("event") == "config"), None)
            if config is None:
                continue
            spec = spec_type(**{k: config[k] for k in spec_type.__dataclass_fields__})
        row = summarize(spec, os.path.join(runs_dir, name))
        if row is not None and stem not in seen:
            seen.add(stem)
            rows.append(row)
    rows += _kept_rows(out, {os.path.basename(r["log"]) for r in rows})
    rows.sort(key=lambda r: (r["workload"], r["optimizer"], method_order(r["method"]), r["seed"]))
    add_dense_comparisons(rows)
    with open(os.path.join(out, "convergence.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "convergence.md"), "w") as f:
        f.write("# Convergence study\n\n## Cells\n\n" + cell_markdown(cell_summary(rows)) + "\n## Runs\n\n"
                + markdown(rows))
    plot(rows, out, method_order)
    return rows


