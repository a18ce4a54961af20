"""Checkpoint -> (ModelConfig, weights {HF name: tensor}, Tokenizer).

CHECKPOINT is an HF folder (config.json + model.safetensors or a sharded index), an HF hub id
(through huggingface_hub; honours HF_HUB_OFFLINE and the local cache), or a .gguf file. With none,
the default model that setup.sh installs.
"""
from __future__ import annotations

import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import gguf, tokenizer
from .config import HF_FIELDS, ModelConfig, check_fields
from .errors import MinferError, check_readable, file_error, open_input, read_json
from .fetch import DEFAULT_MODEL_FILE, MODELS, cache_dir  # the models setup.sh installs, and their folder
from .quant import QuantizedWeight
from .shapes import check_tensors


@dataclass
class LoadTimes:
    """Seconds spent reading the checkpoint into host memory, uploading it to the device, and dequantizing
    (or casting, un-permuting) it there. Each phase ends with a device sync, so that none hides another."""
    read: float = 0.0
    upload: float = 0.0
    dequantize: float = 0.0
    device: torch.device = torch.device("cpu")

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        setattr(self, phase, getattr(self, phase) + time.perf_counter() - t0)


def default_checkpoint() -> str:
    path = os.path.join(cache_dir(), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise MinferError(f"default model not found at {path}; run `bash setup.sh` (or pass a CHECKPOINT)")
    return path


def _progress(items, desc):
    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr, leave=False, disable=None)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))
            and not name.endswith((".gguf", ".safetensors", ".json")))  # a file's name: a mistyped path


def _from_hub(repo: str, quant: str | None = None) -> str:
    """A hub repository's safetensors checkpoint (its folder), or with quant (llama.cpp's and vLLM's repo:Q4_K_M) the
    repository's GGUF file of that type: its first file where the model is split."""
    from huggingface_hub import snapshot_download
    if quant is None:
        patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
    else:
        if not re.fullmatch(r"[A-Za-z0-9_]+", quant):
            raise MinferError(f"{repo}:{quant}: a GGUF type is a name such as Q4_K_M")
        # the type ends the name, or a split's part count follows it: Q4_K fetches no Q4_K_M or IQ4_K
        patterns = [p for q in {quant.upper(), quant.lower()} for p in (f"*[-_.]{q}.gguf", f"*[-_.]{q}-0*-of-*.gguf")]
    try:
        folder = snapshot_download(repo, allow_patterns=patterns)
    except Exception as e:
        raise MinferError(f"{repo}: cannot get it from the hub or the local cache ({type(e).__name__})") from None
    if quant is None:
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise MinferError(f"{repo}: no config.json on the hub; a GGUF repository is named with its file's type, "
                              f"as in {repo}:Q4_K_M")
        return folder
    tag = re.compile(rf"[-_.]{re.escape(quant)}(-\d{{5}}-of-\d{{5}})?\.gguf$", re.I)
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
                   if f.endswith(".gguf") and tag.search(f))
    models = [f for f in files if not (m := gguf.SPLIT_NAME.fullmatch(os.path.basename(f))) or int(m[2]) == 1]
    if len(models) != 1:
        raise MinferError(f"{repo}: {'no' if not models else 'more than one'} GGUF file of type {quant} "
                          f"({', '.join(models) or 'none found on the hub or in the local cache'})")
    return os.path.join(folder, models[0])


def resolve(checkpoint: str | None) -> str:
    """A local path for CHECKPOINT (a path, a hub id, downloaded into the HF cache, a hub id with a GGUF type,
    repo:Q4_K_M, or the name of a model minfer.fetch installs, such as gemma3-270m)."""
    if checkpoint is None:
        return default_checkpoint()
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise MinferError(f"the checkpoint is a path or a hub id, not {type(checkpoint).__name__}")
    checkpoint = os.fspath(checkpoint)
    if not checkpoint:
        raise MinferError("the checkpoint is an empty name (omit it for the default model)")
    path = os.path.expanduser(checkpoint)
    try:
        os.stat(path)
        return path
    except FileNotFoundError:
        pass
    except OSError as e:  # e.g. a folder on the way that we may not search
        raise file_error(path, e) from None
    repo, _, quant = checkpoint.partition(":")
    if _looks_like_hub_id(repo):
        return _from_hub(repo, quant or None)
    if checkpoint in MODELS:  # a model minfer.fetch installs, by its name
        path = os.path.join(cache_dir(), MODELS[checkpoint].file)
        if not os.path.exists(path):
            raise MinferError(f"{checkpoint} is not installed; `python -m minfer.fetch {checkpoint}` installs it")
        return path
    raise MinferError(f"{checkpoint}: no such file or folder")


def load(checkpoint: str | None, dtype: torch.dtype, device, times: LoadTimes | None = None,
         dequantize: bool = False) -> tuple[ModelConfig, dict, tokenizer.Tokenizer]:
    """times, when given, accumulates where the load time went. GGUF matrices in a format with kernels
    stay quantized (quant.QuantizedWeight) unless `dequantize`."""
    device = torch.device(device)
    times = times or LoadTimes()
    times.device = device
    path = resolve(checkpoint)
    if os.path.isdir(path):
        return _load_hf_folder(path, dtype, device, times)
    with open_input(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path, dtype, device, times, dequantize)
    raise MinferError(f"{path}: not a GGUF file or an HF checkpoint folder")


