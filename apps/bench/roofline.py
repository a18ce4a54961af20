"""The bytes a decode step must read, the floor of its time: every weight once, and each sequence's K and V
(the windowed layers only their window)."""
from __future__ import annotations

from minfer.quant import QuantizedWeight


def weight_bytes(engine) -> int:
    """Bytes of every weight one decode step reads once: the layers, the final norm and the lm_head (a
    quantized weight's blocks, as stored). engine: a static Engine or an EngineCore."""
    model = engine.model
    weights = [w for layer in model.layers for w in layer.values() if w is not None]
    weights += [model.final_norm, model.lm_head]
    flat = [p for w in weights for p in (w if isinstance(w, list) else [w])]  # fuse() may give a list
    return sum(w.nbytes() if isinstance(w, QuantizedWeight) else w.numel() * w.element_size() for w in flat)


def kv_bytes(engine, context: float) -> float:
    """K and V bytes one sequence's decode step reads at `context` positions: every position on the full
    layers, the last `window` on the windowed ones."""
    cfg = engine.cfg
    per_position = 2 * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize  # one layer's K and V
    return sum(per_position * (context if w is None else min(context, w)) for w in engine.model.windows)
