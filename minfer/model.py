"""A decoder of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) or Gemma 3. All layer math goes
through the op seam (minfer.ops); this file only wires the ops together."""
from __future__ import annotations

import math

import torch

from .config import FULL, ModelConfig
from .errors import MinferError
from .kv_cache import AttentionMetadata, KVCache, PagedKVCache
from .ops import Backend
from .quant import QuantizedWeight, group_layer


def rope_cos_sin(cfg: ModelConfig, max_positions: int, device, local: bool = False) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32: cos | sin halves. Scaling is folded in here, so the rope
    kernel does the same work for every scaling type. local: the table of the windowed layers of a model
    with its own base for them (Gemma 3), unscaled."""
    rot = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    scaling = {} if local else (cfg.rope_scaling or {})
    kind = scaling.get("rope_type")
    stretch = 1.0  # positions are divided by it
    if kind == "linear":
        stretch = scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    table = torch.empty(max_positions, rot, dtype=torch.float32, device=device)
    half = rot // 2
    for start in range(0, max_positions, 1 << 16):  # fp64 a chunk at a time: a long context's table fits in fp32 only
        positions = torch.arange(start, min(start + (1 << 16), max_positions), dtype=torch.float64) / stretch
        angles = positions[:, None] * inv_freq[None, :]  # [chunk, rot/2]
        table[start:start + len(positions), :half] = angles.cos().float()
        table[start:start + len(positions), half:] = angles.sin().float()
    return table


Weight = torch.Tensor | QuantizedWeight

# The fewest rows of a decode step that fold rope into the attention call. Below, rope's own launch costs the step
# less: its tail runs while decode lays out its split and loads its first tiles. H100, a switch, ms a step, separate
# rope / folded: the SmolLM2-135M shape (head_dim 64) at 1 row 0.501-0.503 / 0.509-0.511, 16 rows 0.689-0.690 /
# 0.703-0.704, 32 rows 0.763 / 0.743, 64 rows 0.889-0.890 / 0.868-0.869, 128 rows 1.268 / 1.237; the 8B Q4_K_M
# (head_dim 128) level at 1, 16 and 64 rows.
ROPE_IN_DECODE_ROWS = 32


def fuse(parts: list[Weight]) -> Weight | list[Weight]:
    """Weights of linears on one input, stacked by rows into one weight (one GEMM). Quantized parts stack
    only with neighbours of their own format (a Q4_K_M file may keep v in Q6_K, q and k in Q4_K): then a
    list of stacks comes back, run one by one."""
    groups: list[list[Weight]] = []
    for w in parts:
        kind = w.kind if isinstance(w, QuantizedWeight) else None
        last = groups[-1][-1] if groups else None
        if last is not None and kind == (last.kind if isinstance(last, QuantizedWeight) else None):
            groups[-1].append(w)
        else:
            groups.append([w])
    stacked = [QuantizedWeight.cat(g) if isinstance(g[0], QuantizedWeight) else torch.cat(g) for g in groups]
    return stacked[0] if len(stacked) == 1 else stacked


def fused_linear(ops: Backend, x: torch.Tensor, w: Weight | list[Weight], bias: torch.Tensor | None = None,
                 x_records: torch.Tensor | None = None):
    """x [tokens, in] @ w^T (+ bias) -> [tokens, out] for a weight from fuse(); a list's parts write their
    columns of one output. x_records: x's records from the kernel that wrote x (ops.records_for)."""
    if not isinstance(w, list):
        return ops.linear(x, w, bias, static_weight=True, x_records=x_records)
    out = x.new_empty(x.shape[0], sum(part.shape[0] for part in w))  # [tokens, out]
    starts = [sum(part.shape[0] for part in w[:i]) for i in range(len(w))]

    def run(i: int) -> None:
        part, n0 = w[i], starts[i]
        n = part.shape[0]
        ops.linear(x, part, None if bias is None else bias[n0:n0 + n], static_weight=True, out=out[:, n0:n0 + n],
                   x_records=x_records)

    # Smaller stacks first (Q4_K_M's v before q|k): their few CTAs leave the SMs to the larger stack's, which start
    # streaming beside them (8B Q4_K_M decode, H200, ms a step: batch 1 2.372 -> 2.356, batch 16 3.643 -> 3.607).
    order = sorted(range(len(w)), key=lambda i: w[i].shape[0])
    side = ops.beside_stream(x)
    if side is None:
        for i in order:
            run(i)
        return out
    # The smaller on a stream of their own beside the largest, which then waits only for x, not for them (8B Q4_K_M
    # decode, H100, one build, a switch, two rounds, ms a step: batch 1 2.112 / 2.113 -> 2.090 / 2.082, batch 16
    # 3.035 / 3.046 -> 3.031 / 3.020).
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for i in order[:-1]:
            run(i)
    run(order[-1])
    main.wait_stream(side)
    return out


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight], ops: Backend, max_positions: int):
        self.cfg, self.ops = cfg, ops
        w = weights
        self.embed = w["model.embed_tokens.weight"]  # [vocab, hidden]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]  # [vocab, hidden]
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            layer = {
                "attn_norm": w[p + "input_layernorm.weight"],
                # The norm before the MLP: Llama calls it post_attention_layernorm, Gemma (which also
                # norms the attention output under that name) pre_feedforward_layernorm.
                "mlp_norm": w[p + ("pre_feedforward_layernorm.weight" if cfg.sandwich_norm
                                   else "post_attention_layernorm.weight")],
                # Fused projections: one GEMM for q|k|v and one for gate|up.
                "qkv": fuse([w[attn + "q_proj.weight"], w[attn + "k_proj.weight"], w[attn + "v_proj.weight"]]),
                "qkv_bias": torch.cat([w[attn + "q_proj.bias"], w[attn + "k_proj.bias"], w[attn + "v_proj.bias"]])
                if cfg.attention_bias else None,
                "o": w[attn + "o_proj.weight"],
                "gate_up": fuse([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                "down": w[p + "mlp.down_proj.weight"],
            }
            # A small model's quantized linears of one format back to back: past 32 rows one dequantize launch a
            # layer, not one a matrix (SmolLM2-135M's batch-64 step, GPU busy: 1.256 -> 1.124 ms).
            mats = ("qkv", "o", "gate_up", "down")  # the order _layers calls them
            layer.update(zip(mats, group_layer([layer[m] for m in mats])))
            if cfg.qk_norm:
                layer["q_norm"], layer["k_norm"] = w[attn + "q_norm.weight"], w[attn + "k_norm.weight"]
            if cfg.sandwich_norm:
                layer["attn_out_norm"] = w[p + "post_attention_layernorm.weight"]
                layer["mlp_out_norm"] = w[p + "post_feedforward_layernorm.weight"]
            self.layers.append(layer)
        self.cos_sin = rope_cos_sin(cfg, max_positions, self.embed.device)
        local = self.cos_sin if cfg.rope_local_theta is None else \
            rope_cos_sin(cfg, max_positions, self.embed.device, local=True)
        # None: the layer sees the whole context (also when its window spans every position the model has)
        self.windows = [w if w is not None and w < max_positions else None for w in map(cfg.window, range(cfg.num_layers))]
        types = cfg.layer_types or [FULL] * cfg.num_layers
        self.rope_tables = [self.cos_sin if t == FULL else local for t in types]  # one per layer
        self.scale = cfg.attention_scale
        self._fused_norms: dict[int, bool] = {}  # rows -> _norms_in_linears
        self.act_name = "gelu_tanh" if cfg.hidden_act == "gelu_tanh" else "silu"
        self.act = ops.gelu_tanh_and_mul if self.act_name == "gelu_tanh" else ops.silu_and_mul
        if self.act_name == "gelu_tanh":
            ops.need("gelu_tanh_and_mul")
        # Decode steps of at least rope_in_decode_rows rows rotate the newest key inside the attention call, which also
        # writes it to the cache: one launch a layer fewer. For models without q/k norms whose rotation spans the whole
        # head, where the backend takes it.
        self.rope_in_decode = not cfg.qk_norm and cfg.rotary_dim == cfg.head_dim
        self.rope_in_decode_rows = ROPE_IN_DECODE_ROWS
        if ops.name == "cuda":
            from .ops import cuda
            self.rope_in_decode &= cfg.head_dim in cuda.DECODE_ROPE_HEAD_DIMS
            if cfg.head_dim not in cuda.ATTENTION_HEAD_DIMS:
                why = f"no attention kernel for head_dim {cfg.head_dim}"
                for op in ("attention", "paged_attention"):
                    ops.route_to_reference(op, why)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start_pos: torch.Tensor, cache: KVCache,
                logit_index: torch.Tensor | None = None, raw_logits: bool = False) -> torch.Tensor:
        """The dense cache's forward. ids [batch, seq]; start_pos [batch] int32 (position of ids[:, 0], on the
        device). logit_index [batch]: the row of each sequence whose logits are wanted (None: every row).
        Returns fp32 logits [batch, vocab], or [batch, seq, vocab] when logit_index is None; with raw_logits, the
        lm_head's output in the model's dtype (final_logits)."""
        cfg, ops = self.cfg, self.ops
        batch, seq = ids.shape
        heads, hd = cfg.num_heads, cfg.head_dim
        # [batch, seq]; a decode step's are start_pos itself, no launch
        positions = start_pos[:, None] if seq == 1 else \
            start_pos[:, None] + torch.arange(seq, device=ids.device, dtype=start_pos.dtype)
        if start_pos.device.type == "cpu":  # on a GPU this check would cost a host sync per step; the
            end = int(start_pos.max()) + seq  # engine sizes the cache so that it cannot overflow there
            cache.check_fits(end)
            self._check_positions(end)

        flat_positions = positions.reshape(-1)  # [tokens]
        # the decode call rotates and writes the newest key itself
        fold = seq == 1 and self.rope_in_decode and batch >= self.rope_in_decode_rows
        # else rope writes k and v into the cache in its launch: a layer's [batch, capacity, kv_heads, hd] seen as
        # [batch * capacity] rows, sequence b's position p at row b * capacity + p
        slots = None if fold else (cache.row_base[:batch] + positions).reshape(-1)  # [tokens]

        def attend(i, q, k, v):
            # The cache rows before start_pos were written by earlier forward calls, and nothing here
            # writes start_pos: decode may start reading them before the newest key is written.
            if fold:
                attn = ops.attention(q.view(batch, 1, heads, hd), cache.k[i], cache.v[i], start_pos, self.scale,
                                     stable_prefix=True, window=self.windows[i], k_new=k, v_new=v,
                                     cos_sin=self.rope_tables[i])
                return attn.reshape(batch, heads * hd)
            self._rope(i, q, k, flat_positions, v=v, k_cache=cache.k[i], v_cache=cache.v[i], slot_mapping=slots)
            attn = ops.attention(q.view(batch, seq, heads, hd), cache.k[i], cache.v[i], start_pos, self.scale,
                                 stable_prefix=True, window=self.windows[i])
            return attn.reshape(batch * seq, heads * hd)

        x = self._layers(ids.reshape(-1), attend).view(batch, seq, -1)  # [batch, seq, hidden]
        if logit_index is not None:
            x = x[torch.arange(batch, device=x.device), logit_index]  # [batch, hidden]
        raw = self.ops.linear(x.reshape(-1, x.shape[-1]), self.lm_head, static_weight=True)
        return (raw if raw_logits else self.final_logits(raw)).view(*x.shape[:-1], -1)

    @torch.inference_mode()
    def forward_paged(self, ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache,
                      logit_index: torch.Tensor | None, raw_logits: bool = False) -> torch.Tensor:
        """The paged cache's forward: the new tokens of several sequences, each at its own position (prefill
        chunks and decodes mixed). ids [tokens]; logit_index [rows]: the tokens whose logits are wanted (None:
        every token's, as in a decode step). Returns fp32 logits [rows, vocab]; with raw_logits, the lm_head's
        output in the model's dtype, which final_logits turns into them."""
        ops, heads, hd = self.ops, self.cfg.num_heads, self.cfg.head_dim
        if ids.device.type == "cpu" and ids.numel():
            self._check_positions(meta.max_seqlen_k)

        # A decode step's keys before each newest were written by earlier steps, and the metadata before
        # the first layer: the decode kernel may start reading them early.
        decode = meta.max_seqlen_q == 1
        # one query a sequence: the decode call rotates and writes the newest key itself
        rows = ids.shape[0]
        fold = decode and self.rope_in_decode and rows == meta.block_table.shape[0] and rows >= self.rope_in_decode_rows

        def attend(i, q, k, v):
            # a windowed layer's keys are in the sliding group's pages when the step has that group
            local = self.windows[i] is not None and meta.local_block_table is not None
            slots, table = (meta.local_slot_mapping, meta.local_block_table) if local else \
                (meta.slot_mapping, meta.block_table)
            if fold:
                attn = ops.paged_attention(q, cache.k[i], cache.v[i], table, meta.seq_lens, meta.cu_seqlens_q, 1,
                                           meta.max_seqlen_k, self.scale, window=self.windows[i], stable_prefix=True,
                                           k_new=k, v_new=v, cos_sin=self.rope_tables[i])  # [tokens, heads, hd]
                return attn.reshape(-1, heads * hd)
            self._rope(i, q, k, meta.positions, v=v, k_cache=cache.k[i], v_cache=cache.v[i], slot_mapping=slots)
            d = meta.num_decodes
            if d:  # decodes on the decode kernel, then the prompt chunks, each into its rows of one tensor
                attn = q.new_empty(q.shape)  # [tokens, heads, hd]
                ops.paged_attention(q[:d], cache.k[i], cache.v[i], table[:d], meta.seq_lens[:d],
                                    meta.cu_seqlens_q[:d + 1], 1, meta.decode_max_seqlen_k, self.scale,
                                    window=self.windows[i], out=attn[:d])
                ops.paged_attention(q[d:], cache.k[i], cache.v[i], table[d:], meta.seq_lens[d:],
                                    meta.chunk_cu_seqlens_q, meta.max_seqlen_q, meta.chunk_max_seqlen_k,
                                    self.scale, window=self.windows[i], out=attn[d:])
            else:
                attn = ops.paged_attention(q, cache.k[i], cache.v[i], table, meta.seq_lens, meta.cu_seqlens_q,
                                           meta.max_seqlen_q, meta.max_seqlen_k, self.scale, window=self.windows[i],
                                           stable_prefix=decode)  # [tokens, heads, hd]
            return attn.reshape(-1, heads * hd)

        x = self._layers(ids, attend)  # [tokens, hidden]
        raw = self.ops.linear(x if logit_index is None else x[logit_index], self.lm_head, static_weight=True)
        return raw if raw_logits else self.final_logits(raw)  # [rows, vocab]

    def final_logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The lm_head's output [rows, vocab] -> fp32 logits (soft-capped where the model caps them)."""
        logits = raw.float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy_ids(self, raw: torch.Tensor) -> torch.Tensor:
        """[rows] the argmax of each row's logits, from the lm_head's output: taken as it is, in the model's dtype (no
        fp32 copy of [rows, vocab]), unless the logits are soft-capped, whose rounding may tie."""
        if self.cfg.final_logit_softcapping is None:
            return self.ops.argmax(raw)
        return self.final_logits(raw).argmax(-1)

    def _check_positions(self, end: int) -> None:
        if end > self.cos_sin.shape[0]:
            raise MinferError(f"position {end - 1} is past the {self.cos_sin.shape[0]} positions the model was built for")

    def _rope(self, i: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, **paged_write) -> None:
        """Layer i's rotation of q and k in place, after the per-head q/k RMSNorms (Qwen3, Gemma 3) where the
        model has them, in one launch; paged_write (v, k_cache, v_cache, slot_mapping): k and v to the pages too."""
        layer = self.layers[i]
        self.ops.rope(q, k, positions, self.rope_tables[i], True, layer.get("q_norm"), layer.get("k_norm"),
                      self.cfg.rms_norm_eps, **paged_write)

    def _layers(self, ids: torch.Tensor, attend) -> torch.Tensor:
        """ids [tokens] -> the final-normed hidden states [tokens, hidden]. attend(layer, q, k, v) rotates q and
        k (_rope, or the decode call itself), writes k, v to the cache and returns the attention output [tokens,
        heads * hd]."""
        cfg, ops = self.cfg, self.ops
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        residual = ops.embedding(ids, self.embed, cfg.embed_scale)  # [tokens, hidden]
        if self._norms_in_linears(residual):
            return self._layers_norms_in_linears(residual, attend)
        # records: at decode rows the norms and the activation also write x as the Q4_K linears after them
        # read it (ops.records_for), sparing each of those linears a conversion launch
        records = ops.records_for(residual, self.layers[0]["qkv"])
        x = ops.rms_norm(residual, self.layers[0]["attn_norm"], cfg.rms_norm_eps, records=records)
        for i, layer in enumerate(self.layers):
            # static_weight: no kernel writes the weights, so the gemv kernels start reading them early
            qkv = fused_linear(ops, x, layer["qkv"], layer["qkv_bias"], records)  # [tokens, (heads + 2 kvh) hd]
            q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
            q = q.reshape(-1, heads, hd)  # [tokens, heads, hd]; views, no copies
            k = k.reshape(-1, kv_heads, hd)
            v = v.reshape(-1, kv_heads, hd)
            x = ops.linear(attend(i, q, k, v), layer["o"], static_weight=True)  # [tokens, hidden]
            # the sandwich norm after attention (Gemma) is in the add's launch
            records = ops.records_for(x, layer["gate_up"])
            ops.fused_add_rms_norm(x, residual, layer["mlp_norm"], cfg.rms_norm_eps, layer.get("attn_out_norm"),
                                   records=records)
            down_records = ops.records_for(x, layer["down"])
            if isinstance(layer["gate_up"], list):  # parts of different formats
                gate_up = fused_linear(ops, x, layer["gate_up"], x_records=records)  # [tokens, 2 intermediate]
                h = self.act(gate_up, records=down_records)  # [tokens, intermediate]
            else:
                h = ops.linear_act_and_mul(x, layer["gate_up"], self.act_name, records, down_records)
            records = down_records
            x = ops.linear(h, layer["down"], static_weight=True, x_records=records)
            last = i + 1 == len(self.layers)
            next_norm = self.final_norm if last else self.layers[i + 1]["attn_norm"]
            records = None if last else ops.records_for(x, self.layers[i + 1]["qkv"])
            ops.fused_add_rms_norm(x, residual, next_norm, cfg.rms_norm_eps, layer.get("mlp_out_norm"),
                                   records=records)
        return x

    def _norms_in_linears(self, residual: torch.Tensor) -> bool:
        """Whether the backend's linears take this step's norms and residual adds (ops.norms_in_linears), for a
        model without sandwich norms; asked once a row count."""
        rows = residual.shape[0]
        if rows not in self._fused_norms:
            mats = [layer[m] for layer in self.layers for m in ("qkv", "o", "gate_up", "down")]
            self._fused_norms[rows] = (not self.cfg.sandwich_norm and not any(isinstance(w, list) for w in mats)
                                       and self.ops.norms_in_linears(residual, mats))
        return self._fused_norms[rows]

    def _layers_norms_in_linears(self, residual: torch.Tensor, attend) -> torch.Tensor:
        """_layers with each norm read by the linear after it and each residual add written by the linear before:
        per layer, qkv and gate | up normalize the residual stream as they read it, o and down add into it."""
        cfg, ops = self.cfg, self.ops
        heads, kv_heads, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        for i, layer in enumerate(self.layers):
            qkv = ops.linear(residual, layer["qkv"], layer["qkv_bias"], static_weight=True,
                             norm=(layer["attn_norm"], eps))  # [tokens, (heads + 2 kvh) hd]
            q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
            attn = attend(i, q.reshape(-1, heads, hd), k.reshape(-1, kv_heads, hd), v.reshape(-1, kv_heads, hd))
            ops.linear(attn, layer["o"], static_weight=True, out=residual, accumulate=True)
            h = ops.linear_act_and_mul(residual, layer["gate_up"], self.act_name, norm=(layer["mlp_norm"], eps))
            ops.linear(h, layer["down"], static_weight=True, out=residual, accumulate=True)
        return ops.rms_norm(residual, self.final_norm, eps)
