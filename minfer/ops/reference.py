"""The reference backend: every op in plain torch, computed in fp32 and cast back.

It runs on any device. It is the oracle for the kernel tests and the `--which ref` side of
apps/benchmark.py, so it favours clarity over speed. Shapes are documented once here; the cuda
backend implements exactly the same signatures.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import QuantizedWeight


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight, scale: float | None = None) -> torch.Tensor:
    # ids [...] int32/int64, weight [vocab, hidden] -> [..., hidden]; a quantized weight's rows are
    # dequantized to its dtype. scale: the rows are multiplied by it (Gemma's sqrt(hidden)), the scale
    # first rounded to the weight's dtype as transformers does (Gemma was trained so).
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
        raise IndexError(f"embedding: token id out of range [0, {weight.shape[0]})")
    if isinstance(weight, QuantizedWeight):
        rows = weight.rows(ids.reshape(-1)).view(*ids.shape, weight.shape[1])
    else:
        rows = weight[ids.long()]
    if scale is None:
        return rows
    return (rows.float() * torch.tensor(scale, dtype=rows.dtype).float()).to(rows.dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64: each row's largest (the first among equals; NaN the largest)."""
    return logits.argmax(-1)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), in two halves so that no product overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (Wellons' lowbias32): nearby inputs give unrelated outputs."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[batch, vocab] fp32 uniforms in (0, 1): a pure function of (seeds[b], positions[b], token id), the same
    whatever else is in the batch (a counter-based generator). seeds, positions [batch] int64, >= 0."""
    key = _mix32(_mix32(_mix32((seeds >> 32) & _M32) ^ (seeds & _M32)) ^ (positions & _M32))  # [batch]
    ids = _mix32(torch.arange(vocab, device=seeds.device, dtype=torch.int64))  # [vocab]
    return unit_interval(_mix32(ids[None, :] ^ key[:, None]))  # [batch, vocab]


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) -> fp32 in (0, 1), both ends excluded: their top 23 bits at the middles of 2^23
    equal steps. (With 24 bits the top step, 2^24 - 0.5, rounds to 2^24 in fp32: u = 1, an infinite Gumbel draw
    that beat every filter.)"""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The random draw: [rows] int64, each row's argmax of logits [rows, vocab] (any float dtype, taken in fp32) times
    1 / its temperature [rows] fp32 plus Gumbel noise -log(-log(u)), u = uniform_noise(seeds, positions, vocab): a draw
    from softmax(logits / temperature), keyed by (seed, position). A row of temperature 0 takes its argmax; None: 1."""
    x = logits.float()
    minus_g = torch.log(-torch.log(uniform_noise(seeds, positions, x.shape[1])))  # [rows, vocab]
    if temperature is None:
        return (x - minus_g).argmax(-1)
    t = temperature[:, None]
    return torch.where(t == 0, x, x * (1 / torch.where(t == 0, 1.0, t)) - minus_g).argmax(-1)


def filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf at every id outside each row's top-k, then min-p floor, then top-p nucleus (each on what the one before
    kept; sampling.filter_logits' rules row by row). logits [rows, vocab] fp32; top_k [rows] int64 (<= 0 or >= vocab:
    off), top_p [rows] fp32 (1: off), min_p [rows] fp32 (0: off)."""
    vocab = logits.shape[1]
    # on the CPU a filter no row uses is skipped (a sort of [rows, vocab] each, the step's largest ops); on a device
    # every filter runs, as asking would sync the host
    use_k = (top_k > 0) & (top_k < vocab)
    on_cpu = logits.device.type == "cpu"
    if not on_cpu or use_k.any():
        kth = logits.sort(dim=-1, descending=True).values.gather(1, torch.where(use_k, top_k, vocab)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))  # kth [rows, 1]
    if not on_cpu or (min_p > 0).any():
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < probs.max(-1, keepdim=True).values * min_p[:, None], float("-inf"))
    if on_cpu and not (top_p < 1).any():
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    # top_p = 1 is off, even where rounding brings the cumulated mass to 1 before the tail
    drop_sorted = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop_sorted[:, 0] = False  # the most likely token always stays (a top_p that is 0 in fp32 keeps it)
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))


