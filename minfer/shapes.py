"""Reference model shapes with random weights: real-sized models for benchmarks, no download needed.

`config(name)` gives the ModelConfig of a published model; `random_weights(cfg, dtype, device)` fills
every tensor the model reads (HF names) with small random values, made on the device.
"""
from __future__ import annotations

import re

import torch

from .config import FULL, SLIDING, ModelConfig
from .errors import MinferError

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}



def _gemma3(vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, **kw) -> dict:
    """Gemma 3: a FULL layer after every 5 SLIDING ones (window 512 at 270M and 1B, 1024 from 4B on)."""
    return dict(arch="gemma3", vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=256,
                rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_theta=10_000.0, qk_norm=True,
                layer_types=[FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)],
                embed_scale=hidden_size ** 0.5, hidden_act="gelu_tanh", sandwich_norm=True,
                query_pre_attn_scalar=256, tie_word_embeddings=True, **kw)


SHAPES = {
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                         num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                         max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    "qwen3-0.6b": dict(arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True),
    "gemma-3-270m": _gemma3(262144, 640, 2048, 18, 4, 1, sliding_window=512, max_position_embeddings=32768),
    "gemma-3-4b": _gemma3(262208, 2560, 10240, 34, 8, 4, sliding_window=1024, max_position_embeddings=131072,
                          rope_scaling={"rope_type": "linear", "factor": 8.0}),
}


def config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise MinferError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    cfg = ModelConfig(**SHAPES[name])
    cfg.validate()
    return cfg


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the model reads."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_heads * hd),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg.attention_bias:
            for x, rows in (("q", cfg.num_heads * hd), ("k", cfg.num_kv_heads * hd), ("v", cfg.num_kv_heads * hd)):
                shapes[p + f"self_attn.{x}_proj.bias"] = (rows,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if cfg.sandwich_norm:
            shapes[p + "pre_feedforward_layernorm.weight"] = shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    return shapes


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_tensors(cfg: ModelConfig, found: dict[str, tuple[int, ...]], where: str, label=lambda name: name,
                  exact: bool = False) -> None:
    """found (HF name -> shape) holds every tensor cfg's model reads, each in its shape, and no layer past cfg's
    (a config with fewer would drop the rest in silence); exact: nothing else either. label: HF name -> the name
    `where` itself gives the tensor. Else a MinferError naming the tensor."""
    layers = {int(m[1]) for name in found if (m := _LAYER.match(name))}
    if layers and max(layers) >= cfg.num_layers:
        raise MinferError(f"{where}: has tensors of layer {max(layers)}, but the config's layer count is "
                          f"{cfg.num_layers}")
    if len(layers) < cfg.num_layers:  # before weight_shapes lists the names of every layer the config claims
        i = min(set(range(len(layers) + 1)) - layers)
        raise MinferError(f"{where}: has no tensors of layer {i}; the config's layer count is {cfg.num_layers}")
    need = weight_shapes(cfg)
    missing = [name for name in need if name not in found]
    if missing:
        raise MinferError(f"{where}: missing {len(missing)} tensors, e.g. {label(missing[0])}")
    for name, shape in found.items():
        if name not in need:
            if exact:
                raise MinferError(f"{where}: tensor {label(name)} is not one of a {cfg.arch} model with this config")
        elif tuple(shape) != need[name]:
            raise MinferError(f"{where}: tensor {label(name)} has shape {list(shape)}; the config needs "
                              f"{list(need[name])}")


@torch.inference_mode()
def random_weights(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Norm weights near 1, everything else N(0, 0.02^2): activations stay finite through every layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        w = torch.empty(shape, dtype=dtype, device=device)
        if "norm" in name:
            w.normal_(1.0, 0.02, generator=gen)
        else:
            w.normal_(0.0, 0.02, generator=gen)
        weights[name] = w
    return weights
