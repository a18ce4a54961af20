"""The default model (SmolLM2-135M, Q4_1) on the quantized-weight kernels: the same greedy text as the fp32
reference, and the perplexity of the --dequantize path."""
import math
import os

import pytest
import torch

from minfer import loader
from minfer.engine import Engine
from minfer.quant import QuantizedWeight
from minfer.sampling import SamplingParams

MODEL_PATH = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")]

PROMPT = "The capital of France is"
TEXT = os.environ.get("MINFER_TINYSHAKESPEARE",
                      os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "tinyshakespeare.txt"))


def greedy(engine: Engine, n: int) -> list[int]:
    out, _ = engine.generate([engine.encode(PROMPT, chat=False)], SamplingParams(temperature=0), n)
    return out[0].token_ids


def test_weights_stay_quantized_on_the_cuda_backend():
    eng = Engine(dtype=torch.float16, device="cuda", backend="cuda")
    assert isinstance(eng.model.layers[0]["down"], QuantizedWeight) and isinstance(eng.model.embed, QuantizedWeight)
    assert not isinstance(Engine(dtype=torch.float16, device="cuda", backend="cuda", dequantize=True).model.embed,
                          QuantizedWeight)


def test_no_dequantization_on_the_host(monkeypatch):
    """A cuda load uploads the blocks as they are: the quantized matrices are never decoded, and what is decoded
    (--dequantize) is decoded on the GPU."""
    from minfer import gguf, quant
    devices = []
    real = quant.dequantize
    monkeypatch.setattr(quant, "dequantize", lambda kind, raw, n: devices.append(raw.device.type) or real(kind, raw, n))
    loader.load(MODEL_PATH, torch.float16, "cuda")
    assert devices == []
    loader.load(MODEL_PATH, torch.float16, "cuda", dequantize=True)
    assert devices and set(devices) == {"cuda"}
    assert gguf.quant is quant  # the loader's decoder is the one watched


def test_greedy_on_quantized_kernels_matches_fp32_reference():
    ref = greedy(Engine(dtype=torch.float32, device="cuda", backend="ref"), 8)
    ours = greedy(Engine(dtype=torch.float16, device="cuda", backend="cuda"), 8)
    assert len(ref) == 8 and ours == ref


@torch.inference_mode()
def perplexity(engine: Engine, ids: list[int], step: int, windows: int = 16, length: int = 512) -> float:
    """exp(mean next-token loss) over `windows` windows of `length` tokens, each fed `step` tokens a
    forward (step <= 16: the decode kernels, qlinear; step = length: the prefill path)."""
    cache = engine._cache_rows(1, length)
    total, count = torch.zeros((), device=engine.device), 0
    for w in range(windows):
        chunk = torch.tensor(ids[w * length:(w + 1) * length], device=engine.device)[None]  # [1, length]
        logits = torch.cat([engine.model.forward(chunk[:, p:p + step], torch.tensor([p], dtype=torch.int32,
                                                 device=engine.device), cache)[0] for p in range(0, length, step)])
        total += torch.nn.functional.cross_entropy(logits[:-1].float(), chunk[0, 1:], reduction="sum")
        count += length - 1
    return math.exp(total.item() / count)


def test_perplexity_within_0_2_percent_of_dequantized():
    """The quantized weights through qlinear (16 tokens a forward, as a batch-16 decode step reads them)
    against --dequantize's bf16 weights through the prefill path."""
    if not os.path.exists(TEXT):
        pytest.skip(f"no {TEXT} (set MINFER_TINYSHAKESPEARE)")
    quantized = Engine(dtype=torch.bfloat16, device="cuda", backend="cuda")
    dense = Engine(dtype=torch.bfloat16, device="cuda", backend="cuda", dequantize=True)
    with open(TEXT, encoding="utf-8") as f:
        ids = quantized.tokenizer.encode(f.read()[:200_000])
    assert len(ids) >= 16 * 512
    ppl_q, ppl_d = perplexity(quantized, ids, step=16), perplexity(dense, ids, step=512)
    print(f"perplexity, tinyshakespeare, 16 x 512 tokens: quantized (qlinear) {ppl_q:.4f}, --dequantize {ppl_d:.4f}, "
          f"ratio {ppl_q / ppl_d:.5f}")
    assert 1 < ppl_d < 100  # a working model on English text
    assert abs(ppl_q / ppl_d - 1) <= 0.002, (ppl_q, ppl_d)
