#!/usr/bin/env bash
# Time to dense's quality for every workload and optimizer of the convergence study
# (README, "Sooner?"): each cell's step times on four links, one launch of the ranks per cell
# (experiments.step_times), then the study's evaluations x those times
# (experiments.time_to_accuracy). Run it alone on the machine:
#   ../shared/tools/quiet scripts/study_time_to_accuracy.sh [OUT]
# OUT defaults to experiments/results/time_to_accuracy; the study's convergence.json is read from
# experiments/results/convergence. About 25 minutes on 2 idle cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-experiments/results/time_to_accuracy}
python=${PYTHON:-python3}
mkdir -p "$out/step_times"
for workload in charlm-small gpt proselm digits-mlp shapes; do
    for optimizer in adamw sgdm; do
        echo "study_time_to_accuracy: $workload $optimizer (load $(cut -d' ' -f1 /proc/loadavg))"
        methods=noop,dense,topk,twobit
        # the dense start goes out in fp16 under Adam only (gradcomp.recipe.plan's cast_start)
        [ "$optimizer" = adamw ] && methods=$methods,start
        "$python" -m experiments.step_times --workload "$workload" --optimizer "$optimizer" \
            --methods $methods --links 10mbit,100mbit,1gbit,unshaped --rounds 4 --steps 6 --round-seconds 2 \
            --out "$out/step_times"
    done
done
"$python" -m experiments.time_to_accuracy --convergence experiments/results/convergence \
    --step-times "$out/step_times" --out "$out"
