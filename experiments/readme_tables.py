"""The README's tables of figures, generated from the studies' own output files, never typed.

Each table sits between ``<!-- generated: NAME -->`` and ``<!-- /generated -->`` in the README;
``python -m experiments.readme_tables`` rewrites them from the result files below, and ``--check``
fails (exit 1) when the README differs from what the results say (``tests/test_readme.py`` runs it):

================  =============================================================================
``convergence``   ``experiments/results/convergence/convergence.json`` (``experiments.convergence``):
                  per workload and optimizer, the held-out loss of dense and the gap of top-k and
                  2-bit to it (median over seeds; accuracy points for classifiers), with the bytes
``time``          ``experiments/results/main/time_to_accuracy/time_to_accuracy.json`` (the main job,
                  ``experiments.compare --quick``): time to dense's quality per link and method
``study-time``    ``experiments/results/time_to_accuracy/time_to_accuracy.json``: the same for every
                  workload and optimizer of the convergence study, top-k and 2-bit per link
``horovod-time``  ``experiments/results/horovod-tta/time_to_accuracy/time_to_accuracy.json``: the
                  main job's cell on the Horovod path (``convergence --parallel horovod``,
                  ``experiments.horovod_step_times``)
================  =============================================================================

and ``study-accuracy``, the classifiers' cells of ``study-time`` timed to dense's final accuracy less half a point
(the same file); ``fsdp-convergence``, the convergence table of the runs under FSDP2 against FSDP's own dense
(``experiments/results/fsdp-convergence/convergence.json``, ``experiments.convergence --parallel fsdp``), and
``auto``, what ``Auto`` chose on each link of the main job's step times and its step against dense's
(``experiments/results/main/step_times/``: ``policy_choices.json`` and the step-time rows).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable, Dict, List

from experiments.study_report import cell_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = {"convergence": "experiments/results/convergence/convergence.json",
           "time": "experiments/results/main/time_to_accuracy/time_to_accuracy.json",
           "study-time": "experiments/results/time_to_accuracy/time_to_accuracy.json",
           "study-accuracy": "experiments/results/time_to_accuracy/time_to_accuracy.json",
           "horovod-time": "experiments/results/horovod-tta/time_to_accuracy/time_to_accuracy.json",
           "fsdp-convergence": "experiments/results/fsdp-convergence/convergence.json",
           "auto": "experiments/results/main/step_times/policy_choices.json"}
#: The step-time rows of the run whose ``Auto`` choices the ``auto`` table shows.
AUTO_STEP_TIMES = "experiments/results/main/step_times/step_times_charlm-small_adamw.json"
LINK_ORDER = ("10mbit", "100mbit", "1gbit", "10gbit", "unshaped")
_BLOCK = re.compile(r"(<!-- generated: (\w[\w-]*) -->\n)(.*?)(<!-- /generated -->)", re.S)


def _cell(summary: Dict[tuple, dict], key: tuple) -> str:
    cell = summary.get(key)
    if cell is None:
        return "–"
    if cell["accuracy_points_median"] is not None:
        figure = f"{cell['accuracy_points_median'] * 100:+.1f} points"
    else:
        figure = f"{cell['gap_median']:+.1%}"
    seeds = len(cell["seeds"])
    return f"{figure}, {cell['compression_min']:.1f}x" + (f" ({seeds} seeds)" if seeds > 1 else "")


def convergence_table(rows: List[dict]) -> str:
    """Per workload x optimizer: dense's held-out loss (or accuracy), top-k's and 2-bit's gap."""
    summary = {(c["workload"], c["optimizer"], c["method"]): c for c in cell_summary(rows)}
    steps = {(r["workload"]): r["steps"] for r in rows}
    accuracy = {(r["workload"], r["optimizer"]): r["final_accuracy"] for r in rows if r["method"] == "dense"}
    lines = ["| workload (steps) | optimizer | dense | top-k 1% vs dense, bytes "
             "| 2-bit (the recipe's 3-bit) vs dense, bytes |",
             "|---|---|---|---|---|"]
    for workload, optimizer in sorted({(c[0], c[1]) for c in summary}):
        dense = summary.get((workload, optimizer, "dense"))
        if dense is None:
            continue
        held = accuracy.get((workload, optimizer))
        shown = f"{held:.3f} accuracy" if held is not None else f"{dense['loss_median']:.3f}"
        lines.append(f"| {workload} ({steps[workload]}) | {optimizer} | {shown} | "
                     f"{_cell(summary, (workload, optimizer, 'topk'))} | "
                     f"{_cell(summary, (workload, optimizer, 'twobit'))} |")
    return "\n".join(lines) + "\n"


