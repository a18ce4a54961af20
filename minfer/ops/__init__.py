"""The op seam: the only place the model gets its math from.

`get_backend("ref" | "cuda" | "auto", device)` returns a Backend whose attributes are the ops. The
cuda backend takes each op from our kernels (torch.ops.minfer.*); an op with no kernel yet runs on
ref, and is listed in `Backend.fallbacks` so that the gap is printed, never silent.
"""
from __future__ import annotations

import sys

import torch

from . import reference

# Ops the model uses; each backend provides every one of them. attention works on the static engine's dense
# cache, paged_attention on the continuous engine's pages; rope writes both (ops/reference.py).
DENSE_OPS = ("embedding", "rms_norm", "fused_add_rms_norm", "rope", "silu_and_mul", "attention", "linear",
             "linear_act_and_mul", "records_for", "norms_in_linears", "beside_stream")
PAGED_OPS = ("paged_attention",)
# Ops only some models use (Gemma's GeGLU): a missing kernel joins `fallbacks` once a model needs it.
OPTIONAL_OPS = ("gelu_tanh_and_mul",)
# Ops the engine runs on the model's output: greedy sampling's argmax, the random draw's, structured outputs' mask.
ENGINE_OPS = ("argmax", "gumbel_argmax", "draw_filtered", "apply_token_bitmask")
MODEL_OPS = DENSE_OPS + PAGED_OPS + ENGINE_OPS
# Ops that write the Q4_K linears' x records (records_for) on the cuda backend.
RECORD_WRITERS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul")


class Backend:
    def __init__(self, name: str, impls: dict, fallbacks: list[str], optional_fallbacks: tuple[str, ...] = ()):
        self.name = name
        self.fallbacks = fallbacks  # ops that run on ref although the cuda backend was asked for
        self._optional_fallbacks = optional_fallbacks  # OPTIONAL_OPS on ref, listed once needed
        for op, fn in impls.items():
            setattr(self, op, fn)

    def need(self, op: str) -> None:
        """A model uses this optional op: list it among the fallbacks if it runs on ref."""
        if op in self._optional_fallbacks and op not in self.fallbacks:
            self.fallbacks.append(op)

    def route_to_reference(self, op: str, why: str) -> None:
        """Run `op` on ref from now on, for a model whose shape its kernel does not cover; said once, and
        listed among the fallbacks (so that the static engine does not capture the ref op in a graph)."""
        if self.name == "ref" or op in self.fallbacks:
            return
        print(f"minfer: {op} runs on the reference backend: {why}", file=sys.stderr)
        setattr(self, op, getattr(reference, op))
        self.fallbacks.append(op)
        if op in RECORD_WRITERS:  # the Q4_K linears then convert x themselves
            self.records_for = reference.records_for

    def __repr__(self) -> str:
        return f"Backend({self.name}, fallbacks={self.fallbacks})"


def cuda_available() -> bool:
    """True when a GPU and the built extension are both there."""
    if not torch.cuda.is_available():
        return False
    try:
        from . import cuda  # noqa: F401  (loads minfer._C)
    except ImportError:
        return False
    return True


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> Backend:
    device = torch.device(device) if device is not None else None
    if name == "auto":
        on_gpu = device is None or device.type == "cuda"
        name = "cuda" if on_gpu and cuda_available() else "ref"
        if name == "ref" and on_gpu and torch.cuda.is_available():
            print("minfer: the CUDA extension is not built; using the reference backend", file=sys.stderr)
    if name == "ref":
        return Backend("ref", {op: getattr(reference, op) for op in MODEL_OPS + OPTIONAL_OPS}, [])
    if name != "cuda":
        raise ValueError(f"unknown backend {name!r} (auto, cuda, ref)")
    if not torch.cuda.is_available():
        raise RuntimeError("the cuda backend needs a CUDA GPU")
    from . import cuda
    impls, fallbacks, optional = {}, [], []
    for op in MODEL_OPS + OPTIONAL_OPS:
        fn = getattr(cuda, op, None)
        if fn is None:
            fn = getattr(reference, op)
            (optional if op in OPTIONAL_OPS else fallbacks).append(op)
        impls[op] = fn
    return Backend("cuda", impls, fallbacks, tuple(optional))