def _load_gguf(path, dtype, device, times, dequantize):
    reader = gguf.open_reader(path)
    cfg = gguf.read_config(reader)
    tok = tokenizer.from_gguf(reader)
    _check_vocabulary(cfg, tok, path)
    tensors = {name: t for t in reader.tensors if (name := gguf.hf_name(t.name, cfg.arch))}  # by HF name
    check_tensors(cfg, {name: t.shape for name, t in tensors.items()}, path, lambda name: tensors[name].name)
    weights = gguf.read_weights(reader, cfg, dtype, device, lambda xs: _progress(xs, "loading"), times,
                                keep_quantized=not dequantize)
    _check_finite(weights, path)
    return cfg, weights, tok


def read_hf_config(folder: str) -> ModelConfig:
    """config.json, with generation_config.json's EOS ids; quantized safetensors refused (their scales are tensors
    minfer does not read: every matrix would be off by them)."""
    hf_cfg = read_json(os.path.join(folder, "config.json"), missing_ok=True)
    if hf_cfg is None:
        raise MinferError(f"{folder}: no config.json (not an HF checkpoint folder)")
    cfg = ModelConfig.from_hf(hf_cfg)
    if quantization := hf_cfg.get("quantization_config"):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise MinferError(f"{folder}: quantized safetensors ({method or 'quantization_config'}) are not supported; "
                          f"use the unquantized checkpoint or a GGUF file")
    gen_path = os.path.join(folder, "generation_config.json")
    gen = read_json(gen_path, missing_ok=True) or {}
    check_fields(gen, {"eos_token_id": HF_FIELDS["eos_token_id"]}, f"{gen_path}: ")
    eos = gen.get("eos_token_id")
    if eos is not None:
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(eos if isinstance(eos, list) else [eos]))
    return cfg


def shard_paths(folder: str) -> list[str]:
    """The safetensors files of an HF folder: its index's shards, or model.safetensors."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = read_json(index_path, missing_ok=True)
    if index is not None:
        if not isinstance(index.get("weight_map"), dict):
            raise MinferError(f"{index_path}: no weight_map")
        return [os.path.join(folder, shard) for shard in sorted(set(index["weight_map"].values()))]
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return [os.path.join(folder, "model.safetensors")]
    raise MinferError(f"{folder}: no model.safetensors or model.safetensors.index.json")


@contextmanager
def reading(path: str):
    """A truncated or corrupt safetensors file read inside is a MinferError naming it."""
    try:
        yield
    except MinferError:
        raise
    except Exception as e:
        raise MinferError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None


def open_shard(path: str):
    """(the open safetensors file, its tensors' shapes by name), its weights all float: an integer or fp8 weight
    would be cast without the scales that give it its values."""
    from safetensors import safe_open
    check_readable(path)
    with reading(path):
        f = safe_open(path, framework="pt", device="cpu")
        shapes = {}
        for name in f.keys():
            tensor = f.get_slice(name)
            if tensor.get_dtype() not in ("F16", "BF16", "F32", "F64") and name.endswith(("weight", "bias")):
                raise MinferError(f"{path}: {name} is {tensor.get_dtype()}; minfer reads float16, bfloat16 and "
                                  f"float32 weights")
            shapes[name] = tuple(tensor.get_shape())
    return f, shapes


def _load_hf_folder(folder, dtype, device, times):
    cfg = read_hf_config(folder)
    paths = shard_paths(folder)
    tok = tokenizer.from_hf_folder(folder, cfg.eos_token_ids, cfg.bos_token_id)
    _check_vocabulary(cfg, tok, folder)
    shards = [open_shard(path) for path in paths]  # the tables first: nothing is read from a wrong checkpoint
    check_tensors(cfg, {name: shape for _, shapes in shards for name, shape in shapes.items()}, folder)
    # HF's Gemma checkpoints store w of RMSNorm's x * (1 + w); the ops (and GGUF files) take 1 + w itself.
    norm_offset = 1.0 if cfg.arch == "gemma3" else 0.0
    weights = {}
    for path, (f, shapes) in zip(paths, shards):
        with reading(path):
            for name in _progress(list(shapes), f"loading {os.path.basename(path)}"):
                with times("read"):
                    w = f.get_tensor(name)
                with times("upload"):
                    w = w.to(device)
                with times("dequantize"):
                    if norm_offset and name.endswith("norm.weight"):
                        w = w.float() + norm_offset
                    weights[name] = w.to(dtype)
    _check_finite(weights, folder)
    return cfg, weights, tok


def _check_vocabulary(cfg: ModelConfig, tok, where: str) -> None:
    """Every id the tokenizer gives or stops on is a row of the embedding: a larger tokenizer would index past it."""
    if tok.vocab_size > cfg.vocab_size:
        raise MinferError(f"{where}: the tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size "
                          f"{cfg.vocab_size}")
    ids = [i for i in (tok.bos_token_id, *tok.stop_ids) if i is not None]
    if ids and max(ids) >= cfg.vocab_size:
        raise MinferError(f"{where}: BOS/EOS token id {max(ids)} is past the model's vocab_size {cfg.vocab_size}")


def _check_finite(weights: dict, where: str) -> None:
    """No NaN or infinity in a weight (in a quantized one, its blocks' scales): it would make every logit NaN and
    the output empty. One device sync for them all."""
    names = list(weights)
    finite = torch.stack([w.finite() if isinstance(w, QuantizedWeight)
                          else torch.isfinite(w.amax()) & torch.isfinite(w.amin()) for w in weights.values()])
    if not bool(finite.all()):
        raise MinferError(f"{where}: tensor {names[int(finite.logical_not().nonzero()[0])]} holds NaN or Inf")
