"""Plots of a comparison (``experiments.compare``'s ``summary.json`` and run logs), as PNG files.

Per workload:

* ``<workload>_loss_vs_step.png``: training loss (EMA-smoothed) and held-out loss by step;
* ``<workload>_loss_vs_time.png``: the same training loss against cumulative training
  time (sum of step times), one panel per link;
* ``<workload>_step_time.png``: median step time split into compute / compression /
  communication (stacked bars), one panel per link, with the ratio to the noop floor;
* ``<workload>_bytes.png``: bytes each rank sends per step (log scale), with the bytes
  measured on the shaped loopback where available (noop, which sends nothing, is left out).

``noop`` is left out of the loss plots: it does not average gradients.

Example::

    python -m experiments.plots results/        # re-draw from results/summary.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from experiments.catalog import METHODS, link_key, method_order, read_log  # noqa: E402

PARTS = (
    ("compute_s", "compute", "#c7c7c7"),
    ("compress_s", "compression", "#ff9f40"),
    ("comm_s", "communication", "#4a90d9"),
)


def _ordered(records: List[dict]) -> List[dict]:
    return sorted(records, key=lambda r: method_order(r["method"]))


def _color(method: str) -> str:
    return METHODS[method].color if method in METHODS else "black"


def _style(method: str) -> dict:
    """One colour per method across every figure; the no-EF variants share their
    method's colour, dashed."""
    dashed = method in METHODS and METHODS[method].dashed
    return {"color": _color(method), "linestyle": "--" if dashed else "-"}


def _ema(values: List[float], decay: float) -> List[float]:
    out, state = [], None
    for value in values:
        state = value if state is None else decay * state + (1 - decay) * value
        out.append(state)
    return out


def _loss_series(record: dict, out_dir: str):
    records = read_log(os.path.join(out_dir, record["log"]))
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    return steps, evals


def _decay_for(n: int) -> float:
    # ~5% of the run, at least no smoothing for very short runs.
    return 0.0 if n < 20 else min(0.95, 1 - 1 / max(2.0, n / 20))


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_vs_step(workload: str, records: List[dict], out_dir: str) -> Optional[str]:
    """One link (the one with the most methods): loss by step does not depend on the link."""
    by_link: Dict[str, List[dict]] = {}
    for r in records:
        if r["method"] != "noop":
            by_link.setdefault(link_key(r), []).append(r)
    if not by_link:
        return None
    link = max(by_link, key=lambda k: len(by_link[k]))
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in _ordered(by_link[link]):
        steps, evals = _loss_series(r, out_dir)
        if steps:
            losses = [s["loss"] for s in steps]
            train_ax.plot(
                [s["step"] + 1 for s in steps],
                _ema(losses, _decay_for(len(losses))),
                label=r["method"],
                lw=1.5,
                **_style(r["method"]),
            )
        if evals:
            eval_ax.plot(
                [e["step"] + 1 for e in evals],
                [e["eval_loss"] for e in evals],
                marker="o",
                ms=4,
                label=r["method"],
                **_style(r["method"]),
            )
    train_ax.set(
        xlabel="steps completed",
        ylabel="training loss (rank 0, EMA-smoothed)",
        title=f"{workload}: training loss ({link})",
    )
    eval_ax.set(xlabel="steps completed", ylabel="held-out loss", title=f"{workload}: held-out loss ({link})")
    for ax in (train_ax, eval_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, os.path.join(out_dir, f"{workload}_loss_vs_step.png"))


def plot_loss_vs_time(workload: str, records: List[dict], out_dir: str) -> Optional[str]:
    links = list(dict.fromkeys(link_key(r) for r in records))
    if not links:
        return None
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links):
        for r in _ordered([r for r in records if link_key(r) == link and r["method"] != "noop"]):
            steps, _ = _loss_series(r, out_dir)
            if steps:
                losses = [s["loss"] for s in steps]
                ax.plot(
                    [s["train_time_s"] for s in steps],
                    _ema(losses, _decay_for(len(losses))),
                    label=r["method"],
                    lw=1.5,
                    **_style(r["method"]),
                )
        ax.set(
            xlabel="training time (s, sum of step times)",
            ylabel="training loss (EMA-smoothed)",
            title=f"{workload}: loss vs time, link {link}",
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, os.path.join(out_dir, f"{workload}_loss_vs_time.png"))


