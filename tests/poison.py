"""NaN-poisoned outputs for the GPU tests: an op's output comes from torch's caching allocator, which hands out the
block freed last of that size, so a NaN-filled block freed right before the call makes any element the kernel leaves
unwritten show as NaN."""
import torch


def nan_freed(shape, dtype):
    """Frees a NaN-filled block of `shape` on the GPU, for the next allocation of that size to reuse."""
    torch.full(tuple(shape), float("nan"), device="cuda", dtype=dtype)
