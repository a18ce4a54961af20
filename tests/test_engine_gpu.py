"""The whole engine on the cuda backend: every layer on our kernels, and the same greedy text as the
fp32 reference backend on the default model."""
import pytest
import torch

from minfer.engine import Engine
from minfer.ops import DENSE_OPS, PAGED_OPS
from minfer.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference_tokens():
    ref = Engine(dtype=torch.float32, device="cuda", backend="ref")
    out, _ = ref.generate([ref.encode(PROMPT, chat=False)], SamplingParams(temperature=0), 8)
    return out[0].token_ids


def test_static_engine_runs_on_our_kernels():
    eng = Engine(dtype=torch.float16, device="cuda", backend="cuda")
    assert [op for op in eng.ops.fallbacks if op not in PAGED_OPS] == [], f"ops still on ref: {eng.ops.fallbacks}"
    from minfer.ops import cuda
    assert all(getattr(eng.ops, op) is getattr(cuda, op) for op in DENSE_OPS)


@pytest.mark.xfail(strict=True, reason="no CUDA kernels for paged attention and paged KV writes yet: the "
                                       "continuous engine runs them on torch (the CLI takes the static engine)")
def test_cuda_backend_has_paged_kernels():
    eng = Engine(dtype=torch.float16, device="cuda", backend="cuda")
    assert not any(op in eng.ops.fallbacks for op in PAGED_OPS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_greedy_matches_reference(dtype, reference_tokens):
    eng = Engine(dtype=dtype, device="cuda", backend="cuda")
    out, stats = eng.generate([eng.encode(PROMPT, chat=False)], SamplingParams(temperature=0), 8)
    assert len(reference_tokens) == 8
    if dtype == torch.float16:  # the acceptance check: fp16 kernels reproduce fp32 greedy decoding
        assert out[0].token_ids == reference_tokens
    else:  # bf16 has 3 fewer mantissa bits; require the answer itself
        assert out[0].text.startswith(" Paris")
    assert stats.decode_tok_s > 0


def test_batched_generation_matches_single():
    eng = Engine(dtype=torch.float16, device="cuda", backend="cuda")
    prompts = [eng.encode(p, chat=False) for p in (PROMPT, "Water boils at a temperature of", "Hi")]
    batch, _ = eng.generate(prompts, SamplingParams(temperature=0), 12)
    for p, out in zip(prompts, batch):
        single, _ = eng.generate([p], SamplingParams(temperature=0), 12)
        # Different batch shapes take different GEMM paths; the first tokens must agree.
        assert single[0].token_ids[:4] == out.token_ids[:4]
