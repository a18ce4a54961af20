"""Memory-bound kernels (csrc/rmsnorm.cu, rope.cu, activation.cu, embedding.cu) against
minfer.ops.reference: per-dtype tolerances, awkward sizes (hidden 111 and 8191 take the scalar path),
strided views, opcheck, and clear errors for bad input."""
import pytest
import torch

from minfer.ops import reference as ref
from poison import nan_freed

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
HIDDEN = [111, 576, 4096, 8191]
TOKENS = [1, 7, 64, 4099]
EPS = 1e-6


@pytest.fixture(scope="module")
def cuda():
    from minfer.ops import cuda as mod
    return mod


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def norm_weight(hidden, dtype):
    return (1.0 + 0.5 * torch.randn(hidden, device="cuda")).to(dtype)


def assert_close(actual, expected):
    assert not actual.isnan().any(), "kernel left NaN (unwritten or wrong) elements"
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


def assert_within_2x_torch(actual, lowp, ref32):
    # max |actual - ref32| <= 2x torch's own low-precision error (lowp: the reference run in actual's dtype)
    assert not actual.isnan().any(), "kernel left NaN (unwritten or wrong) elements"
    err, base = (actual.float() - ref32).abs().max().item(), (lowp.float() - ref32).abs().max().item()
    assert err <= 2 * base + 1e-6, f"max err {err:.3e} vs torch's {base:.3e}"


# ---- rms_norm ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(cuda, dtype, hidden, tokens):
    x, w = randn(tokens, hidden, dtype=dtype, scale=3.0), norm_weight(hidden, dtype)
    nan_freed((tokens, hidden), dtype)
    assert_close(cuda.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])  # 1 misaligns the rows: the scalar path
def test_rms_norm_strided_rows(cuda, dtype, offset):
    base = randn(33, 4096 + 24, dtype=dtype)
    x = base[:, offset:offset + 4096]  # row stride 4120
    w = norm_weight(4096, dtype)
    assert_close(cuda.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_per_head(cuda, dtype, head_dim):
    # Qwen3 q/k norm: [tokens * heads, head_dim]
    x, w = randn(13 * 16, head_dim, dtype=dtype), norm_weight(head_dim, dtype)
    assert_close(cuda.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))


def test_rms_norm_leading_dims(cuda):
    x, w = randn(3, 5, 576, dtype=torch.bfloat16), norm_weight(576, torch.bfloat16)
    out = cuda.rms_norm(x, w, EPS)
    assert out.shape == x.shape
    assert_close(out, ref.rms_norm(x, w, EPS))


