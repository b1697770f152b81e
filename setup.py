from setuptools import setup

setup(
    name="gradcomp",
    version="0.1.0",
    description="Gradient compression (top-k, 2-bit, error feedback) for PyTorch DDP and Horovod",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["gradcomp", "gradcomp.backends", "gradcomp.compressors", "gradcomp.hooks", "gradcomp.csrc"],
    # hooks/ and csrc/ sit at the top of the repository but install inside gradcomp, so
    # no generic top-level package named "hooks" is ever installed.
    package_dir={"gradcomp.hooks": "hooks", "gradcomp.csrc": "csrc"},
    # CUDA sources ship as data: CuPy compiles them at first use (NVRTC), no build step.
    package_data={"gradcomp.csrc": ["*.cu", "*.cuh"]},
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "numba": ["numba>=0.60"],
        "cuda": ["cupy-cuda12x>=13"],
        "horovod": ["horovod==0.28.1", "cloudpickle", "psutil", "pyyaml", "packaging"],
        "experiments": ["numba>=0.60", "matplotlib", "scikit-learn", "tqdm"],
        # CuPy and NVRTC import and compile without a GPU: the tests then check the cuda
        # backend's registration and that NVRTC accepts the exact kernel sources.
        "test": ["numba>=0.60", "pytest", "hypothesis", "scikit-learn", "matplotlib", "tqdm",
                 "cupy-cuda12x>=13", "nvidia-cuda-nvrtc-cu12"],
    },
)
