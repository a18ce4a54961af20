"""The cuda backend: thin Python wrappers over torch.ops.minfer.*, plus their fake (meta)
implementations so that the ops work under torch.compile, opcheck and CUDA graph capture.

An op appears here only when its kernel exists; ops/__init__.py falls back to ref for the rest. The
baseline kernels' API (gemm, naive/tiled/flash_attention, ...) is in ops/baselines.py.
"""
from __future__ import annotations

import functools

import torch

import minfer._C  # noqa: F401  registers torch.ops.minfer

from . import quantized, reference
from ..quant import LAYER_VALUES, QuantizedWeight

_ops = torch.ops.minfer


# ---- fake implementations: shapes and dtypes only ----

@torch.library.register_fake("minfer::embedding")
def _embedding_fake(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.register_fake("minfer::argmax")
def _argmax_fake(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@torch.library.register_fake("minfer::gumbel_argmax")
def _gumbel_argmax_fake(logits, seeds, positions, temperature=None):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@torch.library.register_fake("minfer::draw_filtered")
def _draw_filtered_fake(logits, seeds, positions, temperature, top_k, top_p, min_p):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@torch.library.register_fake("minfer::apply_token_bitmask")
def _apply_token_bitmask_fake(logits, bitmask):
    return None


# memory-bound kernels (csrc/rmsnorm.cu, rope.cu, activation.cu)
@torch.library.register_fake("minfer::rms_norm")
def _rms_norm_fake(x, weight, eps, records=None):
    return x.new_empty(x.shape)  # contiguous [tokens, hidden]


@torch.library.register_fake("minfer::fused_add_rms_norm")
def _fused_add_rms_norm_fake(x, residual, weight, eps, x_weight=None, records=None):
    return None


@torch.library.register_fake("minfer::rope")
def _rope_fake(q, k, positions, cos_sin, is_neox, q_weight=None, k_weight=None, eps=0.0, v=None, k_cache=None,
               v_cache=None, slot_mapping=None):
    return None


@torch.library.register_fake("minfer::silu_and_mul")
def _silu_and_mul_fake(x, records=None):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.register_fake("minfer::gelu_tanh_and_mul")
def _gelu_tanh_and_mul_fake(x, records=None):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


# ---- the ops the model calls ----

def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight, scale: float | None = None) -> torch.Tensor:
    # Rows of out-of-range ids come back as NaN (the kernel never reads outside the table).
    # scale (Gemma's sqrt(hidden)) is applied in torch after the gather until the kernel takes it.
    if isinstance(weight, QuantizedWeight):  # the kernels write fp16/bf16
        if weight.dtype == torch.float32:
            return reference.embedding(ids, weight, scale)
        out = quantized.embedding(ids, weight, weight.dtype)
    else:
        out = _ops.embedding(ids.contiguous(), weight)
    if scale is not None:
        out.mul_(torch.tensor(scale, dtype=out.dtype).item())  # the scale rounded to the dtype, as reference
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    # logits [rows, vocab] (fp32, fp16 or bf16; rows may be strided) -> [rows] int64, as torch.argmax(-1)
    return _ops.argmax(logits if logits.stride(-1) == 1 else logits.contiguous())


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    # logits [rows, vocab] (fp32, fp16 or bf16) -> [rows] int64: argmax of logits x (1 / temperature) + Gumbel noise of
    # (seeds[r], positions[r], id), [rows] int64; temperature [rows] fp32 (0: the row's argmax), None: 1
    return _ops.gumbel_argmax(logits if logits.stride(-1) == 1 else logits.contiguous(), seeds, positions, temperature)


def draw_filtered(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # logits [rows, vocab] -> [rows] int64: gumbel_argmax over the ids each row's top_k [rows] int64, top_p and min_p
    # [rows] fp32 keep of logits x (1 / temperature) ([rows] fp32; 0: the row's argmax)
    return _ops.draw_filtered(logits if logits.stride(-1) == 1 else logits.contiguous(), seeds, positions,
                              temperature, top_k, top_p, min_p)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    # in place on logits [rows, vocab] (rows contiguous): -inf where bitmask [rows, words] int32 leaves the id out
    _ops.apply_token_bitmask(logits, bitmask)


# memory-bound kernels
# records (from records_for): the output is also written as the Q4_K linears' x records, which the linear after
# takes as x_records instead of converting x in a launch of its own.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, records: torch.Tensor | None = None) -> torch.Tensor:
    # x [tokens, hidden] (rows may be strided; other leading dims are flattened), weight [hidden]
    if x.dim() == 2:
        return _ops.rms_norm(x, weight, eps, records)
    out = _ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, records)
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       x_weight: torch.Tensor | None = None, records: torch.Tensor | None = None) -> None:
    # In place: residual <- residual + x (x first rms_norm'd by x_weight if given); x <- rms_norm(residual) * weight.
    # x, residual [tokens, hidden].
    _ops.fused_add_rms_norm(x, residual, weight, eps, x_weight, records)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool,
         q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
         v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
         slot_mapping: torch.Tensor | None = None) -> None:
    # In place on q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (any token stride);
    # positions [tokens] int32/int64; cos_sin [max_position, rotary_dim] fp32 = cos | sin. q_weight, k_weight
    # [head_dim]: each head rms_norm'd (eps) before the rotation. v, k_cache, v_cache, slot_mapping: then
    # paged_kv_cache_write of k and v, in the same launch (int64 slots; a slot outside the pool is skipped).
    if slot_mapping is not None:
        slot_mapping = slot_mapping.contiguous()
    _ops.rope(q, k, positions.contiguous(), cos_sin.contiguous(), is_neox, q_weight, k_weight, eps, v, k_cache, v_cache,
              slot_mapping)


