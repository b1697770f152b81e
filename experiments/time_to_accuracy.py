"""Time to dense's quality on each link: the convergence study's steps x the quiet step times.

For each workload x optimizer x method of the convergence study (``convergence.json``) and each
link of the step-time benchmark (``step_times_*.json``, :mod:`experiments.step_times`):

* the **target** is dense's final held-out loss x 1.02 (the same for every method of the cell; with
  several seeds, each seed's run against dense's run of that seed, and each row gives the upper median
  over the seeds, "never" counted as the longest: ``seeds``, ``time_ratio_by_seed``);
* ``steps_to_target``: the first evaluation at which the method's held-out loss reaches it (evals
  every 2% of the run; ``null``: never);
* ``time_ratio_vs_dense``: the method's time to the target over dense's time to its own final loss
  (its first evaluation at that loss x dense's step time on the link). The method's time counts
  each step by the bytes it sent: the dense start and the ramp cost more than the final setting
  the benchmark times (:func:`run_time`; ``time_model`` says which model a row used; the recipes'
  fp16 dense start at the benchmark's ``start`` step where it was timed). Its step
  at the final setting is dense's times the benchmark's paired ratio to dense
  (:func:`paired_step_time`; ``step_ratio_vs_dense``, ``ratio_spread``).

For the classifiers (rows whose runs record ``eval_accuracy``) the same time by accuracy, beside the loss's:
the target is dense's final accuracy less :data:`ACCURACY_TOLERANCE` (the study's goal for them), dense's time
the time to its own final accuracy (``accuracy_target``, ``steps_to_accuracy``, ``accuracy_time_ratio_vs_dense``,
``accuracy_time_ratio_by_seed``; ``None`` elsewhere). A held-out loss near 0.01 moves by tens of percent with a few
confident errors, and dense's own last evaluations range wider than the loss target's 2 %.

Runs of one code and seed part between machines (vector units round differently), so each row says
whether its seeds' runs and dense's were made on one machine (``same_machine_as_dense``: ``True``,
``False`` where any seed's pair names two, ``None`` where a run recorded none); the table marks ``False``.

Output in ``--out``: ``time_to_accuracy.json``, one row per workload x optimizer x method x link
with ``workload, optimizer, method, link, steps_to_target, step_time, spread, load_before,
step_ratio_vs_dense, ratio_spread, time_ratio_vs_dense, same_machine_as_dense`` and, on dense's rows,
``dense_step_over_compute`` and ``dense_step_over_loopback`` (dense's step on the link over its step on the
unshaped loopback, where the same Gloo collectives wait for no link: what a compressor can remove is
at most the difference); ``time_to_accuracy.md``; and per workload x optimizer a plot of
held-out loss against time, one panel per link, one line per method. The step times of a
workload come from its own benchmark file when there is one.

Example::

    python -m experiments.time_to_accuracy --convergence experiments/results/convergence \\
        --step-times experiments/results/step_times --out experiments/results/time_to_accuracy
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
from typing import Dict, List, Optional

from experiments.study_report import OTHER_MACHINE, same_machine

__all__ = ["rows_for", "run_time", "read_step_times", "main"]

TARGET_FACTOR = 1.02
#: The classifiers' accuracy target: dense's final accuracy less this (the convergence goal's 0.5 points).
ACCURACY_TOLERANCE = 0.005
#: The methods whose dense start is sent as an fp16 cast (the recipes without a policy).
CAST_START = ("topk", "twobit")


def _reached(evals: List[list], target: float) -> Optional[int]:
    """The index of the first evaluation whose held-out loss reaches ``target`` (``evals``: [step,
    time, loss]), or None."""
    for index, (step, _, loss) in enumerate(evals):
        if step >= 0 and loss <= target:
            return index
    return None


def _reached_accuracy(run: dict, target: float) -> Optional[int]:
    """The index of the first evaluation whose accuracy (``run["eval_accuracy"]``, one per entry of ``evals``)
    reaches ``target``, or None."""
    for index, ((step, _, _), accuracy) in enumerate(zip(run["evals"], run["eval_accuracy"])):
        if step >= 0 and accuracy >= target:
            return index
    return None


def run_time(run: dict, index: int, step_time: float, dense_step_time: float,
             start_step_time: Optional[float] = None) -> tuple:
    """Seconds a run takes to its ``index``-th evaluation on a link, and the model used.

    The benchmark times each method at its final setting (``step_time``, sending ``b_c`` =
    ``run["final_bytes_share"]`` of dense's bytes), dense at ``dense_step_time``, and the recipes'
    dense start in fp16 at ``start_step_time`` (its ``start`` method). The dense start's cast steps
    (``run["start_to_eval"]``) cost ``start_step_time`` each where it is given; any other step that sent
    a share ``b`` of dense's bytes (the ramp; without a timed start, the casts too) costs the straight
    line between the final setting and dense: ``t_c + (t_d - t_c) (b - b_c) / (1 - b_c)``; summed over
    the steps, only their cumulative bytes are needed. Runs recorded without bytes by evaluation: every
    step at ``t_c``.
    """
    steps = run["evals"][index][0] + 1
    share = run.get("final_bytes_share")
    if run.get("bytes_to_eval") is None or share is None:
        return steps * step_time, "final setting"
    if share >= 1.0:
        return steps * dense_step_time, "per-step bytes"
    sent, dense = run["bytes_to_eval"][index]
    casts, model, seconds = 0, "per-step bytes", 0.0
    if start_step_time is not None and run.get("start_to_eval"):
        casts, cast_sent, cast_dense = run["start_to_eval"][index]
        sent, dense, seconds = sent - cast_sent, dense - cast_dense, casts * start_step_time
        model = "per-step bytes, timed casts" if casts else model
    rest = steps - casts
    shares = rest * sent / dense if dense else rest * share  # sum of the other steps' shares
    extra = max(0.0, shares - rest * share) / (1.0 - share)
    return seconds + rest * step_time + (dense_step_time - step_time) * extra, model


def _seed_result(run: dict, dense: dict, step_time: float, dense_step_time: float,
                 start_step_time: Optional[float] = None, accuracy: bool = False) -> tuple:
    """``(steps to the target, time ratio to dense, time model)`` of one seed's run against the dense run
    of the same seed on one link (``accuracy``: the accuracy target); ``None`` for the first two where it never
    reaches the target."""
    if accuracy:
        reached = _reached_accuracy(run, dense["final_accuracy"] - ACCURACY_TOLERANCE)
        own = _reached_accuracy(dense, dense["final_accuracy"])
    else:
        reached = _reached(run["evals"], dense["final_loss"] * TARGET_FACTOR)
        own = _reached(dense["evals"], dense["final_loss"])
    dense_steps = None if own is None else dense["evals"][own][0] + 1
    if reached is None or not dense_steps:
        return None, None, None
    seconds, model = run_time(run, reached, step_time, dense_step_time, start_step_time)
    return run["evals"][reached][0] + 1, seconds / (dense_steps * dense_step_time), model


def _median_high(values: list) -> Optional[float]:
    """The upper median, ``None`` (never) counted as the largest value: a cell reaches the target only if
    most of its seeds do."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    return ordered[len(ordered) // 2]


def rows_for(convergence: List[dict], step_times: List[dict]) -> List[dict]:
    """The rows of the module docstring: per cell, the upper median over the seeds that have a dense run of
    the same seed (target: that dense run's final loss x :data:`TARGET_FACTOR`)."""
    times = {(r["workload"], r["optimizer"], r["method"], r["link"]): r for r in step_times}
    links = sorted({r["link"] for r in step_times})
    runs = {(r["workload"], r["optimizer"], r["method"], r["seed"]): r for r in convergence}
    cells = sorted({key[:3] for key in runs})
    rows = []
    for workload, optimizer, method in cells:
        seeds = sorted(s for (w, o, m, s) in runs if (w, o, m) == (workload, optimizer, method)
                       and (workload, optimizer, "dense", s) in runs)
        if not seeds:
            continue
        members = [runs[(workload, optimizer, method, s)] for s in seeds]
        denses = [runs[(workload, optimizer, "dense", s)] for s in seeds]
        for link in links:
            timed = _timing(times, workload, optimizer, method, link)
            dense_timed = _timing(times, workload, optimizer, "dense", link)
            if timed is None or dense_timed is None:
                continue
            step_time = paired_step_time(timed, dense_timed)
            start_timed = _timing(times, workload, optimizer, "start", link) if method in CAST_START else None
            start_time = paired_step_time(start_timed, dense_timed) if start_timed is not None else None
            results = [_seed_result(run, dense, step_time, dense_timed["step_time"], start_time)
                       for run, dense in zip(members, denses)]
            ratio = _median_high([r[1] for r in results])
            row = {"workload": workload, "optimizer": optimizer, "method": method, "link": link,
                   "target_loss": denses[0]["final_loss"] * TARGET_FACTOR,
                   "steps_to_target": _median_high([r[0] for r in results]), "step_time": timed["step_time"],
                   "spread": timed["spread"], "load_before": timed.get("load_before"),
                   "step_ratio_vs_dense": step_time / dense_timed["step_time"],
                   "ratio_spread": timed.get("ratio_spread", 0.0 if method == "dense" else None),
                   "step_times_of": timed["workload"], "time_ratio_vs_dense": ratio,
                   "time_model": next((r[2] for r in results if r[2] is not None), None), "seeds": seeds,
                   "time_ratio_by_seed": [r[1] for r in results], "integration": timed.get("integration", "ddp")}
            row.update(_accuracy_fields(members, denses, step_time, dense_timed["step_time"], start_time))
            row["same_machine_as_dense"] = _same_machine(members, denses)
            if method == "dense":
                loopback = _timing(times, workload, optimizer, "dense", "unshaped")
                row["dense_step_over_compute"] = timed.get("dense_step_over_compute")
                row["dense_step_over_loopback"] = (timed["step_time"] / loopback["step_time"]
                                                   if loopback is not None else None)
            rows.append(row)
    return rows


def _accuracy_fields(runs: List[dict], denses: List[dict], step_time: float, dense_step_time: float,
                     start_step_time: Optional[float]) -> dict:
    """The accuracy criterion's fields of a row (module docstring) from each seed's run and dense's run of that
    seed; ``None`` where a run records no accuracy by evaluation."""
    if not all(r.get("eval_accuracy") for r in runs + denses) or any(d.get("final_accuracy") is None for d in denses):
        return {"accuracy_target": None, "steps_to_accuracy": None, "accuracy_time_ratio_vs_dense": None,
                "accuracy_time_ratio_by_seed": None}
    results = [_seed_result(r, d, step_time, dense_step_time, start_step_time, accuracy=True)
               for r, d in zip(runs, denses)]
    return {"accuracy_target": denses[0]["final_accuracy"] - ACCURACY_TOLERANCE,
            "steps_to_accuracy": _median_high([r[0] for r in results]),
            "accuracy_time_ratio_vs_dense": _median_high([r[1] for r in results]),
            "accuracy_time_ratio_by_seed": [r[1] for r in results]}


def _same_machine(runs: List[dict], dense_runs: List[dict]) -> Optional[bool]:
    """Whether every run and the dense run of its seed name one machine (``False``: some pair names two;
    ``None``: some run recorded none)."""
    pairs = [same_machine(run, dense) for run, dense in zip(runs, dense_runs)]
    if False in pairs:
        return False
    return None if None in pairs else True


def paired_step_time(timed: dict, dense_timed: dict) -> float:
    """A method's step time for its time to the target: dense's median times the method's paired
    ratio to dense (step by step, in turn; :mod:`experiments.step_times`) where the benchmark has it,
    which the machine's drift between rounds leaves out; else the method's own median."""
    if "ratio_vs_dense" in timed:
        return dense_timed["step_time"] * timed["ratio_vs_dense"]
    return timed["step_time"]


def _timing(times: Dict[tuple, dict], workload: str, optimizer: str, method: str, link: str) -> Optional[dict]:
    """The benchmark row of this workload, else of the same workload under the other optimizer."""
    for opt in (optimizer, "adamw", "sgdm"):
        found = times.get((workload, opt, method, link))
        if found is not None:
            return found
    return None


def markdown(rows: List[dict]) -> str:
    lines = ["| workload | optimizer | link | method | steps to target | step (ms) | spread | step vs dense, paired "
             "(spread) | time vs dense | time vs dense, accuracy | dense step / compute | dense step / loopback's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "never" if r["time_ratio_vs_dense"] is None else f"{r['time_ratio_vs_dense']:.2f}x"
        ratio += OTHER_MACHINE if r.get("same_machine_as_dense") is False else ""
        by_accuracy = "" if r.get("accuracy_target") is None else (
            "never" if r["accuracy_time_ratio_vs_dense"] is None else f"{r['accuracy_time_ratio_vs_dense']:.2f}x")
        over, paired = r.get("dense_step_over_compute"), r.get("step_ratio_vs_dense")
        loopback = r.get("dense_step_over_loopback")
        paired_text = "" if paired is None or r.get("ratio_spread") is None else (
            f"{paired:.3f}x ({r['ratio_spread']:.1%})")
        lines.append(f"| {r['workload']} | {r['optimizer']} | {r['link']} | {r['method']} | "
                     f"{r['steps_to_target'] if r['steps_to_target'] is not None else 'never'} | "
                     f"{r['step_time'] * 1000:.1f} | {r['spread']:.1%} | {paired_text} | {ratio} | {by_accuracy} | "
                     f"{'' if over is None else f'{over:.2f}'} | {'' if loopback is None else f'{loopback:.2f}'} |")
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], convergence: List[dict], out: str) -> List[str]:
    """Held-out loss against time per link (panels), one line per method, per workload x optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    cells = sorted({(r["workload"], r["optimizer"]) for r in rows})
    for workload, optimizer in cells:
        members = [r for r in rows if (r["workload"], r["optimizer"]) == (workload, optimizer)]
        links = sorted({r["link"] for r in members})
        fig, axes = plt.subplots(1, len(links), figsize=(4 * len(links), 3.6), squeeze=False)
        for ax, link in zip(axes[0], links):
            on_link = [r for r in members if r["link"] == link]
            dense_time = next(r["step_time"] for r in on_link if r["method"] == "dense")
            for row in on_link:
                run = min((c for c in convergence if (c["workload"], c["optimizer"], c["method"]) ==
                           (workload, optimizer, row["method"])), key=lambda c: c["seed"])
                step_time = dense_time * row["step_ratio_vs_dense"]
                seconds = [run_time(run, i, step_time, dense_time)[0] for i in range(len(run["evals"]))]
                ax.plot(seconds, [e[2] for e in run["evals"]], label=row["method"])
            ax.axhline(members[0]["target_loss"], color="grey", linewidth=0.8, linestyle=":")
            ax.set_title(link)
            ax.set_xlabel("seconds")
            ax.set_yscale("log")
        axes[0][0].set_ylabel("held-out loss")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"{workload}, {optimizer}")
        fig.tight_layout()
        path = os.path.join(out, f"{workload}_{optimizer}_loss_vs_time.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def read_step_times(directories: List[str]) -> List[dict]:
    """The rows of every ``step_times_*.json`` in ``directories``; a later directory's row is kept only where
    the earlier ones have no row of its workload, optimizer, method and link."""
    rows, seen = [], set()
    for directory in directories:
        found = []
        for path in sorted(glob.glob(os.path.join(directory, "step_times_*.json"))):
            with open(path) as f:
                found.extend(json.load(f))
        kept = [r for r in found if (r["workload"], r["optimizer"], r["method"], r["link"]) not in seen]
        seen.update((r["workload"], r["optimizer"], r["method"], r["link"]) for r in kept)
        rows.extend(kept)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--convergence", required=True, help="the convergence study's directory")
    parser.add_argument("--step-times", required=True, nargs="+", help="directories of step_times_*.json: a "
                        "later one adds the methods the earlier ones lack on a link (each timed in its own launch, "
                        "paired with that launch's dense)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(os.path.join(args.convergence, "convergence.json")) as f:
        convergence = json.load(f)
    rows = rows_for(convergence, read_step_times(args.step_times))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "time_to_accuracy.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "time_to_accuracy.md"), "w") as f:
        f.write("# Time to dense's quality\n\n" + markdown(rows))
    plot(rows, convergence, args.out)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
