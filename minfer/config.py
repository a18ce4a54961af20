"""Model configuration: one dataclass for every supported architecture (Llama family, Gemma 3)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import MinferError

# HF `architectures` entry -> our family name. Families differ only in the switches below.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
# config.json's `model_type`, for configs without `architectures`.
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types entries
# Sizes that must be positive integers (checked before any is divided by).
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def positive_int(v) -> bool:
    return type(v) is int and v > 0


def positive_number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v > 0


def _token_id(v) -> bool:
    return type(v) is int and v >= 0


# config.json's optional fields: (check, what it must be). A value of another type is an error naming the field,
# never a silent default (bool("false") is True) or a TypeError deep in the model's set-up.
HF_FIELDS = {
    "num_key_value_heads": (positive_int, "a positive integer"),
    "head_dim": (positive_int, "a positive integer"),
    "max_position_embeddings": (positive_int, "a positive integer"),
    "sliding_window": (positive_int, "a positive integer"),
    "sliding_window_pattern": (positive_int, "a positive integer"),
    "max_window_layers": (lambda v: type(v) is int and v >= 0, "an integer >= 0"),
    "rms_norm_eps": (positive_number, "a positive number"),
    "rope_theta": (positive_number, "a positive number"),
    "rope_local_base_freq": (positive_number, "a positive number"),
    "query_pre_attn_scalar": (positive_number, "a positive number"),
    "final_logit_softcapping": (positive_number, "a positive number"),
    "partial_rotary_factor": (lambda v: positive_number(v) and v <= 1, "a number in (0, 1]"),
    "use_sliding_window": (lambda v: type(v) is bool, "true or false"),
    "tie_word_embeddings": (lambda v: type(v) is bool, "true or false"),
    "attention_bias": (lambda v: type(v) is bool, "true or false"),
    "rope_scaling": (lambda v: isinstance(v, dict), "an object"),
    "rope_parameters": (lambda v: isinstance(v, dict), "an object"),
    "layer_types": (lambda v: isinstance(v, list), "a list"),
    "bos_token_id": (_token_id, "a token id"),
    "eos_token_id": (lambda v: _token_id(v) or (isinstance(v, list) and all(map(_token_id, v))),
                     "a token id or a list of them"),
}
# rope_scaling's fields, by the same rule.
_ROPE_FIELDS = {
    "factor": (positive_number, "a positive number"),
    "low_freq_factor": (positive_number, "a positive number"),
    "high_freq_factor": (positive_number, "a positive number"),
    "original_max_position_embeddings": (positive_int, "a positive integer"),
    "rope_theta": (positive_number, "a positive number"),
}


def check_fields(values: dict, fields: dict, where: str) -> None:
    """fields: key -> (check, what it must be); a value present and failing its check is a MinferError."""
    for key, (ok, want) in fields.items():
        v = values.get(key)
        if v is not None and not ok(v):
            raise MinferError(f"{where}{key} is {v!r}; it must be {want}")


@dataclass
class ModelConfig:
    arch: str  # llama | mistral | qwen2 | qwen3 | gemma3
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
    sliding_window: int | None = None  # keys a windowed layer sees: the query's own and the window - 1 before it
    layer_types: list[str] | None = None  # per layer SLIDING (windowed) or FULL; None: all FULL
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    # Gemma 3. Its RMSNorm weights are stored as the multiplier itself (1 + w of HF's checkpoints, as GGUF has it).
    embed_scale: float | None = None  # the embedding rows are multiplied by this (sqrt(hidden))
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_tanh
    sandwich_norm: bool = False  # RMSNorm on the attention and MLP outputs too, before each joins the residual
    query_pre_attn_scalar: float | None = None  # attention scale = its -1/2 power (None: head_dim's)
    rope_local_theta: float | None = None  # RoPE base of the SLIDING layers, unscaled (None: as the FULL ones)
    final_logit_softcapping: float | None = None  # logits <- cap * tanh(logits / cap)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """The attention window of a layer (None: it sees the whole context)."""
        if self.sliding_window is None or self.layer_types is None or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        for key in _SIZES:
            if hf.get(key) is None:
                raise MinferError(f"config.json is missing {key!r}")
        check_fields(hf, dict.fromkeys(_SIZES, (positive_int, "a positive integer")) | HF_FIELDS, "config.json: ")
        for key in ("rope_scaling", "rope_parameters"):
            params = hf.get(key) or {}
            for name, sub in [(key, params)] + [(f"{key}.{t}", params.get(t)) for t in (FULL, SLIDING)]:
                if sub is not None and not isinstance(sub, dict):
                    raise MinferError(f"config.json: {name} is {sub!r}; it must be an object")
                check_fields(sub or {}, _ROPE_FIELDS, f"config.json: {name}.")

        def opt(key, default):  # a null field is its default
            return default if hf.get(key) is None else hf[key]

        try:
            num_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            eos = hf.get("eos_token_id")
            window = hf.get("sliding_window") if opt("use_sliding_window", arch in ("mistral", "gemma3")) else None
            gemma = arch == "gemma3"
            rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
            rope_theta = hf.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
            rope_local_theta = None
            if arch == "gemma3":
                rope_scaling, rope_theta, rope_local_theta = _gemma3_rope(hf)
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
                rms_norm_eps=opt("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                partial_rotary_factor=opt("partial_rotary_factor", 1.0),
                max_position_embeddings=opt("max_position_embeddings", 4096),
                sliding_window=window,
                layer_types=_layer_types(hf, arch, window),
                tie_word_embeddings=opt("tie_word_embeddings", False),
                attention_bias=opt("attention_bias", arch == "qwen2"),
                qk_norm=arch in ("qwen3", "gemma3"),
                embed_scale=hidden ** 0.5 if gemma else None,
                hidden_act="gelu_tanh" if gemma else "silu",
                sandwich_norm=gemma,
                query_pre_attn_scalar=opt("query_pre_attn_scalar", 256) if gemma else None,
                rope_local_theta=rope_local_theta,
                final_logit_softcapping=hf.get("final_logit_softcapping"),
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
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                             or not set(self.layer_types) <= {SLIDING, FULL}):
            raise MinferError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {self.num_layers} layers")
        if self.sliding_window is not None and not (type(self.sliding_window) is int and self.sliding_window > 0):
            raise MinferError(f"model config: sliding_window is {self.sliding_window!r}; it must be a positive integer")
        local = ("rope_local_theta",) if self.rope_local_theta is not None else ()
        for key in ("rms_norm_eps", "rope_theta") + local:
            if not positive_number(getattr(self, key)):
                raise MinferError(f"model config: {key} is {getattr(self, key)!r}; it must be a positive number")
        if not (positive_number(self.partial_rotary_factor) and self.partial_rotary_factor <= 1
                and self.rotary_dim >= 2 and self.rotary_dim % 2 == 0):
            raise MinferError(f"model config: RoPE over {self.partial_rotary_factor!r} of head_dim {self.head_dim} "
                              f"is {self.rotary_dim} dims; it must be an even count in [2, head_dim]")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise MinferError(f"unsupported activation {self.hidden_act!r}; supported: silu, gelu_tanh")
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type")
        if kind not in (None, "linear", "llama3", "freq_factors"):  # freq_factors: GGUF's rope_freqs tensor
            raise MinferError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")
        if kind in ("linear", "llama3") and not positive_number(scaling.get("factor")):
            raise MinferError(f"rope_scaling of type {kind} needs a positive factor, not {scaling.get('factor')!r}")
        if kind == "llama3" and not scaling.get("low_freq_factor", 1.0) < scaling.get("high_freq_factor", 4.0):
            raise MinferError("rope_scaling (llama3): low_freq_factor must be below high_freq_factor")


def _layer_types(hf: dict, arch: str, window: int | None) -> list[str] | None:
    """SLIDING / FULL per layer: the config's own list, else Gemma 3's pattern (every n-th layer FULL, n =
    sliding_window_pattern, 6 by default), else Qwen2's (layers from max_window_layers on are SLIDING), else
    every layer SLIDING when there is a window (Mistral)."""
    if window is None:
        return None
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if arch == "gemma3":
        every = hf.get("sliding_window_pattern") or 6
        return [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
    if arch == "qwen2":
        first = n if hf.get("max_window_layers") is None else hf["max_window_layers"]
        return [SLIDING if i >= first else FULL for i in range(n)]
    return [SLIDING] * n


def _gemma3_rope(hf: dict) -> tuple[dict | None, float, float]:
    """(scaling of the FULL layers, their base, the SLIDING layers' base) from either config spelling:
    rope_parameters keyed by layer type (transformers 5), or rope_theta / rope_local_base_freq / rope_scaling."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        return (full if full.get("rope_type", "default") != "default" else None,
                float(full.get("rope_theta", 1_000_000.0)), float(local.get("rope_theta", 10_000.0)))
    return (hf.get("rope_scaling"), float(hf.get("rope_theta") or 1_000_000.0),
            float(hf.get("rope_local_base_freq") or 10_000.0))
