"""CLI: python -m minfer.quantize SRC OUT.gguf --type {Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q6_K} -- a llama.cpp GGUF.

SRC is an HF folder (config.json + safetensors + tokenizer.json with a byte-level BPE) or an F32/F16/BF16
GGUF. `--shape NAME` (instead of SRC) takes a model shape from minfer.shapes with random weights
(N(0, 0.02), norms N(1, 0.02), as shapes.random_weights) and a placeholder byte-level BPE tokenizer
sized to the shape's vocab: GPT-2's 256 byte tokens, <|begin_of_text|> (BOS) and <|end_of_text|> (EOS)
as control tokens, 702 merged tokens (" a".." z", "aa".."zz"), then unused "[PAD{i}]" tokens.

Tensors are quantized in torch on `--device` (cuda for large models), in row chunks, and streamed to
the file one at a time; OUT is written as a temporary OUT.*.part beside it and renamed when complete.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import quant
from .config import ModelConfig
from .errors import ArgumentParser, MinferError, file_error, read_json, run_cli
from .shapes import check_tensors

# --type -> (the type of most weights, llama.cpp's general.file_type: LlamaFileType)
FTYPES = {"Q8_0": ("Q8_0", 7), "Q4_0": ("Q4_0", 2), "Q4_K_M": ("Q4_K", 15), "Q5_K_M": ("Q5_K", 17), "Q6_K": ("Q6_K", 18)}
# llama.cpp's fallback for a row length that is not a multiple of 256 (then F16 if not of 32 either)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
CHUNK = 1 << 24  # elements quantized at once: bounds the search's temporaries (~10 fp32 copies)

# HF name -> GGUF name, "{i}" the layer index: the inverse of minfer.gguf's table, plus Qwen's extras.
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
}


def gguf_name(hf: str) -> str | None:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m is None:
        return _NAMES.get(hf)
    key = _NAMES.get("model.layers.{i}." + m.group(2))
    return key.format(i=m.group(1)) if key else None


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp: the first and last eighth of the layers, and every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], ftype: str, cfg: ModelConfig, has_output: bool,
                pure: bool = False) -> str:
    """The GGUF type of tensor `name` (GGUF name, HF shape [rows, cols]) in a --type `ftype` file, by
    llama.cpp's llama_tensor_get_type (no importance matrix):
      - 1-D tensors (norms, biases) F32;
      - output.weight (token_embd.weight when tied) Q6_K, Q8_0 when the type is Q8_0 or the rows are
        not a multiple of 256;
      - attn_v and ffn_down Q6_K in Q4_K_M/Q5_K_M on use_more_bits layers; attn_v of a 70B
        (80 layers, GQA) one step up from Q4_K to Q5_K;
      - everything else (token_embd included) the type's base; --pure: everything the base;
      - a row length that is not a multiple of the type's block falls back: Q4_K -> Q5_0,
        Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when not a multiple of 32."""
    if len(shape) < 2:
        return "F32"
    base = FTYPES[ftype][0]
    t = base
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if pure:
        pass
    elif name == "output.weight" or (not has_output and name == "token_embd.weight"):
        t = "Q8_0" if shape[1] % 256 or base == "Q8_0" else "Q6_K"
    elif ".attn_v.weight" in name:
        if ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, cfg.num_layers):
            t = "Q6_K"
        if cfg.num_layers == 80 and cfg.num_kv_heads < cfg.num_heads and t == "Q4_K":  # llama.cpp's 70B rule
            t = "Q5_K"
    elif ".ffn_down.weight" in name:
        if ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, cfg.num_layers):
            t = "Q6_K"
    if shape[1] % quant.BLOCK_ELEMS[t]:
        t = FALLBACK.get(t, t)
        if shape[1] % quant.BLOCK_ELEMS[t]:
            t = "F16"
    return t


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half Q/K rows -> llama.cpp's interleaved RoPE pairs: the inverse of gguf.unpermute_qk."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: ModelConfig) -> list[float]:
    """Per-frequency divisors of llama3 rope scaling, as convert_hf_to_gguf writes rope_freqs.weight."""
    s = cfg.rope_scaling
    factor, low, high = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    dim = cfg.rotary_dim
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


@dataclass
class Vocab:
    """What a GGUF file says of its byte-level BPE tokenizer (tokenizer.ggml.*)."""
    tokens: list[str]
    types: list[int]  # 1 normal, 3 control, 4 user-defined, 5 unused
    merges: list[str]  # "a b"
    pre: str  # the pre-tokenizer's split, by llama.cpp's name
    bos: int | None = None
    eos: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    def fields(self) -> dict:
        """The tokenizer.* fields of a GGUF file that holds this vocabulary."""
        return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": self.pre, "tokenizer.ggml.tokens": self.tokens,
                "tokenizer.ggml.token_type": self.types, "tokenizer.ggml.merges": self.merges,
                "tokenizer.ggml.bos_token_id": self.bos, "tokenizer.ggml.eos_token_id": self.eos,
                "tokenizer.ggml.add_bos_token": self.add_bos, "tokenizer.chat_template": self.chat_template}


@dataclass
class Source:
    cfg: ModelConfig
    shapes: dict[str, tuple[int, ...]]  # HF name -> shape, every tensor to write
    read: Callable[[str], torch.Tensor]  # HF name -> float tensor (HF layout), on any device
    vocab: Vocab
    name: str
    where: str  # what errors name: SRC, or --shape NAME
    label: Callable[[str], str] = lambda hf: hf  # HF name -> the name SRC itself gives the tensor


# ---------------------------------------------------------------------------------------- sources

def placeholder_vocab(vocab_size: int) -> Vocab:
    """GPT-2's 256 byte tokens, BOS and EOS, merged tokens " a".." z" and "aa".."zz" while they fit,
    then unused [PAD{i}]: any text encodes, English in fewer tokens than bytes."""
    from .gguf import _bytes_to_unicode

    spell = _bytes_to_unicode()
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [(spell[ord(" ")], c) for c in letters] + [(a, b) for a in letters for b in letters]
    pairs = pairs[:max(0, vocab_size - 258)]
    if not pairs:
        raise MinferError(f"vocab_size {vocab_size} is too small for the placeholder tokenizer (259 tokens)")
    tokens = [spell[b] for b in range(256)] + ["<|begin_of_text|>", "<|end_of_text|>"] + [a + b for a, b in pairs]
    types = [1] * 256 + [3, 3] + [1] * len(pairs)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [5] * (vocab_size - len(types))
    return Vocab(tokens, types, [f"{a} {b}" for a, b in pairs], "gpt-2", bos=256, eos=257, add_bos=True)


def shape_source(name: str, device, seed: int = 0) -> Source:
    from . import shapes

    cfg = shapes.config(name)
    sizes = shapes.weight_shapes(cfg)

    def read(hf: str) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(hf.encode()))
        w = torch.empty(sizes[hf], dtype=torch.float32, device=device)
        return w.normal_(1.0 if "norm" in hf else 0.0, 0.02, generator=gen)

    return Source(cfg, sizes, read, placeholder_vocab(cfg.vocab_size), name, f"--shape {name}")


def hf_vocab(folder: str, cfg: ModelConfig) -> Vocab:
    """tokenizer.json (byte-level BPE) + tokenizer_config.json -> Vocab, llama.cpp's convert_hf_to_gguf
    way: ids past the tokenizer up to the model's vocab_size become unused [PAD{i}]."""
    from .gguf import _PRE_SPLITS
    from .tokenizer import from_hf_folder

    path = os.path.join(folder, "tokenizer.json")
    tj = read_json(path)
    model = tj.get("model") or {}
    text = str(tj.get("pre_tokenizer")) + str(tj.get("decoder"))
    if model.get("type") != "BPE" or "ByteLevel" not in text:
        raise MinferError(f"{path}: a {model.get('type')} tokenizer; supported: byte-level BPE (GPT-2 style)")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if max(by_id) >= cfg.vocab_size:
        raise MinferError(f"{path}: token id {max(by_id)} is past the model's vocab_size {cfg.vocab_size}")
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(5)
        else:
            tokens.append(by_id[i])
            types.append((3 if added[i].get("special") else 4) if i in added else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = tj.get("pre_tokenizer") or {}
    splits = [p["pattern"].get("Regex") for p in pre.get("pretokenizers", [pre]) if p.get("type") == "Split"]
    # llama.cpp names the split by the regex; minfer and transformers know these two, else GPT-2's own
    pre = next((k for k in ("llama-bpe", "qwen2") if _PRE_SPLITS[k] in splits), "gpt-2")
    tok = from_hf_folder(folder, cfg.eos_token_ids, cfg.bos_token_id)
    return Vocab(tokens, types, merges, pre, tok.bos_token_id, tok.eos_token_id, tok.add_bos, tok.chat_template)


def hf_source(folder: str) -> Source:
    from .loader import open_shard, read_hf_config, shard_paths

    cfg = read_hf_config(folder)
    where, shapes = {}, {}  # HF name -> its open file, its shape
    for path in shard_paths(folder):
        f, table = open_shard(path)
        for k, shape in table.items():
            if gguf_name(k) is not None:  # not e.g. rotary_emb.inv_freq
                where[k], shapes[k] = f, shape
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return Source(cfg, shapes, lambda k: where[k].get_tensor(k), hf_vocab(folder, cfg),
                  os.path.basename(os.path.abspath(folder)), folder)


def gguf_source(path: str) -> Source:
    from . import gguf

    reader = gguf.open_reader(path)
    cfg = gguf.read_config(reader)
    tensors, shapes = {}, {}
    for t in reader.tensors:
        hf = gguf.hf_name(t.name)
        if hf is None:
            continue  # rope_freqs.weight: read into cfg.rope_scaling
        if t.kind not in ("F32", "F16", "BF16"):
            raise MinferError(f"{path}: tensor {t.name} is {t.kind}; the source must be F32, F16 or BF16")
        tensors[hf], shapes[hf] = t, tuple(t.shape)

    def read(hf: str) -> torch.Tensor:
        w = gguf.tensor_to_torch(tensors[hf])
        heads = gguf.permuted_heads(cfg, hf)
        return w if heads is None else gguf.unpermute_qk(w, heads)

    f = lambda k, d=None: gguf._field(reader, f"tokenizer.{k}", d)  # noqa: E731
    if f("ggml.model") != "gpt2":
        raise MinferError(f"{path}: tokenizer {f('ggml.model')!r}; supported: gpt2 (byte-level BPE)")
    tokens = list(f("ggml.tokens"))
    vocab = Vocab(tokens, list(f("ggml.token_type") or [1] * len(tokens)), list(f("ggml.merges") or []),
                  f("ggml.pre", "default"), f("ggml.bos_token_id"), f("ggml.eos_token_id"),
                  bool(f("ggml.add_bos_token", False)), f("chat_template"))
    name = gguf._field(reader, "general.name") or os.path.splitext(os.path.basename(path))[0]
    return Source(cfg, shapes, read, vocab, name, path, gguf_name)


def open_source(src: str | None, shape: str | None, device) -> Source:
    if (src is None) == (shape is None):
        raise MinferError("give either SRC or --shape NAME")
    if shape is not None:
        return shape_source(shape, device)
    if not os.path.exists(src):
        raise MinferError(f"{src}: no such file or folder")
    if os.path.isdir(src):
        return hf_source(src)
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise MinferError(f"{src}: not a GGUF file or an HF checkpoint folder")
    return gguf_source(src)


# ---------------------------------------------------------------------------------------- writing

def write_metadata(w, src: Source, file_type: int) -> None:
    import gguf

    cfg, v = src.cfg, src.vocab
    w.add_name(src.name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(len(v.tokens))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rotary_dim)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads or cfg.arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if (cfg.rope_scaling or {}).get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    w.add_token_merges(v.merges)  # present even when empty: readers derive merges from scores otherwise
    if v.bos is not None:
        w.add_bos_token_id(v.bos)
    if v.eos is not None:
        w.add_eos_token_id(v.eos)
    w.add_add_bos_token(v.add_bos)
    if v.chat_template:
        w.add_chat_template(v.chat_template)


def rope_factors(cfg: ModelConfig) -> list[float] | None:
    kind = (cfg.rope_scaling or {}).get("rope_type")
    if kind == "llama3":
        return llama3_rope_factors(cfg)
    if kind == "freq_factors":  # from a GGUF source
        return list(cfg.rope_scaling["factors"])
    return None


def quantize_model(src: Source, out: str, ftype: str, device="cpu", pure: bool = False, progress: bool = True) -> dict:
    """Writes OUT; returns {GGUF name: type}."""
    import gguf
    from tqdm import tqdm

    cfg = src.cfg
    arch = GGUF_ARCH.get(cfg.arch)
    if arch is None:
        raise MinferError(f"unsupported architecture {cfg.arch!r} for GGUF; supported: {', '.join(GGUF_ARCH)}")
    check_tensors(cfg, src.shapes, src.where, src.label, exact=True)  # it writes every tensor of src
    has_output = "lm_head.weight" in src.shapes
    plan = []  # (GGUF name, HF name, HF shape, type)
    for hf, shape in src.shapes.items():
        name = gguf_name(hf)
        plan.append((name, hf, shape, tensor_type(name, shape, ftype, cfg, has_output, pure)))
    factors = rope_factors(cfg)
    if factors is not None:
        plan.append(("rope_freqs.weight", None, (len(factors),), "F32"))

    w = gguf.GGUFWriter(None, arch)
    write_metadata(w, src, FTYPES[ftype][1])
    for name, _, shape, t in plan:
        if t in ("F32", "F16"):
            dtype = np.float32 if t == "F32" else np.float16
            w.add_tensor_info(name, shape, dtype, math.prod(shape) * np.dtype(dtype).itemsize)
        else:
            row = shape[1] // quant.BLOCK_ELEMS[t] * quant.BLOCK_BYTES[t]
            w.add_tensor_info(name, (shape[0], row), np.uint8, shape[0] * row, raw_dtype=gguf.GGMLQuantizationType[t])
    total = sum(math.prod(s) for _, _, s, _ in plan)
    bar = tqdm(total=total, unit="w", unit_scale=True, desc=f"quantizing to {ftype}", file=sys.stderr,
               disable=not progress or None)
    folder = os.path.dirname(os.path.abspath(out))
    part = None
    try:
        # A name of its own, so that two runs writing the same OUT never write into one file.
        fd, part = tempfile.mkstemp(dir=folder, prefix=os.path.basename(out) + ".", suffix=".part")
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(part, 0o666 & ~umask)  # the mode open() gives a new file, not mkstemp's 0600
        w.write_header_to_file(part)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with torch.inference_mode():
            for name, hf, shape, t in plan:
                bar.set_postfix_str(f"{name} {t}", refresh=False)
                x = torch.tensor(factors) if hf is None else src.read(hf)
                x = x.to(device=device, dtype=torch.float32)
                if not torch.isfinite(x).all():
                    raise MinferError(f"{src.where}: tensor {src.label(hf) if hf else name} holds NaN or Inf")
                if arch == "llama" and hf is not None and re.search(r"[qk]_proj\.(weight|bias)$", hf):
                    x = permute_qk(x, cfg.num_heads if "q_proj" in hf else cfg.num_kv_heads)
                if t in ("F32", "F16"):
                    w.write_tensor_data(x.to(torch.float32 if t == "F32" else torch.float16).cpu().numpy())
                    bar.update(x.numel())
                    continue
                rows = max(1, CHUNK // shape[1])
                parts = []
                for r in range(0, shape[0], rows):
                    parts.append(quant.quantize(t, x[r:r + rows]).cpu())
                    bar.update(parts[-1].shape[0] * shape[1])
                w.write_tensor_data(torch.cat(parts).numpy())
        w.close()
        os.replace(part, out)
    except OSError as e:
        if e.errno is None and shutil.disk_usage(folder).free == 0:  # numpy's short write (tofile) has no errno
            e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise file_error(out, e, "write") from None
    finally:
        bar.close()
        with contextlib.suppress(OSError):  # after a failed write, close's flush fails too; the file goes anyway
            w.close()
        if part is not None and os.path.exists(part):
            os.remove(part)
    return {name: t for name, _, _, t in plan}


# ---------------------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = ArgumentParser(prog="python -m minfer.quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("src", nargs="?", metavar="SRC", help="HF folder or F32/F16/BF16 GGUF (omit with --shape)")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--type", required=True, help=f"one of {', '.join(FTYPES)}")
    p.add_argument("--shape", help="a minfer.shapes name: random weights of that shape, placeholder tokenizer")
    p.add_argument("--device", default="cpu", help="where to quantize (cuda for large models)")
    p.add_argument("--pure", action="store_true", help="every 2-D tensor the type's base (no Q6_K mix)")
    p.add_argument("--force", action="store_true", help="overwrite OUT")
    return p.parse_args(argv)


def check_out(out: str, src: str | None, force: bool) -> None:
    """OUT can be written, and writing it loses nothing the user did not ask to lose."""
    if not out:
        raise MinferError("OUT is an empty path")
    if os.path.isdir(out):
        raise MinferError(f"{out}: is a folder; OUT is the .gguf file to write")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise MinferError(f"{out}: no folder {folder}")
    if src is not None and os.path.exists(out) and os.path.exists(src):
        # --force replaces OUT, never what it is made from: SRC itself or a file of SRC's folder
        real = os.path.realpath(src)
        if os.path.samefile(out, src) or os.path.realpath(out).startswith(os.path.join(real, "")):
            raise MinferError(f"{out}: is {'a file of ' if os.path.isdir(src) else ''}the source {src}; "
                              "write OUT elsewhere")
    if os.path.exists(out) and not force:
        raise MinferError(f"{out} exists; pass --force to overwrite it")


def run(args) -> dict:
    from .engine.loaded import parse_device

    if args.type not in FTYPES:
        raise MinferError(f"unknown --type {args.type!r}; choose from {', '.join(FTYPES)}")
    check_out(args.out, args.src, args.force)
    device = parse_device(args.device)
    src = open_source(args.src, args.shape, device)
    types = quantize_model(src, args.out, args.type, device, args.pure)
    counts = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    size = os.path.getsize(args.out)
    print(f"[minfer] wrote {args.out}: {size / 2**30:.2f} GiB, {len(types)} tensors ("
          + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())) + ")", file=sys.stderr)
    return types


def main(argv=None) -> int:
    return run_cli(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