def plot_step_time(workload: str, records: List[dict], out_dir: str) -> Optional[str]:
    records = [r for r in records if r.get("step_time_s")]
    links = list(dict.fromkeys(link_key(r) for r in records))
    if not links:
        return None
    fig, axes = plt.subplots(
        1, len(links), figsize=(max(6, 1.1 * len(records) / len(links) + 2) * len(links), 4.5), squeeze=False
    )
    for ax, link in zip(axes[0], links):
        group = _ordered([r for r in records if link_key(r) == link])
        names = [r["method"] for r in group]
        bottoms = [0.0] * len(group)
        for key, label, color in PARTS:
            heights = []
            for r in group:
                if r.get("compute_s") is None:  # no floor: show the whole step as one bar
                    heights.append(r["step_time_s"] if key == "comm_s" else 0.0)
                else:
                    heights.append(r.get(key) or 0.0)
            ax.bar(names, heights, bottom=bottoms, color=color, label=label, edgecolor="white", linewidth=0.5)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        for x, r in enumerate(group):
            ax.plot([x - 0.4, x + 0.4], [r["step_time_s"]] * 2, color="black", lw=1)
            ratio = r.get("step_time_over_floor")
            ax.annotate(
                f"{r['step_time_s']:.3g}s" + (f"\n{ratio:.2f}×" if ratio else ""),
                (x, max(r["step_time_s"], bottoms[x])), ha="center", va="bottom", fontsize=8,
            )  # fmt: skip
        ax.set(ylabel="median step time (s)", title=f"{workload}: step time, link {link}")
        ax.set_ylim(top=ax.get_ylim()[1] * 1.15)
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        handles.append(Line2D([], [], color="black", lw=1))
        labels.append("measured step time")
        ax.legend(handles, labels, fontsize=8, loc="upper left")
    return _save(fig, os.path.join(out_dir, f"{workload}_step_time.png"))


def plot_bytes(workload: str, records: List[dict], out_dir: str) -> Optional[str]:
    """Bytes per step do not depend on the link: one bar per method; the loopback
    measurement (shaped links) is drawn as a marker beside it."""
    by_method: Dict[str, dict] = {}
    for r in _ordered(records):
        if r.get("bytes_per_step") is None or r["method"] == "noop":  # noop sends nothing
            continue
        best = by_method.get(r["method"])
        if best is None or (r.get("wire_bytes_per_step") is not None and best.get("wire_bytes_per_step") is None):
            by_method[r["method"]] = r
    if not by_method:
        return None
    group = _ordered(list(by_method.values()))
    names = [r["method"] for r in group]
    sent = [max(r["bytes_per_step"], 1.0) for r in group]
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(group) + 2), 4.5))
    ax.bar(names, sent, color=[_color(n) for n in names])
    wire = [(i, r["wire_bytes_per_step"]) for i, r in enumerate(group) if r.get("wire_bytes_per_step")]
    if wire:
        ax.scatter(
            [i for i, _ in wire],
            [w for _, w in wire],
            marker="_",
            s=600,
            color="black",
            zorder=3,
            label="measured on the shaped loopback (per rank)",
        )
    dense = next((r["dense_bytes_per_step"] for r in group if r.get("dense_bytes_per_step")), None)
    if dense:
        ax.axhline(dense, color="#1f77b4", ls=":", lw=1, label=f"dense fp32: {dense / 1e6:.2f} MB")
    for x, r in enumerate(group):
        ratio = r.get("compression_ratio")
        ax.annotate(
            f"{r['bytes_per_step'] / 1e6:.3g} MB" + (f"\n{ratio:.0f}×" if ratio and ratio > 1.05 else ""),
            (x, sent[x]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set_ylim(min(sent) / 5, max(sent + [dense or 0]) * 8)
    ax.set(ylabel="bytes per step per rank (log scale)", title=f"{workload}: bytes on the wire per step")
    ax.tick_params(axis="x", labelrotation=30)
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    return _save(fig, os.path.join(out_dir, f"{workload}_bytes.png"))


def make_plots(records: List[dict], out_dir: str) -> List[str]:
    """Every plot for every workload in ``records``; returns the PNG paths written."""
    paths = []
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    for workload in workloads:
        group = [r for r in records if r["workload"] == workload]
        for plot in (plot_loss_vs_step, plot_loss_vs_time, plot_step_time, plot_bytes):
            path = plot(workload, group, out_dir)
            if path:
                paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.plots",description="Draw the comparison plots from DIR/summary.json.")
    parser.add_argument(
        "out", nargs="?", default="results", help="the directory the comparison wrote (default results/)"
    )
    args = parser.parse_args(argv)
    with open(os.path.join(args.out, "summary.json")) as f:
        records = json.load(f)
    for path in make_plots(records, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
