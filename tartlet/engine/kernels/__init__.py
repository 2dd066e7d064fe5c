"""Tartlet's C kernels (sources, headers), their ctypes wrappers and the compiler driver."""
