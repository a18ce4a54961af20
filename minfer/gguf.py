"""GGUF files (llama architecture): a small reader of the format, and the config, weights and tokenizer.

The header (metadata and tensor table) is parsed here with struct; tensor data stays memory-mapped. A
tensor's raw bytes go to the target device as they are, and are decoded there: quantized blocks (Q8_0,
Q4_0, Q4_1) dequantized, and Q/K rows un-permuted from llama.cpp's interleaved RoPE pairing back to HF's
rotate-half order, so that the model runs the same code for GGUF and safetensors checkpoints.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import struct
from dataclasses import dataclass

import numpy as np
import torch

from .config import ModelConfig
from .errors import MinferError, file_error

QK = 32  # elements per quantization block for Q8_0, Q4_0 and Q4_1

# GGUF tensor name -> HF name ("{i}" is the layer index).
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# Metadata value types: struct formats of the scalars (numpy dtypes for arrays of them), string, array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class Tensor:
    name: str
    kind: str  # ggml type name: F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...
    shape: tuple[int, ...]  # HF order [ne1, ne0]: ggml lists the contiguous dim first
    n_elements: int
    data: torch.Tensor  # uint8 [bytes]: a view of the mapped file


class Reader:
    """A GGUF file's metadata (`fields`: key -> Python value) and tensor table (`tensors`)."""

    def __init__(self, path: str):
        import gguf  # for its table of ggml types and their block sizes

        with open(path, "rb") as f:
            # A private (copy-on-write) mapping: writable, so torch takes views of it without copying or
            # warning, and nothing is ever written back to the file.
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.pos = 0
        magic, version, n_tensors, n_kv = self._unpack("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"magic {magic!r}, version {version}; expected GGUF version 2 or 3")
        self.fields = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        table = []
        for _ in range(n_tensors):
            name = self._string()
            dims = self._unpack(f"<{self._unpack('<I')[0]}Q")
            table.append((name, dims, *self._unpack("<IQ")))
        align = self.fields.get("general.alignment", 32)
        start = -(-self.pos // align) * align  # tensor data starts at the next multiple of the alignment
        data = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.tensors = []
        for name, dims, kind, offset in table:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise MinferError(f"tensor {name}: unknown GGUF tensor type {kind}") from None
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n = math.prod(dims)
            begin, end = start + offset, start + offset + n // block * size
            if end > len(self.buf):
                raise ValueError(f"tensor {name} ends at byte {end}, past the end of the file ({len(self.buf)} bytes)")
            self.tensors.append(Tensor(name, qtype.name, tuple(reversed(dims)), n, data[begin:end]))

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALAR:
            return self._unpack("<" + _SCALAR[vtype])[0]
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = self._unpack("<IQ")
        if etype in _SCALAR:  # one numpy read for the whole array (token types, scores)
            dtype = np.dtype("<" + _SCALAR[etype])
            out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += count * dtype.itemsize
            return out
        return [self._value(etype) for _ in range(count)]  # strings (the vocabulary, merges) or nested arrays


def open_reader(path: str) -> Reader:
    try:
        return Reader(path)
    except MinferError:
        raise
    except OSError as e:
        raise file_error(path, e) from None
    except Exception as e:  # a truncated or foreign header fails in struct, numpy or decoding
        raise MinferError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: Reader, key: str, default=None):
    return reader.fields.get(key, default)


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise MinferError(f"unsupported GGUF architecture {arch!r}; supported: llama")
    a = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    hidden, heads = a("embedding_length"), a("attention.head_count")
    if hidden is None or heads is None:
        raise MinferError("GGUF file lacks llama.embedding_length / llama.attention.head_count")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    rope_scaling = None
    if a("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": a("rope.scaling.factor")}
    if "rope_freqs.weight" in names:  # llama3-style scaling, stored as per-frequency divisors
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rope_scaling = {"rope_type": "freq_factors", "factors": tensor_to_torch(freqs).float().tolist()}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    head_dim = a("attention.key_length") or hidden // heads
    cfg = ModelConfig(
        arch="llama",
        vocab_size=a("vocab_size") or len(tokens),
        hidden_size=hidden,
        intermediate_size=a("feed_forward_length"),
        num_layers=a("block_count"),
        num_heads=heads,
        num_kv_heads=a("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        partial_rotary_factor=(a("rope.dimension_count") or head_dim) / head_dim,
        max_position_embeddings=a("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
    )
    cfg.validate()
    return cfg


def _dequantize(kind: str, raw: torch.Tensor, n: int) -> torch.Tensor:
    """raw: the tensor's bytes, uint8 [bytes] on any device; n: element count. Returns fp32 [n] there."""
    if kind == "Q8_0":  # fp16 scale d, 32 x int8:  x = d * q
        b = raw.view(-1, 2 + QK)
        d = b[:, :2].contiguous().view(torch.float16).float()
        return (d * b[:, 2:].contiguous().view(torch.int8)).reshape(-1)[:n]
    if kind in ("Q4_0", "Q4_1"):  # low nibbles hold elements 0..15, high nibbles 16..31
        head = 2 if kind == "Q4_0" else 4
        b = raw.view(-1, head + QK // 2)
        d = b[:, :2].contiguous().view(torch.float16).float()
        packed = b[:, head:]
        q = torch.cat([packed & 0xF, packed >> 4], dim=1)  # uint8 [blocks, 32]
        if kind == "Q4_0":  # x = d * (q - 8)
            return (d * (q.float() - 8)).reshape(-1)[:n]
        m = b[:, 2:4].contiguous().view(torch.float16).float()  # x = d * q + m
        return torch.addcmul(m, d, q.float()).reshape(-1)[:n]
    raise MinferError(f"unsupported GGUF tensor type {kind}; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1")


def _no_timing(phase: str):
    return contextlib.nullcontext()


def tensor_to_torch(t: Tensor, device="cpu", timing=_no_timing) -> torch.Tensor:
    """One GGUF tensor -> a torch tensor [ne1, ne0] on `device`: fp32, or F16/BF16 as stored. The raw
    bytes are read into host memory, uploaded, and decoded on the device; timing(phase) brackets each."""
    with timing("read"):
        raw = t.data.clone()  # uint8 [bytes]; owned memory, so that no weight aliases the file's mapping
    with timing("upload"):
        raw = raw.to(device)
    with timing("dequantize"):
        floats = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        out = raw.view(floats[t.kind]) if t.kind in floats else _dequantize(t.kind, raw, t.n_elements)
        return out.reshape(t.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows so that RoPE pairs are adjacent (2i, 2i+1); HF pairs (i, i + d/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}", *parts[2:]])
        return TENSOR_NAMES[key].format(i=parts[1]) if key in TENSOR_NAMES else None
    return TENSOR_NAMES.get(gguf_name)


def read_weights(reader: Reader, cfg: ModelConfig, dtype: torch.dtype, device, progress,
                 timing=_no_timing) -> dict[str, torch.Tensor]:
    weights = {}
    for t in progress(reader.tensors):
        name = hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs.weight, already folded into the config
        w = tensor_to_torch(t, device, timing)
        with timing("dequantize"):
            if name.endswith("q_proj.weight"):
                w = unpermute_qk(w, cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                w = unpermute_qk(w, cfg.num_kv_heads)
            weights[name] = w.to(dtype)
    return weights


def read_tokenizer(reader):
    """A tokenizers.Tokenizer for a GPT-2-style byte-level BPE vocabulary, plus its metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise MinferError(f"unsupported GGUF tokenizer {kind!r}; supported: gpt2 (byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    # Tokens outside the byte alphabet (rare, from some converters) are re-spelled through UTF-8.
    vocab = {tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode()): i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = Tokenizer(bpe)
    split = _PRE_SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    meta = {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "control_tokens": [t for t, ty in zip(tokens, types) if ty == 3],
    }
    return tok, meta


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex; anything else gets GPT-2's own byte-level split.
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
