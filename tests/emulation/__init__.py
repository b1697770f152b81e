"""A CPU emulation of the CUDA execution model that runs the kernels of ``csrc/`` in tests."""
