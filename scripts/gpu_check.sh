#!/usr/bin/env bash
# The GPU checks, in one run on a machine with one CUDA GPU and CuPy: the kernels against the
# torch reference and their speed (experiments.gpu_selfcheck), the backend inside 2-rank DDP
# (experiments.gpu_ddp_check), and every op timed on every backend (experiments.bench_kernels).
# Writes selfcheck.txt, ddp_check.txt, bench.txt and bench.json into $1 (default .), and exits
# non-zero when a check fails. Each step is bounded in time.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, cupy; print("torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__)'
} 2>&1 | tee "$out/machine.txt"
timeout 170 python3 -m experiments.gpu_selfcheck 2>&1 | tee "$out/selfcheck.txt" || status=1
timeout 120 python3 -m experiments.gpu_ddp_check 2>&1 | tee "$out/ddp_check.txt" || status=1
timeout 250 python3 -m experiments.bench_kernels --backends cuda torch --devices cuda --repeats 10 \
    --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" || status=1
exit $status