# ---- fused_add_rms_norm ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm(cuda, dtype, hidden, tokens):
    x, res, w = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, scale=4.0), norm_weight(hidden, dtype)
    x_ref, res_ref = x.clone(), res.clone()
    ref.fused_add_rms_norm(x_ref, res_ref, w, EPS)
    cuda.fused_add_rms_norm(x, res, w, EPS)
    assert torch.equal(res, res_ref), "residual must be exactly residual + x rounded to the dtype"
    assert_close(x, x_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_strided(cuda, dtype):
    xb, rb = randn(9, 2048 + 8, dtype=dtype), randn(9, 2048 + 16, dtype=dtype)
    xb_ref, rb_ref = xb.clone(), rb.clone()
    w = norm_weight(2048, dtype)
    ref.fused_add_rms_norm(xb_ref[:, :2048], rb_ref[:, 8:2056], w, EPS)
    cuda.fused_add_rms_norm(xb[:, :2048], rb[:, 8:2056], w, EPS)
    assert torch.equal(rb, rb_ref)  # includes the columns outside the view: untouched
    torch.testing.assert_close(xb, xb_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN + [40000])  # 40000: rows longer than the registers hold
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_fused_add_rms_norm_x_weight(cuda, dtype, hidden, tokens):
    # Gemma's sandwich norm: x normalised by x_weight, then added, then the next norm, in one launch
    x, res = randn(tokens, hidden, dtype=dtype, scale=5.0), randn(tokens, hidden, dtype=dtype, scale=4.0)
    w, xw = norm_weight(hidden, dtype), norm_weight(hidden, dtype)
    x_ref, res_ref = x.clone(), res.clone()
    ref.fused_add_rms_norm(x_ref, res_ref, w, EPS, xw)
    cuda.fused_add_rms_norm(x, res, w, EPS, xw)
    # the normalised x is rounded as the reference rounds it, but its scale's sum runs in another order: one
    # ulp of x (|x| < 16 here) may move the residual's rounding by one ulp
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(res, res_ref, atol=16 * eps, rtol=2 * eps)
    assert_close(x, x_ref)


# ---- gated activations: silu_and_mul, gelu_tanh_and_mul ----

ACT_AND_MUL = ["silu_and_mul", "gelu_tanh_and_mul"]


@pytest.mark.parametrize("op", ACT_AND_MUL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_act_and_mul(cuda, op, dtype, inter, tokens):
    x = randn(tokens, 2 * inter, dtype=dtype, scale=3.0)
    nan_freed((tokens, inter), dtype)
    assert_close(getattr(cuda, op)(x), getattr(ref, op)(x))


@pytest.mark.parametrize("op", ACT_AND_MUL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_and_mul_strided(cuda, op, dtype):
    x = randn(17, 2 * 1024 + 40, dtype=dtype)[:, 8:8 + 2048]
    nan_freed((17, 1024), dtype)
    assert_close(getattr(cuda, op)(x), getattr(ref, op)(x))


# ---- rope ----

def rope_inputs(tokens, heads, kv_heads, head_dim, rot, dtype, fused, pos_dtype, max_pos=4096):
    if fused:  # views into one qkv tensor, as the model makes them: token stride (heads + 2 kv) * head_dim
        qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    else:
        qkv = None
        q, k = randn(tokens, heads, head_dim, dtype=dtype), randn(tokens, kv_heads, head_dim, dtype=dtype)
    positions = torch.randint(0, max_pos, (tokens,), device="cuda", dtype=pos_dtype)
    angles = torch.rand(max_pos, rot // 2, device="cuda") * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_pos, rot]
    return qkv, q, k, positions, cos_sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (128, 128), (128, 64), (64, 10)])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tokens,pos_dtype", [(1, torch.int64), (7, torch.int32), (300, torch.int64)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (32, 8)])  # 40 heads at 300 tokens: more items than threads
def test_rope(cuda, dtype, is_neox, head_dim, rot, fused, tokens, pos_dtype, heads, kv_heads):
    qkv, q, k, positions, cos_sin = rope_inputs(tokens, heads, kv_heads, head_dim, rot, dtype, fused, pos_dtype)
    q_ref, k_ref = q.clone(), k.clone()
    qkv_before = qkv.clone() if fused else None
    ref.rope(q_ref, k_ref, positions, cos_sin, is_neox)
    cuda.rope(q, k, positions, cos_sin, is_neox)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(q[..., rot:], q_ref[..., rot:]) and torch.equal(k[..., rot:], k_ref[..., rot:])
    if fused:  # v, the last kv_heads * head_dim columns, is not touched
        v_cols = slice((heads + kv_heads) * head_dim, None)
        assert torch.equal(qkv[:, v_cols], qkv_before[:, v_cols])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (128, 128), (256, 256), (128, 64), (72, 10)])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (32, 8)])  # 40 heads: warps loop over heads