def draw_filtered(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """gumbel_argmax over the ids each row's filters keep (filter_rows) of logits [rows, vocab] x (1 / temperature)
    ([rows] fp32); a row of temperature 0 takes its argmax."""
    t = temperature[:, None]
    x = filter_rows(logits.float() * (1 / torch.where(t == 0, 1.0, t)), top_k, top_p, min_p)
    return gumbel_argmax(x, seeds, positions, (temperature != 0).float())


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed masks [rows, words] int32, id 32 w + b as bit b of word w (words x 32 >= vocab) -> [rows, vocab] bool."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1  # [rows, words, 32]
    return bits.reshape(len(bitmask), -1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [rows, vocab] get -inf at the ids bitmask [rows, words] int32 leaves out (unpack_bitmask; the
    ids a row's structured output or allowed_token_ids do not allow)."""
    logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))


# records, x_records, records_for: the cuda backend's Q4_K x records (ops/cuda.py); none here.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, records: torch.Tensor | None = None) -> torch.Tensor:
    # x [tokens, hidden], weight [hidden] -> [tokens, hidden]
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       x_weight: torch.Tensor | None = None, records: torch.Tensor | None = None) -> None:
    # In place: residual <- residual + x (x first rms_norm'd by x_weight if given); x <- rms_norm(residual) * weight.
    summed = residual.float() + (x if x_weight is None else rms_norm(x, x_weight, eps)).float()
    residual.copy_(summed)
    # Normalise what was stored, so that low-precision results match a kernel that re-reads it.
    x.copy_(rms_norm(residual, weight, eps))


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool,
         q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
         v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
         slot_mapping: torch.Tensor | None = None) -> None:
    # In place on q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim].
    # positions [tokens]; cos_sin [max_position, rotary_dim] fp32 = cos | sin halves.
    # is_neox: rotate-half pairs (i, i + rot/2); else interleaved pairs (2i, 2i + 1).
    # q_weight, k_weight [head_dim]: each head rms_norm'd (rounded to the dtype) before the rotation.
    # v, k_cache, v_cache, slot_mapping: then paged_kv_cache_write(k_cache, v_cache, k, v, slot_mapping).
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rope: q_weight and k_weight come together")
    cache_args = (v, k_cache, v_cache, slot_mapping)
    if any(a is None for a in cache_args) != all(a is None for a in cache_args):
        raise ValueError("rope: v, k_cache, v_cache and slot_mapping come together (the paged cache write)")
    if q_weight is not None:
        for t, w in ((q, q_weight), (k, k_weight)):
            t.copy_(rms_norm(t.reshape(-1, t.shape[-1]), w, eps).view(t.shape))
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions.long()].float().chunk(2, dim=-1)  # [tokens, rot/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for t in (q, k):
        x = t[..., :rot].float()
        if is_neox:
            x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        t[..., :rot] = out.to(t.dtype)
    if k_cache is not None:
        paged_kv_cache_write(k_cache, v_cache, k, v, slot_mapping)


def silu_and_mul(x: torch.Tensor, records: torch.Tensor | None = None) -> torch.Tensor:
    # x [tokens, 2 * inter] = gate | up -> [tokens, inter]
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor, records: torch.Tensor | None = None) -> torch.Tensor:
    # x [tokens, 2 * inter] = gate | up -> [tokens, inter]: GeLU (tanh approximation) of gate, times up
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def records_for(like: torch.Tensor, weight) -> torch.Tensor | None:
    return None


def beside_stream(x: torch.Tensor):
    # A stream on which a linear on x may run beside the current stream's work (ops/cuda.py): none here.
    return None


def norms_in_linears(x: torch.Tensor, weights: list) -> bool:
    # Whether linear and linear_act_and_mul take norm and accumulate in the linear's launch (ops/cuda.py): no launches
    # here, so the model runs its norms as ops of their own.
    return False