def silu_and_mul(x: torch.Tensor, records: torch.Tensor | None = None) -> torch.Tensor:
    # x [tokens, 2 * inter] = gate | up -> [tokens, inter]
    return _ops.silu_and_mul(x, records)


def gelu_tanh_and_mul(x: torch.Tensor, records: torch.Tensor | None = None) -> torch.Tensor:
    # x [tokens, 2 * inter] = gate | up -> [tokens, inter]: GeLU (tanh approximation) of gate, times up
    return _ops.gelu_tanh_and_mul(x, records)


_beside: dict[torch.device, torch.cuda.Stream] = {}


def beside_stream(x: torch.Tensor) -> torch.cuda.Stream | None:
    """A second stream of x's device, on which a linear on x may run beside the current stream's work (fuse()'s
    smaller parts beside its largest: Q4_K_M's v in Q6_K beside q | k), at decode rows; None at more rows, whose
    quantized linears share one dequantize scratch (_scratch_view). Made at its first use (an engine's warm-up)."""
    if x.shape[0] > quantized.QLINEAR_MAX_ROWS:
        return None
    stream = _beside.get(x.device)
    if stream is None:
        stream = _beside[x.device] = torch.cuda.Stream(x.device)
    return stream


def norms_in_linears(x: torch.Tensor, weights: list) -> bool:
    """Whether linear and linear_act_and_mul take norm and accumulate in the linear's own launch for each of these
    weights at x's rows (x [rows, hidden] as the model's stream): a small model's 4- and 5-bit legacy formats up to
    8 rows (regs_kernel, quantized.takes_norm), two launches a layer fewer."""
    rows = x.shape[0]
    return (x.dtype in (torch.float16, torch.bfloat16) and 1 <= rows <= quantized.QLINEAR_MAX_ROWS
            and all(isinstance(w, QuantizedWeight) and quantized.takes_norm(rows, w, x.device) for w in weights))


