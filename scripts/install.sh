#!/usr/bin/env bash
# Install gradcomp and what one job needs, into the current Python.
#   scripts/install.sh experiments   # the comparison experiment (the main job)
#   scripts/install.sh test          # the test suite and its linter (ruff), Horovod (built from source) included
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-test}
python=${PYTHON:-python3}

# Pinned: 2.13.0 is the CPU build these machines carry on local disk; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine, install your CUDA torch first.
if ! "$python" -c 'import torch' 2>/dev/null; then
    "$python" -m pip install -q torch==2.13.0
fi

case "$job" in
    experiments) "$python" -m pip install -q -e ".[experiments]" ;;
    test)
        "$python" -m pip install -q -e ".[test,lint]"
        PYTHON="$python" scripts/build_horovod.sh
        ;;
    *) echo "usage: $0 {experiments|test}" >&2; exit 2 ;;
esac
