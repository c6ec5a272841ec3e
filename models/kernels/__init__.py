"""Compiled CPU kernels: C sources built once with the system compiler (``build.py``) and called via ctypes."""
