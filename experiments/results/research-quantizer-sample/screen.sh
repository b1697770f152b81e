#!/usr/bin/env bash
# The study's AdamW 2-bit cells under each sample of probe/sitecustomize.py (GC_SAMPLE), dense once per cell:
#   ../shared/tools/heavy experiments/results/research-quantizer-sample/screen.sh OUT
# writes OUT/TAG-MODE/convergence.json (TAG: the cell), then summary.py OUT > summary.md.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=$1
probe=$PWD/experiments/results/research-quantizer-sample/probe
cell() {  # TAG WORKLOAD SEEDS STEPS MODES...
    local tag=$1 workload=$2 seeds=$3 steps=$4; shift 4
    local length=(); [ "$steps" = study ] || length=(--steps "$steps")
    [ -e "$out/$tag-dense/convergence.json" ] || python -m experiments.convergence --workloads "$workload" \
        --optimizers adamw --methods dense --seeds "$seeds" "${length[@]}" --jobs 1 --out "$out/$tag-dense"
    for mode in "$@"; do
        PYTHONPATH=$probe GC_SAMPLE=$mode python -m experiments.convergence --workloads "$workload" \
            --optimizers adamw --methods twobit --seeds "$seeds" "${length[@]}" --jobs 1 --out "$out/$tag-$mode"
    done
}
cell digits-mlp digits-mlp 0,1,2,3,4,5,6,7,8,9 study moment grad coded
cell main200 charlm-small 0 200 moment grad coded
cell shapes shapes 0,1,2 study moment grad coded
cell proselm proselm 0 study moment grad coded
cell gpt gpt 0 study moment grad coded
cell charlm-small charlm-small 0 study moment coded