#: The mark of a time ratio whose runs and dense's were made on two machines (the tables' notes say so).
OTHER_MACHINE_MARK = "†"


def _ratio(row, field: str = "time_ratio_vs_dense") -> str:
    """A time-to-accuracy row's time ratio (``field``) as a table cell: ``–`` without a row, ``never``, or ``0.42x``;
    marked :data:`OTHER_MACHINE_MARK` where the row's runs and dense's were made on two machines."""
    if row is None:
        return "–"
    mark = OTHER_MACHINE_MARK if row.get("same_machine_as_dense") is False else ""
    return ("never" if row[field] is None else f"{row[field]:.2f}x") + mark


def _machine_note(rows: List[dict]) -> str:
    """The note on :data:`OTHER_MACHINE_MARK`, where a row carries it (else nothing)."""
    if not any(r.get("same_machine_as_dense") is False for r in rows):
        return ""
    return (f" {OTHER_MACHINE_MARK}: some seed's run and dense's run were made on two machines, whose runs of one "
            "code and seed part (`experiments/results/research-shapes-sgd-seeds/`).")


def _timing_facts(rows: List[dict]) -> tuple:
    """``(spreads between rounds, paired-ratio spreads of the methods other than dense, loads before)``."""
    spreads = [r["spread"] for r in rows if r.get("spread") is not None]
    paired = [r["ratio_spread"] for r in rows if r.get("ratio_spread") is not None and r["method"] != "dense"]
    loads = sorted({str(r["load_before"]) for r in rows if r.get("load_before") is not None})
    return spreads, paired, loads


