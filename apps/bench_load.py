"""Load time: a model shape's random weights as a bf16 HF folder (sharded safetensors, as HF publishes them)
against the same weights quantized to a GGUF by minfer.quantize, each loaded by the engine's loader.

    python apps/bench_load.py --shape llama-3-8b --type Q4_K_M --dir /tmp/load    # files kept in --dir
    python apps/bench_load.py --shape smollm2-135m --type Q8_0 --device cpu        # a small run anywhere

The files are written once (reused when present). Each checkpoint is then loaded --reps times (the first load
also warms the page cache for the others: both files are read from memory, so the comparison is of the
loaders, not the disk); the median is reported with where its time went (LoadTimes: read into host memory,
upload, dequantize or cast) and the weights' bytes on the device. One JSON line per checkpoint with --json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the stdlib, whose `profile` apps/ shadows
from bench.cli import check_json, int_range  # noqa: E402
from bench.workload import append_json  # noqa: E402

from minfer import loader, quantize, shapes, tokenizer  # noqa: E402
from minfer.engine.loaded import parse_device  # noqa: E402
from minfer.errors import ArgumentParser, MinferError, run_cli  # noqa: E402
from minfer.quant import QuantizedWeight  # noqa: E402

SHARD_BYTES = 5 << 30  # HF's default max_shard_size


def hf_config(name: str, cfg, vocab) -> dict:
    """config.json for a Llama-family shape (the architecture the folder loader and quantize take)."""
    spec = shapes.SHAPES[name]
    if spec["arch"] != "llama":
        raise MinferError(f"--shape {name}: only Llama-family shapes are written as HF folders here")
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
          "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
          "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "bfloat16",
          "bos_token_id": vocab.bos, "eos_token_id": vocab.eos}
    if spec.get("rope_scaling"):
        hf["rope_scaling"] = spec["rope_scaling"]
    return hf


def write_hf_folder(name: str, folder: str, device) -> None:
    """The shape's random weights (quantize.shape_source: the weights `minfer.quantize --shape` writes) in bf16,
    in shards of at most SHARD_BYTES with their index, config.json and the placeholder tokenizer."""
    src = quantize.shape_source(name, device)
    part = folder + ".part"
    os.makedirs(part, exist_ok=True)
    with open(os.path.join(part, "config.json"), "w") as f:
        json.dump(hf_config(name, src.cfg, src.vocab), f, indent=1)
    fields = src.vocab.fields()
    tokenizer.from_gguf_fields(lambda key, default=None: fields.get(key, default)).tok.save(
        os.path.join(part, "tokenizer.json"))
    from safetensors.torch import save_file

    shards, shard, size = [], {}, 0
    for hf in src.shapes:
        w = src.read(hf).to(torch.bfloat16).cpu()
        if shard and size + w.nbytes > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[hf], size = w, size + w.nbytes
    shards.append(shard)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(part, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        print(f"[bench_load] wrote {file}", file=sys.stderr, flush=True)
    total = sum(w.nbytes for s in shards for w in s.values())
    with open(os.path.join(part, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    os.rename(part, folder)


def file_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return os.path.getsize(path)


def device_bytes(weights: dict) -> int:
    return sum(w.blocks.nbytes if isinstance(w, QuantizedWeight) else w.nbytes for w in weights.values())


def time_load(path: str, device, reps: int) -> dict:
    runs = []
    for _ in range(reps):
        times = loader.LoadTimes(device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        _, weights, _ = loader.load(path, torch.bfloat16, device, times)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        runs.append(dict(load_s=time.perf_counter() - t0, read_s=times.read, upload_s=times.upload,
                         dequantize_s=times.dequantize, device_gb=device_bytes(weights) / 1e9))
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    best = sorted(runs, key=lambda r: r["load_s"])[len(runs) // 2]  # the median run, with its phases
    return dict(best, loads_s=[round(r["load_s"], 3) for r in runs])


def run(args) -> int:
    device = parse_device(args.device)
    check_json(args.json)
    os.makedirs(args.dir, exist_ok=True)
    folder = os.path.join(args.dir, f"{args.shape}-bf16")
    gguf_path = os.path.join(args.dir, f"{args.shape}-{args.type}.gguf")
    if not os.path.isdir(folder):
        write_hf_folder(args.shape, folder, device)
    if not os.path.exists(gguf_path):
        quantize.run(argparse.Namespace(src=folder, out=gguf_path, type=args.type, shape=None, device=args.device,
                                        pure=False, force=False))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name} | {args.shape} | median of {args.reps} loads, files in the page cache")
    print(f"{'checkpoint':>28} {'file GB':>8} {'load s':>7} {'GB/s':>6} {'read s':>7} {'upload s':>8} "
          f"{'cast s':>7} {'device GB':>9}")
    rows = []
    for label, path in (("HF folder, bf16", folder), (f"GGUF, {args.type}", gguf_path)):
        row = time_load(path, device, args.reps)
        row.update(checkpoint=label, path=path, file_gb=file_bytes(path) / 1e9, shape=args.shape, device=name)
        rows.append(row)
        print(f"{label:>28} {row['file_gb']:8.2f} {row['load_s']:7.2f} {row['file_gb'] / row['load_s']:6.2f} "
              f"{row['read_s']:7.2f} {row['upload_s']:8.2f} {row['dequantize_s']:7.2f} {row['device_gb']:9.2f}",
              flush=True)
        append_json(args.json, row)
    ratio = rows[0]["load_s"] / rows[1]["load_s"]
    print(f"the GGUF loads in {1 / ratio:.2f}x the folder's time ({'faster' if ratio > 1 else 'not faster'})")
    return 0


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3-8b", choices=sorted(s for s, v in shapes.SHAPES.items()
                                                                   if v["arch"] == "llama"))
    p.add_argument("--type", default="Q4_K_M", choices=sorted(quantize.FTYPES))
    p.add_argument("--dir", default="/tmp/minfer-load", help="where the folder and the GGUF are written (kept)")
    p.add_argument("--device", default="cuda", help="where the weights load (and are made and quantized)")
    p.add_argument("--reps", type=int_range(1), default=3)
    p.add_argument("--json", help="append one JSON line per checkpoint to this file")
    args = p.parse_args(argv)
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
