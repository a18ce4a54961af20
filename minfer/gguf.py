"""GGUF files (llama, qwen2, qwen3 and gemma3 architectures): a small reader of the format, and the config,
weights and tokenizer.

The header (metadata and tensor table) is parsed here with struct; tensor data stays memory-mapped. A
tensor's raw bytes go to the target device as they are. Matrices in a format with kernels (quant.QUANTIZED)
stay in their blocks; other tensors are decoded there (any other type gguf knows, on the host, with a
notice). A llama file's Q/K rows are un-permuted from llama.cpp's interleaved RoPE pairing back to HF's
rotate-half order (the others keep HF's), so that the model runs the same code for GGUF and safetensors
checkpoints.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass

import numpy as np
import torch

from . import quant
from .config import ModelConfig, check_fields, positive_int, positive_number
from .errors import MinferError, file_error

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
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
}
# Gemma's sandwich norms: ffn_norm is the norm before the MLP, which HF calls pre_feedforward_layernorm there.
GEMMA_TENSOR_NAMES = {
    **TENSOR_NAMES,
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

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
        spans = []  # (begin, end, name): a tensor's type and shape must fit the bytes before the next one
        for name, dims, kind, offset in table:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise MinferError(f"tensor {name}: unknown GGUF tensor type {kind}") from None
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n = math.prod(dims)
            if dims and dims[0] % block:  # a row is whole blocks
                raise MinferError(f"tensor {name}: rows of {dims[0]} values do not fill {qtype.name} blocks of {block}")
            begin, end = start + offset, start + offset + n // block * size
            if end > len(self.buf):
                raise ValueError(f"tensor {name} ends at byte {end}, past the end of the file ({len(self.buf)} bytes)")
            self.tensors.append(Tensor(name, qtype.name, tuple(reversed(dims)), n, data[begin:end]))
            spans.append((begin, end, name))
        spans.sort()
        for (begin, end, name), (nxt, _, other) in zip(spans, spans[1:]):
            # writers pad each tensor to the alignment: a gap past it means a type or shape that reads too few bytes
            if not 0 <= nxt - end < align:
                t = next(t for t in self.tensors if t.name == name)
                where = "runs into" if end > nxt else f"leaves {nxt - end} bytes before"
                raise MinferError(f"tensor {name} ({t.kind} {list(t.shape)}, {end - begin} bytes) {where} tensor "
                                  f"{other} at byte {nxt}: its type or shape does not match its data")

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
    """path's metadata and tensors; a file of a split model (any of its parts) gives the whole model's."""
    reader = _read_one(path)
    count = reader.fields.get("split.count", 1)
    return reader if count == 1 else _join_split(path, reader, count)


def _read_one(path: str) -> Reader:
    try:
        return Reader(path)
    except MinferError:
        raise
    except OSError as e:
        raise file_error(path, e) from None
    except Exception as e:  # a truncated or foreign header fails in struct, numpy or decoding
        raise MinferError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


# llama.cpp's split models (llama-gguf-split, gguf's writer with a size limit): NAME-00001-of-00003.gguf and so on,
# each a GGUF of some of the tensors; the first carries the model's metadata, each its split.no (from 0) and count.
SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


def _join_split(path: str, given: Reader, count) -> Reader:
    name = SPLIT_NAME.fullmatch(os.path.basename(path))
    if not isinstance(count, int) or count < 1:
        raise MinferError(f"{path}: split.count {count!r} is not a count of files")
    if name is None or int(name[3]) != count:
        raise MinferError(f"{path}: one of {count} files of a split model, but not named NAME-0000N-of-{count:05d}.gguf "
                          f"as llama.cpp names them, so the others cannot be found")
    paths = [os.path.join(os.path.dirname(path), f"{name[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    parts = [given if i + 1 == int(name[2]) else _read_one(p) for i, p in enumerate(paths)]
    for i, (p, part) in enumerate(zip(paths, parts)):
        no, of = part.fields.get("split.no", 0), part.fields.get("split.count", 1)
        if (no, of) != (i, count):
            raise MinferError(f"{p}: split.no {no} of {of}, where file {i + 1} of {count} has {i} of {count}")
    tensors = {}
    for p, part in zip(paths, parts):
        for t in part.tensors:
            if tensors.setdefault(t.name, t) is not t:
                raise MinferError(f"{p}: tensor {t.name} is in an earlier file of the split model too")
    reader = parts[0]  # the model's metadata; the other parts' mappings live on in their tensors' views
    reader.tensors = list(tensors.values())
    total = reader.fields.get("split.tensors.count", len(reader.tensors))
    if total != len(reader.tensors):
        raise MinferError(f"{paths[0]}: split.tensors.count is {total}, but the {count} files hold "
                          f"{len(reader.tensors)} tensors")
    return reader


def _field(reader: Reader, key: str, default=None):
    return reader.fields.get(key, default)


_INT, _NUMBER = (positive_int, "a positive integer"), (positive_number, "a positive number")
# {arch}.* keys read into the config, checked before any arithmetic on them (the rest: ModelConfig.validate).
_KEYS = {"embedding_length": _INT, "attention.head_count": _INT, "attention.head_count_kv": _INT,
         "block_count": _INT, "feed_forward_length": _INT, "context_length": _INT, "vocab_size": _INT,
         "attention.key_length": _INT, "rope.dimension_count": _INT, "attention.sliding_window": _INT,
         "attention.layer_norm_rms_epsilon": _NUMBER, "rope.freq_base": _NUMBER, "rope.freq_base_swa": _NUMBER,
         "rope.scaling.factor": _NUMBER, "final_logit_softcapping": _NUMBER}


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise MinferError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHS)}")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    check_fields({k: a(k) for k in _KEYS}, _KEYS, f"GGUF metadata {arch}.")
    if a("expert_count"):  # Mixtral and other MoE files keep llama's name and its other keys
        raise MinferError(f"GGUF {arch} model with {a('expert_count')} experts a layer (mixture of experts): "
                          f"not supported; minfer runs dense models")
    hidden, heads = a("embedding_length"), a("attention.head_count")
    if hidden is None or heads is None:
        raise MinferError(f"GGUF file lacks {arch}.embedding_length / {arch}.attention.head_count")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    rope_scaling = None
    kind = a("rope.scaling.type")
    if kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": a("rope.scaling.factor")}
    elif kind not in (None, "none"):
        raise MinferError(f"unsupported GGUF {arch}.rope.scaling.type {kind!r}; supported: none, linear")
    if "rope_freqs.weight" in names:  # llama3-style scaling, stored as per-frequency divisors
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rope_scaling = {"rope_type": "freq_factors", "factors": tensor_to_torch(freqs).float().tolist()}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    head_dim = a("attention.key_length") or hidden // heads
    gemma = {}
    if arch == "gemma3":
        gemma = _gemma3_config(a, hidden, heads, head_dim)
    cfg = ModelConfig(
        arch=arch,
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
        attention_bias="blk.0.attn_q.bias" in names,  # Qwen2's q/k/v biases
        **({"qk_norm": arch == "qwen3"} | gemma),
    )
    cfg.validate()
    return cfg


def _gemma3_config(a, hidden: int, heads: int, head_dim: int) -> dict:
    """The Gemma 3 fields llama.cpp derives rather than stores: every 6th layer global unless the file has
    attention.sliding_window_pattern (a period, or a bool per layer: True = windowed); local RoPE base
    10000 unless rope.freq_base_swa; query_pre_attn_scalar hidden / heads on the 62-layer 27B, else head_dim."""
    from .config import FULL, SLIDING
    layers = a("block_count")
    pattern = a("attention.sliding_window_pattern", 6)
    if not (type(pattern) is int and pattern > 0 or isinstance(pattern, list) and len(pattern) == layers):
        raise MinferError(f"GGUF metadata gemma3.attention.sliding_window_pattern is {pattern!r}; it must be a "
                          f"positive integer or one bool a layer")
    if isinstance(pattern, list):
        types = [SLIDING if p else FULL for p in pattern]
    else:
        types = [SLIDING if i % pattern < pattern - 1 else FULL for i in range(layers)]
    return dict(embed_scale=hidden ** 0.5, hidden_act="gelu_tanh", sandwich_norm=True, qk_norm=True,
                sliding_window=a("attention.sliding_window"), layer_types=types,
                rope_local_theta=float(a("rope.freq_base_swa", 10000.0)),
                query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
                final_logit_softcapping=a("final_logit_softcapping"))


def _dequantize(kind: str, raw: torch.Tensor, n: int) -> torch.Tensor:
    """raw: the tensor's bytes, uint8 [bytes] on any device; n: element count. Returns fp32 [n] there.
    The formats with kernels decode in torch on the device; any other type gguf knows decodes on the host."""
    if kind in quant.QUANTIZED:
        return quant.dequantize(kind, raw, n)
    import gguf
    if kind not in _NOTICED:
        _NOTICED.add(kind)
        print(f"minfer: GGUF type {kind} has no kernel; dequantized at load", file=sys.stderr)
    try:
        values = gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType[kind])
    except NotImplementedError:
        raise MinferError(f"GGUF tensor type {kind} cannot be read (no dequantizer)") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1)[:n].to(raw.device)


_NOTICED: set[str] = set()  # types whose at-load dequantization was reported


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


def permuted_heads(cfg: ModelConfig, name: str) -> int | None:
    """The head count of a Q or K matrix (HF name) whose rows llama.cpp stores in its interleaved RoPE order: a
    llama file's only (Qwen and Gemma run NEOX RoPE there and keep HF's rows); None for any other tensor."""
    if cfg.arch != "llama":
        return None
    return cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads if name.endswith("k_proj.weight") \
        else None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows so that RoPE pairs are adjacent (2i, 2i+1); HF pairs (i, i + d/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    names = GEMMA_TENSOR_NAMES if arch == "gemma3" else TENSOR_NAMES
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}", *parts[2:]])
        return names[key].format(i=parts[1]) if key in names else None
    return names.get(gguf_name)


# Matrices that linear and embedding take in their GGUF blocks (all but the norms and biases).
_MATRICES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")


def read_weights(reader: Reader, cfg: ModelConfig, dtype: torch.dtype, device, progress,
                 timing=_no_timing, keep_quantized: bool = True) -> dict[str, torch.Tensor | quant.QuantizedWeight]:
    """HF name -> weight on `device`. With keep_quantized, matrices in a format with kernels stay in their
    blocks (quant.QuantizedWeight); everything else is dequantized to `dtype`."""
    weights = {}
    for t in progress(reader.tensors):
        name = hf_name(t.name, cfg.arch)
        if name is None:
            continue  # e.g. rope_freqs.weight, already folded into the config
        heads = permuted_heads(cfg, name)
        if keep_quantized and t.kind in quant.QUANTIZED and name.endswith(_MATRICES) and len(t.shape) == 2:
            with timing("read"):
                raw = t.data.clone()  # owned memory, so that no weight aliases the file's mapping
            with timing("upload"):
                blocks = raw.to(device).view(t.shape[0], -1)  # [rows, row bytes]
            w = quant.QuantizedWeight(t.kind, blocks, t.shape, dtype)
            w = w if heads is None else w.select_rows(unpermute_qk(torch.arange(t.shape[0]), heads))
            # a linear's blocks on the GPU in the form its kernels stream fastest (the embedding's stay by rows)
            weights[name] = quant.tile_rows(w) if blocks.is_cuda and not name.endswith("embed_tokens.weight") else w
            continue
        w = tensor_to_torch(t, device, timing)
        with timing("dequantize"):
            weights[name] = (w if heads is None else unpermute_qk(w, heads)).to(dtype)
    return weights


def tokenizer_from_fields(field):
    """A tokenizers.Tokenizer for a GGUF vocabulary (GPT-2-style byte-level BPE, or SentencePiece), plus its
    metadata; field(key, default=None) reads the tokenizer.* fields (of a file, or of a dict)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = field("tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece: Llama 2, Mistral, TinyLlama, Gemma, Phi-3
        from .sentencepiece import from_gguf_fields
        return from_gguf_fields(field)
    if kind != "gpt2":
        raise MinferError(f"unsupported GGUF tokenizer {kind!r}; supported: gpt2 (byte-level BPE), "
                          f"llama (SentencePiece)")
    tokens, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges")
    if not tokens or not merges:  # without merges BPE splits every word into characters: fluent-looking garbage
        raise MinferError(f"GGUF tokenizer (gpt2) lacks tokenizer.ggml.{'tokens' if not tokens else 'merges'}")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    # Tokens outside the byte alphabet (rare, from some converters) are re-spelled through UTF-8.
    vocab = {tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode()): i for i, tok in enumerate(tokens)}
    pre = field("tokenizer.ggml.pre")
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                     ignore_merges=pre in _WHOLE_WORDS)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    meta = {
        "chat_template": field("tokenizer.chat_template"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False)),
        "control_tokens": [t for t, ty in zip(tokens, types) if ty == 3],
    }
    return tok, meta


