"""Pallas GPU kernels, one file per op with its TuningConfig. The model calls them only through
ling_jax.kernel_calls.KernelCalls, the one object that chooses a kernel for the shapes it sees."""
