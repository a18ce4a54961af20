"""Zero tokens in, zero tokens out (as in torch): chunked prefill gives the token-wise ops empty inputs."""
import pytest
import torch

from minfer.ops import reference

HIDDEN, OUT = 64, 48


def check(ops, device, dtype):
    x = torch.empty(0, HIDDEN, device=device, dtype=dtype)
    w = torch.randn(HIDDEN, device=device, dtype=dtype)
    assert ops.rms_norm(x, w, 1e-5).shape == (0, HIDDEN)
    assert ops.linear(x, torch.randn(OUT, HIDDEN, device=device, dtype=dtype)).shape == (0, OUT)
    bias = torch.randn(OUT, device=device, dtype=dtype)
    assert ops.linear(x, torch.randn(OUT, HIDDEN, device=device, dtype=dtype), bias).shape == (0, OUT)
    ops.fused_add_rms_norm(x, x.clone(), w, 1e-5)  # in place on nothing
    for act in (ops.silu_and_mul, ops.gelu_tanh_and_mul):
        assert act(torch.empty(0, 2 * HIDDEN, device=device, dtype=dtype)).shape == (0, HIDDEN)


def test_reference_ops_take_zero_tokens():
    check(reference, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_ops_take_zero_tokens(dtype):
    from minfer.ops import cuda
    check(cuda, "cuda", dtype)
