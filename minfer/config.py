"""Model configuration: one dataclass for every supported Llama-family architecture."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import MinferError

# HF `architectures` entry -> our family name. Families differ only in the switches below.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# config.json's `model_type`, for configs without `architectures`.
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# Sizes that must be positive integers (checked before any is divided by).
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class ModelConfig:
    arch: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        if not isinstance(hf, dict):
            raise MinferError(f"config.json holds a JSON {type(hf).__name__}, not an object")
        archs = hf.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None and not archs:  # older configs name only the model_type
            arch = MODEL_TYPES.get(hf.get("model_type"))
        if arch is None:
            raise MinferError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        for key in _SIZES + ("num_key_value_heads", "head_dim"):
            v = hf.get(key)
            if v is None and key in _SIZES:
                raise MinferError(f"config.json is missing {key!r}")
            if v is not None and not (type(v) is int and v > 0):
                raise MinferError(f"config.json: {key} is {v!r}; it must be a positive integer")
        try:
            num_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            eos = hf.get("eos_token_id")
            rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
            rope_theta = hf.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
            if rope_scaling is not None:
                rope_scaling = dict(rope_scaling)
                rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
                if rope_scaling["rope_type"] == "default":
                    rope_scaling = None
            cfg = cls(
                arch=arch,
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hidden // num_heads,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                partial_rotary_factor=hf.get("partial_rotary_factor", 1.0),
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
                qk_norm=arch == "qwen3",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
            )
        except KeyError as e:
            raise MinferError(f"config.json is missing {e.args[0]!r}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "max_position_embeddings"):
            v = getattr(self, key)
            if not (type(v) is int and v > 0):
                raise MinferError(f"model config: {key} is {v!r}; it must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise MinferError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        kind = (self.rope_scaling or {}).get("rope_type")
        if kind not in (None, "linear", "llama3", "freq_factors"):  # freq_factors: GGUF's rope_freqs tensor
            raise MinferError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")