def time_table(rows: List[dict]) -> str:
    """Per link: dense's step over its compute, and each method's time to dense's quality."""
    methods = [m for m in ("dense", "fp16", "powersgd", "topk", "twobit", "auto")
               if any(r["method"] == m for r in rows)]
    links = sorted({r["link"] for r in rows}, key=lambda link: -LINK_ORDER.index(link))
    lines = ["| link | dense step / compute | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for link in links:
        at = {r["method"]: r for r in rows if r["link"] == link}
        dense = at.get("dense", {})
        over = dense.get("dense_step_over_compute")
        cells = []
        for method in methods:
            cells.append(_ratio(at.get(method)))
        lines.append(f"| {link} | {'–' if over is None else f'{over:.2f}'} | " + " | ".join(cells) + " |")
    spreads, paired, loads = _timing_facts(rows)
    if spreads:
        lines.append(f"\nStep times: medians of interleaved rounds, spread between rounds {min(spreads):.0%}–"
                     f"{max(spreads):.0%}; load before the timing: {', '.join(loads) or 'not recorded'}.")
    if paired:
        lines.append(f"Each method's step is dense's times its ratio to dense paired step by step (the steps taken in "
                     f"turn); those ratios spread {min(paired):.1%}–{max(paired):.1%} between rounds.")
    if _machine_note(rows):
        lines.append(_machine_note(rows).strip())
    return "\n".join(lines) + "\n"


def study_time_table(rows: List[dict]) -> str:
    """Per workload x optimizer, per link: top-k's and 2-bit's time to dense's quality, and dense's step
    over its compute (where the exchange dominates, compression can pay)."""
    links = sorted({r["link"] for r in rows}, key=LINK_ORDER.index)
    at = {(r["workload"], r["optimizer"], r["method"], r["link"]): r for r in rows}
    lines = ["| workload | optimizer | " + " | ".join(links) + " |", "|---|---|" + "---|" * len(links)]
    for workload, optimizer in sorted({(r["workload"], r["optimizer"]) for r in rows}):
        cells = []
        for link in links:
            dense = at.get((workload, optimizer, "dense", link)) or {}
            over = dense.get("dense_step_over_compute")
            cells.append(f"{_ratio(at.get((workload, optimizer, 'topk', link)))} / "
                         f"{_ratio(at.get((workload, optimizer, 'twobit', link)))}"
                         + ("" if over is None else f" ({over:.1f})"))
        lines.append(f"| {workload} | {optimizer} | " + " | ".join(cells) + " |")
    spreads, paired, loads = _timing_facts(rows)
    lines.append(f"\nEach cell: top-k's / 2-bit's time to the target ÷ dense's time to its own final loss (dense's "
                 f"step ÷ the step without communication). Step times: spread between rounds {min(spreads):.0%}–"
                 f"{max(spreads):.0%}, paired ratios {min(paired or [0]):.1%}–{max(paired or [0]):.1%}; load before "
                 f"the timing run: {', '.join(loads) or 'not recorded'}." + _machine_note(rows))
    return "\n".join(lines) + "\n"


def study_accuracy_table(rows: List[dict]) -> str:
    """The classifiers' cells of :func:`study_time_table` timed by accuracy: top-k's and 2-bit's time to dense's
    final accuracy less half a point, over dense's time to its own final accuracy."""
    rows = [r for r in rows if r.get("accuracy_target") is not None]
    links = sorted({r["link"] for r in rows}, key=LINK_ORDER.index)
    at = {(r["workload"], r["optimizer"], r["method"], r["link"]): r for r in rows}
    field = "accuracy_time_ratio_vs_dense"
    lines = ["| workload | optimizer | " + " | ".join(links) + " |", "|---|---|" + "---|" * len(links)]
    for workload, optimizer in sorted({(r["workload"], r["optimizer"]) for r in rows}):
        cells = [f"{_ratio(at.get((workload, optimizer, 'topk', link)), field)} / "
                 f"{_ratio(at.get((workload, optimizer, 'twobit', link)), field)}" for link in links]
        lines.append(f"| {workload} | {optimizer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def auto_table(choices: Dict[str, List[dict]]) -> str:
    """Per link: what ``Auto`` chose in the last round (groups and elements per choice), the candidates its
    trials rejected, and its step against dense's, paired step by step (:data:`AUTO_STEP_TIMES`)."""
    with open(os.path.join(ROOT, AUTO_STEP_TIMES)) as f:
        ratios = {r["link"]: r.get("ratio_vs_dense") for r in json.load(f) if r["method"] == "auto"}
    lines = ["| link | Auto's choice (groups, elements) | candidates its trials rejected | its step ÷ dense's |",
             "|---|---|---|---|"]
    for key in sorted(choices, key=lambda k: -LINK_ORDER.index(k.split("|")[1])):
        last, link = choices[key][-1], key.split("|")[1]
        chosen = ", ".join(f"{name} ({groups}, {numel:,})" for name, (groups, numel)
                           in sorted(last["groups_and_elements"].items()))
        rejected = ", ".join(last.get("rejected", [])) or "–"
        ratio = ratios.get(link)
        lines.append(f"| {link} | {chosen} | {rejected} | {'–' if ratio is None else f'{ratio:.3f}x'} |")
    return "\n".join(lines) + "\n"


TABLES: Dict[str, Callable[[List[dict]], str]] = {"convergence": convergence_table, "time": time_table,
                                                  "study-time": study_time_table, "horovod-time": time_table,
                                                  "study-accuracy": study_accuracy_table,
                                                  "fsdp-convergence": convergence_table, "auto": auto_table}


def render(readme: str, root: str = ROOT) -> str:
    """``readme`` with every generated block rewritten from its source file."""
    def replace(match) -> str:
        name = match.group(2)
        path = os.path.join(root, SOURCES[name])
        if not os.path.exists(path):  # a study not yet run at this commit: say so, never keep old figures
            return match.group(1) + f"_Not measured at this commit: `{SOURCES[name]}` is missing._\n" + match.group(4)
        with open(path) as f:
            rows = json.load(f)
        return match.group(1) + TABLES[name](rows) + match.group(4)

    return _BLOCK.sub(replace, readme)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README differs from the results")
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    args = parser.parse_args(argv)
    with open(args.readme) as f:
        current = f.read()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print("readme_tables: the README's generated tables differ from the results; run "
                  "python -m experiments.readme_tables", file=sys.stderr)
            return 1
        return 0
    with open(args.readme, "w") as f:
        f.write(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
