"""The package layout; everything else (name, version, dependencies, extras) is in pyproject.toml.

hooks/ and csrc/ sit at the top of the repository but install inside gradcomp, so no
generic top-level package named "hooks" is ever installed. That mapping is why the
package list is computed here: subpackages are found, never listed by hand, so a new one
(gradcomp/backends/numba, hooks/horovod, ...) cannot be left out of a wheel.
"""
from setuptools import find_packages, setup

PACKAGE_DIRS = {"gradcomp": "gradcomp", "gradcomp.hooks": "hooks", "gradcomp.csrc": "csrc"}


def packages():
    found = []
    for package, directory in PACKAGE_DIRS.items():
        found.append(package)
        found.extend(f"{package}.{sub}" for sub in find_packages(directory))
    return found


setup(
    packages=packages(),
    package_dir={package: directory for package, directory in PACKAGE_DIRS.items() if package != directory},
    # CUDA sources ship as data: CuPy compiles them at first use (NVRTC), no build step.
    package_data={"gradcomp.csrc": ["*.cu", "*.cuh"]},
)