@pytest.mark.parametrize("tokens", [1, 300])
def test_rope_qk_norm(cuda, dtype, is_neox, head_dim, rot, fused, heads, kv_heads, tokens):
    # Gemma 3 / Qwen3: each head RMS-normalised (q_weight, k_weight) before the rotation, in one launch
    qkv, q, k, positions, cos_sin = rope_inputs(tokens, heads, kv_heads, head_dim, rot, dtype, fused, torch.int64)
    q.mul_(7.0)
    qw, kw = norm_weight(head_dim, dtype), norm_weight(head_dim, dtype)
    q_ref, k_ref = q.clone(), k.clone()
    q32, k32 = q.to(torch.float32, copy=True), k.to(torch.float32, copy=True)
    qkv_before = qkv.clone() if fused else None
    ref.rope(q_ref, k_ref, positions, cos_sin, is_neox, qw, kw, EPS)
    ref.rope(q32, k32, positions, cos_sin, is_neox, qw.float(), kw.float(), EPS)
    cuda.rope(q, k, positions, cos_sin, is_neox, qw, kw, EPS)
    if dtype == torch.float32:
        assert_close(q, q_ref)
        assert_close(k, k_ref)
    else:
        # The normalised head is rounded to the dtype before the rotation: where ours and torch's fp32 scales round
        # one element of it to neighbouring values, a rotation that cancels leaves an ulp of the normalised value
        # (not of the output) between the two; so ours against the unrounded fp32 result, within 2x torch's error.
        assert_within_2x_torch(q, q_ref, q32)
        assert_within_2x_torch(k, k_ref, k32)
    if fused:
        v_cols = slice((heads + kv_heads) * head_dim, None)
        assert torch.equal(qkv[:, v_cols], qkv_before[:, v_cols])


@pytest.mark.parametrize("qk_norm", [False, True])  # each form reads cos | sin its own way
def test_rope_position_out_of_range_gives_nan(cuda, qk_norm):
    dtype = torch.float32 if qk_norm else torch.bfloat16  # fp32: the normed rows match the reference closely
    _, q, k, positions, cos_sin = rope_inputs(5, 4, 2, 64, 64, dtype, True, torch.int64, max_pos=128)
    positions[2] = 128
    weights = (norm_weight(64, dtype), norm_weight(64, dtype), EPS) if qk_norm else ()
    q0, k0 = q.clone(), k.clone()
    cuda.rope(q, k, positions, cos_sin, True, *weights)
    assert q[2].isnan().all() and k[2].isnan().all()  # never reads past the table; the error shows
    ok = torch.tensor([0, 1, 3, 4], device="cuda")
    q_ok, k_ok = q0[ok], k0[ok]  # copies
    ref.rope(q_ok, k_ok, positions[ok], cos_sin, True, *weights)
    assert_close(q[ok], q_ok)
    assert_close(k[ok], k_ok)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox,head_dim,rot", [(True, 64, 64), (True, 10, 10), (False, 6, 4), (True, 256, 256)])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_writes_paged_cache(cuda, dtype, is_neox, head_dim, rot, qk_norm, tokens):
    # The continuous engine's call: q, k, v views of one qkv row, k rotated and then, with v, written to
    # pool rows slot_mapping[t] of [num_pages, page_size, kv_heads, head_dim] caches in the same launch.
    # head_dim 10 and 6 take the scalar forms (rows not 16-byte multiples; (6, 4) GPT-J pairs of 2, copies of 1).
    heads, kv_heads, page, pages = 4, 2, 16, 8
    qkv, q, k, positions, cos_sin = rope_inputs(tokens, heads, kv_heads, head_dim, rot, dtype, True, torch.int64)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    weights = (norm_weight(head_dim, dtype), norm_weight(head_dim, dtype), EPS) if qk_norm else ()
    slots = torch.randperm(pages * page, device="cuda")[:tokens]
    if tokens > 2:
        slots[1], slots[2] = -1, pages * page  # outside the pool: skipped
    nan_pool = torch.full((pages, page, kv_heads, head_dim), float("nan"), device="cuda", dtype=dtype)
    k_cache, v_cache = nan_pool.clone(), nan_pool.clone()
    q_ref, k_ref = q.clone(), k.clone()
    ref.rope(q_ref, k_ref, positions, cos_sin, is_neox, *weights)
    cuda.rope(q, k, positions, cos_sin, is_neox, *(weights or (None, None, 0.0)), v, k_cache, v_cache, slots)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    # the pool rows hold the kernel's rotated k and v bit for bit; every other row keeps its NaN
    keep = (slots >= 0) & (slots < pages * page)
    want_k, want_v = nan_pool.clone(), nan_pool.clone()
    ref.paged_kv_cache_write(want_k, want_v, k[keep], v[keep], slots[keep])
    assert torch.equal(k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


# ---- embedding ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens,id_dtype", [(1, torch.int64), (7, torch.int32), (4099, torch.int64)])
def test_embedding(cuda, dtype, hidden, tokens, id_dtype):
    weight = randn(1000, hidden, dtype=dtype)
    ids = torch.randint(0, 1000, (tokens,), device="cuda", dtype=id_dtype)
    nan_freed((tokens, hidden), dtype)
    out = cuda.embedding(ids, weight)
    assert torch.equal(out, ref.embedding(ids, weight))


def test_embedding_out_of_range(cuda):
    weight = randn(100, 576, dtype=torch.bfloat16)
    ids = torch.tensor([3, 100, -1, 7], device="cuda")
    out = cuda.embedding(ids, weight)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[[0, 3]], weight[[3, 7]])