# How text splits into words before BPE, by tokenizer.ggml.pre, as llama.cpp reads each name (llama-vocab.cpp);
# the patterns are the models' own tokenizer.json ones.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken (Nemo, Small 3): words by letter case, each digit alone.
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"),
                               _LLAMA3_SPLIT),
               **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2_SPLIT),
               "tekken": _TEKKEN_SPLIT, **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT)}
# Each digit alone, then GPT-2's split (SmolLM, StarCoder, Command R, ...).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_GPT2 = ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion")
# A word that is a token is taken whole, not merged (llama.cpp's ignore_merges; Llama 3's tokenizer.json).
_WHOLE_WORDS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken")


def _pre_tokenizer(pre: str | None):
    """The byte-level pre-tokenizer that tokenizer.ggml.pre names. A file without one (or 'default') gets GPT-2's
    split, with a notice; a name llama.cpp reads another way is an error, not a silently different split."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _PRE_SPLITS:
        split = pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2:
        if pre not in (None, "", "default"):
            known = sorted((*_PRE_SPLITS, *_DIGITS_THEN_GPT2, *_GPT2))
            raise MinferError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(known)}")
        print(f"[minfer] GGUF tokenizer.ggml.pre is {repr(pre) if pre else 'missing'}: words split as GPT-2 "
              f"splits them, which may not be how this model's own tokenizer splits them", file=sys.stderr)
    return gpt2


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