def linear_act_and_mul(x: torch.Tensor, weight, act: str, x_records: torch.Tensor | None = None,
                       records: torch.Tensor | None = None,
                       norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    # x [tokens, in] @ weight^T = gate | up [tokens, 2 inter] -> act(gate) * up [tokens, inter]; act: silu | gelu_tanh.
    # norm (weight [in], eps): x is rms_norm'd first.
    gate_up = linear(x, weight, norm=norm)
    return silu_and_mul(gate_up) if act == "silu" else gelu_tanh_and_mul(gate_up)


def _rope_newest(q: torch.Tensor, k_new: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # A decode call's newest key rope (k_new, v_new, cos_sin): q [batch, heads, hd] and k_new [batch, kv_heads, hd]
    # rotated at positions [batch] (whole head, NeoX pairs), as copies: the inputs stay as they are.
    if cos_sin.shape[-1] != q.shape[-1]:
        raise ValueError(f"attention: cos_sin must be [max_position, head_dim = {q.shape[-1]}] (the whole head rotates), "
                         f"got {list(cos_sin.shape)}")
    q, k = q.clone(), k_new.clone()
    rope(q, k, positions, cos_sin, True)
    return q, k


def _check_rope_in(op: str, decode: bool, k_new, v_new, cos_sin) -> bool:
    given = sum(t is not None for t in (k_new, v_new, cos_sin))
    if given not in (0, 3):
        raise ValueError(f"{op}: k_new, v_new and cos_sin come together (the newest key's rope), got {given} of them")
    if given and not decode:
        raise ValueError(f"{op}: k_new, v_new and cos_sin are for decode calls (one query per sequence)")
    return given == 3


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: torch.Tensor,
              scale: float, stable_prefix: bool = False, window: int | None = None, k_new: torch.Tensor | None = None,
              v_new: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    # Causal attention of new queries over the cache.
    # q [batch, seq, heads, head_dim]; k_cache, v_cache [batch, capacity, kv_heads, head_dim];
    # start_pos [batch]: position of q[:, 0]. Query s of sequence b at position p = start_pos[b] + s sees
    # keys 0 .. p, or with a window only the last `window` of them (p - window < key <= p, HF's rule).
    # stable_prefix is a scheduling promise for the CUDA kernel (see ops/cuda.py); no effect here.
    # k_new, v_new [batch, kv_heads, head_dim], cos_sin [max_position, head_dim] (decode only, seq 1): the newest
    # key's rope in the call. q and k_new are rotated at start_pos (whole head, NeoX), k_new and v_new go to cache row
    # start_pos[b] where it is below the capacity, and the rotated q attends; q, k_new and v_new are not written.
    # -> [batch, seq, heads, head_dim]
    batch, seq, heads, _ = q.shape
    if _check_rope_in("attention", seq == 1, k_new, v_new, cos_sin):
        qr, kr = _rope_newest(q[:, 0], k_new, start_pos, cos_sin)
        pos = start_pos.long()
        b = torch.arange(batch, device=q.device)[(pos >= 0) & (pos < k_cache.shape[1])]  # rows within the capacity
        k_cache[b, pos[b]] = kr[b].to(k_cache.dtype)
        v_cache[b, pos[b]] = v_new[b].to(v_cache.dtype)
        q = qr[:, None]
    kv_len = int(start_pos.max()) + seq
    # With a window, keys before every query's window are never read: decode reads `window` keys.
    kv_start = 0 if window is None else max(0, int(start_pos.min()) - window + 1)
    k = k_cache[:, kv_start:kv_len].transpose(1, 2)  # [batch, kv_heads, keys, head_dim]
    v = v_cache[:, kv_start:kv_len].transpose(1, 2)
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q_pos = start_pos.long()[:, None] + torch.arange(seq, device=q.device)  # [batch, seq]
    key = torch.arange(kv_start, kv_len, device=q.device)[None, None, :]
    mask = key <= q_pos[:, :, None]  # [batch, seq, keys]
    if window is not None:
        mask &= key > q_pos[:, :, None] - window
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


def paged_kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    # k_cache, v_cache [num_pages, page_size, kv_heads, head_dim] (one layer's pool, contiguous);
    # k, v [tokens, kv_heads, head_dim]; slot_mapping [tokens] int: token t goes to page
    # slot_mapping[t] // page_size, row slot_mapping[t] % page_size.
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    scale: float, window: int | None = None, stable_prefix: bool = False,
                    out: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    # Causal attention of each sequence's new queries over its pages: prefill chunks at any start and
    # decode (one query) in one call. window: a query at position p sees only keys p - window < key <= p.
    # q [tokens, heads, head_dim]: sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]], the last
    # of its seq_lens[b] positions (their keys are already written); k_cache, v_cache [num_pages, page_size,
    # kv_heads, head_dim]; block_table [batch, max_pages] int32: page j of sequence b holds its positions
    # j * page_size ...; entries past a sequence's pages are ignored. max_seqlen_q / max_seqlen_k: host ints,
    # the largest query count and seq_len in the batch (sizes without a device sync). stable_prefix: the
    # cuda kernel's scheduling promise (ops/cuda.py), nothing here. out: a [tokens, heads, head_dim] tensor to
    # write the result into, returned. k_new, v_new [batch, kv_heads, head_dim], cos_sin [max_position, head_dim]
    # (decode only: one query per sequence): the newest key's rope in the call, as attention()'s, at position
    # seq_lens[b] - 1, written to its page where the table's entry lies in the pool.
    # -> [tokens, heads, head_dim]
    tokens, heads, hd = q.shape
    batch, page = block_table.shape[0], k_cache.shape[1]
    if _check_rope_in("paged_attention", max_seqlen_q == 1 and tokens == batch, k_new, v_new, cos_sin):
        pos = seq_lens.long() - 1  # [batch]
        q, kr = _rope_newest(q, k_new, pos, cos_sin)
        entry = block_table.long().gather(1, pos.clamp(min=0)[:, None] // page)[:, 0]  # [batch]
        ok = (pos >= 0) & (entry >= 0) & (entry < k_cache.shape[0])
        slots = (entry * page + pos % page)[ok]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = kr[ok].to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v_new[ok].to(v_cache.dtype)
    max_seqlen_k = min(max_seqlen_k, block_table.shape[1] * page)  # a bound (a graph's): the table caps it
    pages = -(-max_seqlen_k // page)
    # entries past a sequence's pages may hold anything: clamped into the pool (as the kernels do), then masked
    table = block_table[:, :pages].long().clamp(0, k_cache.shape[0] - 1)
    key = torch.arange(max_seqlen_k, device=q.device)
    valid = (key[None, :] < seq_lens.long()[:, None])[:, :, None, None]  # [batch, max_k, 1, 1]
    # Rows past a sequence's end hold whatever the page held (NaN too): zeroed, as a masked weight of 0
    # times NaN would still be NaN.
    k = k_cache[table].flatten(1, 2)[:, :max_seqlen_k].masked_fill(~valid, 0)  # [batch, max_k, kv_heads, head_dim]
    v = v_cache[table].flatten(1, 2)[:, :max_seqlen_k].masked_fill(~valid, 0)
    group = heads // k.shape[2]
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # [batch, heads, max_k, head_dim]
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    # Scatter the ragged queries into [batch, max_q] rows; padding rows are computed and dropped. Rows past
    # cu_seqlens_q[-1] (a graph's padding) belong to no sequence: a last, empty one, whose output is zeros.
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [batch]
    pad = tokens - cu_seqlens_q[-1:].long()  # [1]
    seq_of = torch.repeat_interleave(torch.arange(batch + 1, device=q.device), torch.cat([q_lens, pad]),
                                     output_size=tokens)  # [tokens]
    row = (torch.arange(tokens, device=q.device) - cu_seqlens_q.long()[seq_of]).clamp(max=max_seqlen_q - 1)
    qp = q.new_zeros(batch + 1, max_seqlen_q, heads, hd)
    qp[seq_of, row] = q
    q_pos = (seq_lens.long() - q_lens)[:, None] + torch.arange(max_seqlen_q, device=q.device)  # [batch, max_q]
    mask = (key[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :, 0, 0]  # [batch, max_q, max_k]
    if window is not None:
        mask &= key[None, None, :] > q_pos[:, :, None] - window
    o = F.scaled_dot_product_attention(qp[:batch].transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale)
    o = torch.cat([o.transpose(1, 2), torch.zeros_like(qp[batch:])])  # [batch + 1, max_q, heads, head_dim]
    o = o[seq_of, row]  # [tokens, heads, head_dim]
    return o if out is None else out.copy_(o)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
           static_weight: bool = False, out: torch.Tensor | None = None,
           x_records: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
           accumulate: bool = False) -> torch.Tensor:
    # x [tokens, in], weight [out, in] (HF layout), bias [out] -> [tokens, out], into `out` when given (a
    # [tokens, out] view, e.g. columns of a wider tensor). norm (weight [in], eps): x is rms_norm'd first;
    # accumulate: out += the product, rounded after it (the residual add).
    # In the input dtype: on a GPU this is cuBLAS with fp32 accumulation, the baseline to beat.
    # static_weight is a scheduling promise for the CUDA kernels (see ops/cuda.py); no effect here.
    # A quantized weight is dequantized to x's dtype first.
    if norm is not None:
        x = rms_norm(x, *norm)
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize(x.dtype)
    y = F.linear(x, weight, bias)
    if accumulate:
        if out is None:
            raise ValueError("linear: accumulate needs out")
        return out.add_(y)
    return y if out is None else out.copy_(y)
