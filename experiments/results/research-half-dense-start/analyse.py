"""The screen's rows beside the study's: ``python experiments/results/research-half-dense-start/analyse.py OUT...``
(each ``OUT`` a ``python -m experiments.convergence --out OUT ... --optimizers adamw --methods topk`` of the patched
code, ``screen.diff``). Prints each run's held-out loss against dense's and the study's own top-k run of the same
seed, then each cell's time to dense's quality with the study's time model and step times
(``experiments.time_to_accuracy``, ``../time_to_accuracy/step_times/``), and writes ``rows.json`` here."""
import glob
import json
import os
import sys

from experiments import time_to_accuracy

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(HERE)


def main(outs):
    study = json.load(open(os.path.join(RESULTS, "convergence", "convergence.json")))
    pattern = os.path.join(RESULTS, "time_to_accuracy", "step_times", "step_times_*.json")
    times = [row for path in sorted(glob.glob(pattern)) for row in json.load(open(path))]
    screen = [row for out in outs for row in json.load(open(os.path.join(out, "convergence.json")))]
    ran = {(r["workload"], r["seed"]) for r in screen}
    adamw = [r for r in study if r["optimizer"] == "adamw" and (r["workload"], r["seed"]) in ran]
    dense = {(r["workload"], r["seed"]): r for r in adamw if r["method"] == "dense"}
    own = {(r["workload"], r["seed"]): r for r in adamw if r["method"] == "topk"}
    runs = []
    for r in sorted(screen, key=lambda r: (r["workload"], r["seed"])):
        key = (r["workload"], r["seed"])
        row = {"workload": key[0], "seed": key[1], "final_loss": r["final_loss"], "accuracy": r.get("final_accuracy"),
               "compression": r["compression"], "study_final_loss": own[key]["final_loss"],
               "study_accuracy": own[key].get("final_accuracy"), "study_compression": own[key]["compression"],
               "dense_final_loss": dense[key]["final_loss"]}
        runs.append(row)
        half, full = (100 * (row[k] / row["dense_final_loss"] - 1) for k in ("final_loss", "study_final_loss"))
        print(f"{key[0]:13s} seed {key[1]}  half start {half:+.1f} % ({r['compression']:.1f}x)  dense start "
              f"{full:+.1f} % ({row['study_compression']:.1f}x)  accuracy {row['accuracy']} / {row['study_accuracy']}")
    cells = []
    denses = list(dense.values())
    for name, rows in (("half", screen), ("dense", list(own.values()))):
        for r in time_to_accuracy.rows_for(denses + rows, times):
            if r["method"] == "topk":
                kept = ("workload", "link", "steps_to_target", "time_ratio_vs_dense", "time_ratio_by_seed")
                cells.append({"start": name, **{k: r[k] for k in kept}})
    by = {(c["start"], c["workload"], c["link"]): c for c in cells}
    for workload in sorted({c["workload"] for c in cells}):
        for link in ("10mbit", "100mbit", "1gbit", "unshaped"):
            half, full = by[("half", workload, link)], by[("dense", workload, link)]
            seeds = [[round(x, 3) if x else None for x in c["time_ratio_by_seed"]] for c in (half, full)]
            print(f"{workload:13s} {link:9s} half start {half['time_ratio_vs_dense']:.3f} {seeds[0]}  dense start "
                  f"{full['time_ratio_vs_dense']:.3f} {seeds[1]}")
    with open(os.path.join(HERE, "rows.json"), "w") as handle:
        json.dump({"runs": runs, "time_to_accuracy": cells}, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