def linear_act_and_mul(x: torch.Tensor, weight, act: str, x_records: torch.Tensor | None = None,
                       records: torch.Tensor | None = None,
                       norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    # x [tokens, in] @ weight^T = gate | up [tokens, 2 inter] -> act(gate) * up [tokens, inter]; act: silu | gelu_tanh.
    # x_records: x's records (the Q4_K kernels'); records: room for the output's (the down projection's x).
    # A quantized gate | up at decode rows with neither runs qlinear_act, whose kernel for a small model's 4- and
    # 5-bit legacy formats writes the activation from the linear's epilogue: one launch a layer fewer.
    # A Q4_K gate | up up to 16 rows on x's records runs it too: its kernels' tiles hold 8 gate rows beside their up
    # rows and write the activation (the 8B Q4_K_M step: -3% at batch 16), then down's records in a launch of their own.
    # A dense gate | up (or a layer group's, decoded) runs linear_act, whose gemv kernels apply the activation in
    # their epilogue up to 8 rows, past 16 on small W (a small model's batched decode) and, on an H100, at 9-16 on a
    # wide model's many-tiles ring, and whose sm90 small-M kernel at 32-64 rows (a large model's).
    # norm (weight [in], eps): x is read as rms_norm(x, weight, eps), in qlinear_act's launch where norms_in_linears.
    if (isinstance(weight, QuantizedWeight) and x_records is None and records is None and x.dtype != torch.float32
            and quantized.takes_rows(x.shape[0], weight)):
        return quantized.linear_act(x, weight, act, norm=norm)
    if norm is not None:
        x = rms_norm(x, *norm)
    if (isinstance(weight, QuantizedWeight) and weight.kind == "Q4_K" and x.shape[0] <= 16
            and x_records is not None):
        return quantized.linear_act(x, weight, act, x_records=x_records, records=records)
    if records is None and x.dtype != torch.float32:
        x = x if x.stride(-1) == 1 else x.contiguous()
        if isinstance(weight, torch.Tensor):
            return _ops.linear_act(x, weight, act, True)
        if weight.layer is not None and x.shape[0] > quantized.QLINEAR_MAX_ROWS:
            return _ops.linear_act(x, _layer_matrix(x, weight), act, weight.layer_offset > 0)
    gate_up = linear(x, weight, static_weight=True, x_records=x_records)  # [tokens, 2 inter]
    return silu_and_mul(gate_up, records) if act == "silu" else gelu_tanh_and_mul(gate_up, records)


@functools.cache
def _reads_records(kind: str, rows: int, k: int, device: torch.device) -> bool:
    """Whether qlinear on rows x k of x reads x's records, by the kernels' own rule (qlinear_reads_records)."""
    x = torch.empty((rows, k), dtype=torch.bfloat16, device=device)
    return _ops.qlinear_reads_records(x, quantized.QTYPE[kind])


def records_for(like: torch.Tensor, weight) -> torch.Tensor | None:
    """Room for x's records ahead of a linear on weight (a list: fuse()'s parts) whose x, [rows, in] like `like`,
    the kernel before it writes (rms_norm, fused_add_rms_norm, the activations): uint8 [rows, in / 256 * record bytes]
    where the linear's kernel reads them (csrc/qgemm/qlinear.h, reads_records) and the writer can (fp16/bf16, at
    most Q4K_RECORD_ROWS rows, in within the norms' [768, 32768]), else None."""
    parts = weight if isinstance(weight, list) else [weight]
    rows, k = like.shape[0], parts[0].shape[1]
    if not (1 <= rows <= quantized.Q4K_RECORD_ROWS and like.dtype in (torch.float16, torch.bfloat16)
            and 768 <= k <= 32768):
        return None
    if not any(isinstance(w, QuantizedWeight) and w.kind in quantized.QTYPE and
               _reads_records(w.kind, rows, k, like.device) for w in parts):
        return None
    return torch.empty((rows, k // 256 * quantized.Q4K_RECORD_BYTES), dtype=torch.uint8, device=like.device)


# ---- gemm family (csrc/gemm/) ----
# Extra trailing argument on linear's op (not on the wrapper): path = auto | wmma | sm80 | sm90 | gemv | simt.

@torch.library.register_fake("minfer::linear")
def _linear_fake(x, w, bias=None, path="auto", static_weight=False):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.register_fake("minfer::linear_act")
def _linear_act_fake(x, w, act, static_weight=False):
    return x.new_empty((x.shape[0], w.shape[0] // 2))


# A quantized weight's prefill (more rows of x than qlinear takes) dequantizes it into a scratch buffer, up to this
# many values at a time (256 MB in bf16; an 8B model's widest layer matrix, gate|up, is 117M): wider
# weights (a 128k-vocabulary lm_head) run in slices of rows.
SCRATCH_VALUES = LAYER_VALUES  # 1 << 27: a layer group (quant.group_layer) fits
_scratch: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> the buffer; (device, dtype, n, k) -> its [n, k] view


def _scratch_view(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The scratch buffer of x's device and dtype as a contiguous [n, k] (n * k <= SCRATCH_VALUES), made once:
    an eager prefill step runs ~4 quantized linears a layer, and their host glue is its launch time."""
    view = _scratch.get((x.device, x.dtype, n, k))
    if view is None:
        key = (x.device, x.dtype)
        if key not in _scratch:
            _scratch[key] = torch.empty(SCRATCH_VALUES, device=x.device, dtype=x.dtype)
        view = _scratch[x.device, x.dtype, n, k] = _scratch[key][:n * k].view(n, k)
    return view


def _layer_matrix(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """A layer group's matrix (quant.group_layer), [n, k] dense in the scratch: the group's first linear decodes
    all its matrices. The others' values were written before the kernels just ahead of them (the first's GEMM
    waited for that launch, and released the next only after): they load early, as a model's weights do
    (static_weight = w.layer_offset > 0)."""
    n, k = w.shape
    decoded = _scratch_view(x, 1, w.layer.values)[0]  # [values]
    if w.layer_offset == 0:
        quantized.dequantize_layer(w.layer, decoded)
    return decoded[w.layer_offset:w.layer_offset + n * k].view(n, k)


def _quantized_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, static_weight: bool,
                      out: torch.Tensor | None = None, x_records: torch.Tensor | None = None):
    n, k = w.shape
    if x.dtype == torch.float32:  # the kernels take fp16/bf16
        return reference.linear(x, w, bias, out=out)
    if quantized.takes_rows(x.shape[0], w):
        return quantized.linear(x, w, bias, static_weight, out=out, x_records=x_records)
    if w.layer is not None:
        y = _ops.linear(x, _layer_matrix(x, w), bias, "auto", w.layer_offset > 0)
        return y if out is None else out.copy_(y)
    if n * k <= SCRATCH_VALUES:  # the whole weight at once (every layer matrix of an 8B model)
        return quantized.linear(x, w, bias, static_weight, _scratch_view(x, n, k), out=out)
    rows = max(16, SCRATCH_VALUES // k // 16 * 16)  # slices start on 16-byte boundaries (the kernels' loads)
    y = x.new_empty(x.shape[0], n) if out is None else out  # [tokens, n] (x is [tokens, k], as linear takes it)
    for n0 in range(0, n, rows):
        part = QuantizedWeight(w.kind, w.blocks[n0:n0 + rows], (min(rows, n - n0), k), w.dtype, tiled=w.tiled)
        scratch = _scratch_view(x, *part.shape)
        quantized.linear(x, part, None if bias is None else bias[n0:n0 + rows], static_weight, scratch,
                         out=y[:, n0:n0 + part.shape[0]])
    return y


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
           static_weight: bool = False, out: torch.Tensor | None = None,
           x_records: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
           accumulate: bool = False) -> torch.Tensor:
    # x [tokens, in] (last dim contiguous), weight [out, in] dense or quantized, bias [out] -> [tokens, out]
    # static_weight=True promises that no kernel just ahead of this one in the stream writes weight (a
    # model's weights): the gemv kernels then start reading it while the previous kernel still runs.
    # x_records: x's records, written by the kernel before (records_for); read by the Q4_K kernels.
    # norm (weight [in], eps): x is read as rms_norm(x, weight, eps); accumulate: out += the product (the residual
    # add). In the linear's launch where norms_in_linears says so, else apart.
    if x.stride(-1) != 1:
        x = x.contiguous()
    if norm is not None or accumulate:
        if accumulate and out is None:
            raise ValueError("linear: accumulate needs out")
        if (isinstance(weight, QuantizedWeight) and x.dim() == 2 and x.shape[0] <= quantized.QLINEAR_MAX_ROWS
                and x.dtype != torch.float32 and x_records is None):
            return quantized.linear(x, weight, bias, static_weight, out=out, norm=norm, accumulate=accumulate)
        if norm is not None:
            x = rms_norm(x, *norm)
        y = linear(x, weight, bias, static_weight, x_records=x_records)
        return out.add_(y) if accumulate else (y if out is None else out.copy_(y))
    # out: a [tokens, out] view to write into (quantized weights at decode rows write it in place; otherwise
    # a copy).
    if isinstance(weight, QuantizedWeight):
        return _quantized_linear(x, weight, bias, static_weight, out, x_records)
    y = _ops.linear(x, weight, bias, "auto", static_weight)
    return y if out is None else out.copy_(y)


# ---- attention family (csrc/attention/) ----

@torch.library.register_fake("minfer::attention")
def _attention_fake(q, k_cache, v_cache, start_pos, scale, stable_prefix=False, window=0, k_new=None, v_new=None,
                    cos_sin=None):
    return q.new_empty(q.shape)  # [batch, seq, heads, head_dim], contiguous


@torch.library.register_fake("minfer::paged_attention")
def _paged_attention_fake(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale,
                          stable_prefix=False, window=0, k_new=None, v_new=None, cos_sin=None):
    return q.new_empty(q.shape)  # [tokens, heads, head_dim], contiguous


@torch.library.register_fake("minfer::paged_attention_into")
def _paged_attention_into_fake(out, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                               scale, stable_prefix=False, window=0, k_new=None, v_new=None, cos_sin=None):
    return None


ATTENTION_HEAD_DIMS = (64, 128, 256)  # what the prefill and decode kernels are built for
DECODE_ROPE_HEAD_DIMS = (64, 128)  # where decode takes the newest key's rope (k_new, v_new, cos_sin)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: torch.Tensor,
              scale: float, stable_prefix: bool = False, window: int | None = None, k_new: torch.Tensor | None = None,
              v_new: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    # q [batch, seq, heads, head_dim] (a strided view into the fused qkv is fine); caches
    # [batch, capacity, kv_heads, head_dim]; start_pos [batch] int32 on the device.
    # seq > 1: flash prefill; seq == 1: split-KV decode. fp32 has no kernel (the engine runs fp16/bf16
    # on GPU) and runs on the reference instead.
    # stable_prefix=True promises that start_pos and the cache rows before start_pos[b] were written
    # before the kernels just ahead of this one in the stream: decode then starts reading them while
    # the previous kernel still runs (a wrong promise gives wrong results). q is no part of the promise: it is
    # read after the previous kernel is done.
    # window: a query at position p sees only keys p - window < key <= p (None: all); decode reads only those.
    # k_new, v_new, cos_sin: the newest key's rope in the decode call, as reference.attention (head_dim in
    # DECODE_ROPE_HEAD_DIMS).
    if q.dtype == torch.float32:
        return reference.attention(q, k_cache, v_cache, start_pos, scale, window=window, k_new=k_new, v_new=v_new,
                                   cos_sin=cos_sin)
    return _ops.attention(q, k_cache, v_cache, start_pos, float(scale), stable_prefix, _window(window), k_new, v_new,
                          cos_sin)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    scale: float, window: int | None = None, stable_prefix: bool = False,
                    out: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    # As reference.paged_attention. One query per sequence runs the split-KV decode through the block table,
    # anything else the ragged flash prefill. Pages hold a multiple of 16 keys. stable_prefix (decode only):
    # seq_lens, the block table and every cache row but each sequence's newest were written before the
    # kernels just ahead of this one (the engine's decode step), as attention()'s promise. out: a contiguous
    # [tokens, heads, head_dim] tensor (a slice of a bigger one) the kernels write, returned.
    if q.dtype == torch.float32:
        return reference.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q,
                                         max_seqlen_k, scale, window=window, out=out, k_new=k_new, v_new=v_new,
                                         cos_sin=cos_sin)
    args = (q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, float(scale),
            stable_prefix, _window(window), k_new, v_new, cos_sin)
    if out is None:
        return _ops.paged_attention(*args)
    _ops.paged_attention_into(out, *args)
    return out


def _window(window: int | None) -> int:
    # The kernels' encoding: 0 is no window.
    if window is not None and window < 1:
        raise ValueError(f"attention window must be >= 1 or None, got {window}")
    return window or 0
