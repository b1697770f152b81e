#!/usr/bin/env bash
# Build Horovod 0.28.1 with Gloo against the installed torch, and install it.
#
# Why this exists: Horovod ships only as an sdist, and 0.28.1 does not build as is
# against torch 2.x with a current cmake. Three changes are needed, all measured:
#   * torch 2.x headers need C++17; Horovod's CMakeLists ask for C++14;
#   * cmake 4 rejects the cmake_minimum_required of the bundled Gloo, hence
#     CMAKE_POLICY_VERSION_MINIMUM=3.5;
#   * the build must see the installed torch, hence --no-build-isolation.
# The build takes about 15 minutes on 2 cores, so the wheel is cached outside the
# repository (GRADCOMP_CACHE, default ~/.cache/gradcomp) and reused by later runs.
set -euo pipefail

version=0.28.1
python=${PYTHON:-python3}
cache=${GRADCOMP_CACHE:-$HOME/.cache/gradcomp}
torch_version=$("$python" -c 'import torch; print(torch.__version__)')
py_tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# The wheel links against torch's C++ ABI, so the cache is keyed by torch version.
wheel_dir="$cache/horovod-$version-torch-$torch_version-$py_tag"

if "$python" -c 'import horovod.torch' 2>/dev/null; then
    echo "build_horovod: horovod.torch already importable; nothing to do."
    exit 0
fi

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "build_horovod: building Horovod $version with Gloo against torch $torch_version."
    echo "build_horovod: this compiles Horovod and Gloo from source and takes ~15 minutes on 2 cores;"
    echo "build_horovod: the wheel is cached in $wheel_dir so this happens once per machine."
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$python" -m pip install -q cloudpickle psutil pyyaml packaging 'cmake<4' wheel setuptools
    "$python" -m pip download -q --no-deps --no-binary :all: "horovod==$version" -d "$work"
    tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
    src="$work/horovod-$version"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
        || { echo "build_horovod: could not switch horovod/torch to C++17" >&2; exit 1; }
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo
    export MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(nproc)}"
    "$python" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$src"
    mkdir -p "$wheel_dir"
    cp "$work"/dist/horovod-*.whl "$wheel_dir"/
fi

echo "build_horovod: installing cached wheel from $wheel_dir"
"$python" -m pip install -q --no-deps "$wheel_dir"/horovod-*.whl
"$python" -m pip install -q cloudpickle psutil pyyaml packaging
"$python" -c 'import horovod.torch as hvd; print("build_horovod: horovod", __import__("horovod").__version__, "gloo built:", hvd.gloo_built())'