# ---- opcheck: schema, fake impl, dispatcher registration ----

def test_opcheck_all(cuda):
    ops = torch.ops.minfer
    dt = torch.bfloat16
    x, w = randn(7, 576, dtype=dt), norm_weight(576, dt)
    torch.library.opcheck(ops.rms_norm, (x, w, EPS))
    torch.library.opcheck(ops.fused_add_rms_norm, (x.clone(), randn(7, 576, dtype=dt), w, EPS))
    torch.library.opcheck(ops.fused_add_rms_norm, (x.clone(), randn(7, 576, dtype=dt), w, EPS, norm_weight(576, dt)))
    for op in ACT_AND_MUL:
        torch.library.opcheck(getattr(ops, op), (randn(7, 2 * 576, dtype=dt),))
    _, q, k, positions, cos_sin = rope_inputs(7, 4, 2, 64, 64, dt, False, torch.int64)
    torch.library.opcheck(ops.rope, (q, k, positions, cos_sin, True))
    torch.library.opcheck(ops.rope, (q, k, positions, cos_sin, True, norm_weight(64, dt), norm_weight(64, dt), EPS))
    pool, slots = randn(4, 16, 2, 64, dtype=dt), torch.tensor([3, 17, 40, 2, 63, 0, 9], device="cuda")
    torch.library.opcheck(ops.rope, (q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool, pool.clone(),
                                     slots))
    torch.library.opcheck(ops.embedding, (torch.randint(0, 100, (7,), device="cuda"), randn(100, 576, dtype=dt)))


# ---- bad input: RuntimeError with a message that names the rule ----

