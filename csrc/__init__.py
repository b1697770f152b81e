"""CUDA C++ kernel sources, shipped as package data and compiled at first use by CuPy."""
