"""Triton kernels of zcompile and their pure-torch references."""