def test_bad_inputs(cuda):
    ops, dt = torch.ops.minfer, torch.bfloat16
    x, w = randn(4, 64, dtype=dt), norm_weight(64, dt)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.rms_norm(x.to(torch.int32), w, EPS)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        ops.rms_norm(x.cpu(), w.cpu(), EPS)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be a contiguous \[hidden\] = \[64\]"):
        ops.rms_norm(x, norm_weight(63, dt), EPS)
    with pytest.raises(RuntimeError, match="tensor of x's dtype and device, got .* Float"):
        ops.rms_norm(x, w.float(), EPS)
    for eps in (float("nan"), float("inf"), -1e-6):
        with pytest.raises(RuntimeError, match="rms_norm: eps must be finite and >= 0"):
            ops.rms_norm(x, w, eps)
        with pytest.raises(RuntimeError, match="fused_add_rms_norm: eps must be finite and >= 0"):
            ops.fused_add_rms_norm(x, x.clone(), w, eps)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        ops.rms_norm(randn(64, 4, dtype=dt).t(), w, EPS)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        ops.fused_add_rms_norm(x, randn(5, 64, dtype=dt), w, EPS)
    with pytest.raises(RuntimeError, match=r"x_weight must be a contiguous \[hidden\]"):
        ops.fused_add_rms_norm(x, x.clone(), w, EPS, norm_weight(63, dt))
    with pytest.raises(RuntimeError, match=r"x_weight must be a contiguous \[hidden\]"):
        ops.fused_add_rms_norm(x, x.clone(), w, EPS, norm_weight(64, torch.float32))
    for op in ACT_AND_MUL:
        with pytest.raises(RuntimeError, match=f"{op}: x's last dim must be even"):
            getattr(ops, op)(randn(4, 63, dtype=dt))
        with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
            getattr(ops, op)(randn(4, 64, dtype=dt).cpu())

    _, q, k, positions, cos_sin = rope_inputs(4, 4, 2, 64, 64, dt, False, torch.int64)
    with pytest.raises(RuntimeError, match="cos_sin must be float32"):
        ops.rope(q, k, positions, cos_sin.half(), True)
    with pytest.raises(RuntimeError, match="positions must be"):
        ops.rope(q, k, positions[:3], cos_sin, True)
    with pytest.raises(RuntimeError, match="contiguous head_dim"):
        ops.rope(q.transpose(1, 2), k, positions, cos_sin, True)
    with pytest.raises(RuntimeError, match="rotary_dim"):
        ops.rope(q, k, positions, torch.zeros(10, 130, device="cuda"), True)
    with pytest.raises(RuntimeError, match="positions must be int32 or int64"):
        ops.rope(q, k, positions.float(), cos_sin, True)
    with pytest.raises(RuntimeError, match="q must be a CUDA tensor"):
        ops.rope(q.cpu(), k.cpu(), positions.cpu(), cos_sin.cpu(), True)
    pool, slots = randn(4, 16, 2, 64, dtype=dt), torch.arange(4, device="cuda")
    with pytest.raises(RuntimeError, match="v, k_cache, v_cache and slot_mapping come together"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool, None, slots)
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool, pool.clone(), slots.int())
    with pytest.raises(RuntimeError, match=r"slot_mapping must be \[tokens\]"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool, pool.clone(), slots[:3])
    with pytest.raises(RuntimeError, match=r"k_cache must be \[num_pages, page_size, kv_heads, head_dim\]"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool[..., :32], pool[..., :32], slots)
    with pytest.raises(RuntimeError, match="v_cache must have k_cache's shape"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool, pool[:2], slots)
    with pytest.raises(RuntimeError, match="v must have k's shape"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k[:, :1].clone(), pool, pool.clone(), slots)
    with pytest.raises(RuntimeError, match="k_cache must be contiguous"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool.transpose(0, 1), pool.transpose(0, 1),
                 slots)
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.rope(q, k, positions, cos_sin, True, None, None, 0.0, k.clone(), pool.float(), pool.float(), slots)
    with pytest.raises(RuntimeError, match="q_weight and k_weight come together"):
        ops.rope(q, k, positions, cos_sin, True, norm_weight(64, dt), None, EPS)
    with pytest.raises(RuntimeError, match=r"k_weight must be a contiguous \[head_dim\]"):
        ops.rope(q, k, positions, cos_sin, True, norm_weight(64, dt), norm_weight(64, torch.float32), EPS)
    with pytest.raises(RuntimeError, match="rope: eps must be finite and >= 0"):
        ops.rope(q, k, positions, cos_sin, True, norm_weight(64, dt), norm_weight(64, dt), float("nan"))
    _, q63, k63, pos63, cos_sin62 = rope_inputs(4, 4, 2, 63, 62, dt, False, torch.int64)
    with pytest.raises(RuntimeError, match="q/k norms with GPT-J pairs need an even head_dim"):
        ops.rope(q63, k63, pos63, cos_sin62, False, norm_weight(63, dt), norm_weight(63, dt), EPS)

    with pytest.raises(RuntimeError, match="ids must be int32 or int64"):
        ops.embedding(torch.zeros(3, device="cuda"), randn(10, 64, dtype=dt))
