"""Triton kernels for tree verification, each with a readable torch reference beside it."""
