"""Hugging Face transformers' DeepSeek-V4 on dsattn's sparse operators (issue 14).

    model = DeepseekV4ForCausalLM.from_pretrained(path)
    dsattn.integrations.transformers.enable(model)
    model.generate(...)

:func:`enable` switches every ``DeepseekV4Attention`` of a loaded model to :func:`_attention_forward`
(:func:`disable` switches back), keeping the model's own parameters and cache objects.  The
model's attention is dense: it concatenates the sliding-window KV with every compressed entry and
masks with an additive ``block_bias [B, 1, S, compressed]`` (CSA: the indexer's top-k scattered into
it, after a dense ``[B, S, compressed]`` score tensor).  Here instead:

* attention is one ``sparse_flash_mla`` call: the ori branch is the model's sliding-window KV (the
  cache's last ``sliding_window - 1`` rows and the new ones; band ``sliding_window - 1`` / 0,
  right-aligned), the cmp branch the compressor's entries with the causal rule ``entry w is visible
  from position p iff w < (p + 1) // ratio`` (``cmp_mask_mode`` 3, ``cmp_residual_kv`` = tokens not
  yet compressed), CSA through the indexer's top-k list, HCA through its causal prefix, the sinks
  inside the softmax.  No ``block_bias`` and no ``[S, context]`` score tensor is built;
* the CSA indexer scores and selects through ``lightning_indexer`` (``mask_mode`` 3): its weights are
  ``weights_proj(h) · index_n_heads**-0.5 · index_head_dim**-0.5`` (the model's two positive scales
  commute with the ReLU), its queries the model's roped ``q_b_proj(q_residual)``;
* the compressors keep the model's arithmetic (pooling with ``position_bias``, the ratio-4 overlap of
  the previous window's first half, ``kv_norm``, rope at ``i · ratio + first_window_position``), the
  model's modules and its cache state, without the mask.  dsattn's ``compressor`` op takes the same
  projections but normalises and ropes inside one fused kernel with its own state layout; mapping
  the model's cache objects onto it is left for later (noted in issue 14).

``enable`` also switches the model to ``attn_implementation="dsattn"``, a name registered with
transformers' attention-mask registry (its mask function returns None: the sparse operators apply the
band and causal rules themselves, so the model no longer builds its dense ``[S, S + past]``
sliding-window mask) and with its attention-function registry.  The attention-function registry is
not the natural hook for this model -- the compressor's ``block_bias`` and the indexer's dense scores
are computed before the attention function is called -- so a model loaded with
``from_pretrained(..., attn_implementation="dsattn")`` still needs :func:`enable`; if it runs without
it, the registered function raises a ``RuntimeError`` saying so.

Batches with padding (a 2-D ``attention_mask`` with zeros) raise ``ValueError``: the sparse path
has no per-token padding mask (right-aligned lengths would be its form); unpadded batches, ``use_cache``
on and off, ``generate()`` and chunked prefill through repeated forward calls work.
"""
from __future__ import annotations

import types

import torch

from .. import ops
from ..hyper_parallel import npu_sparse_flash_mla

_ORIGINAL = "_dsattn_original_forward"


def _model_module():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4
    return modeling_deepseek_v4


def _attention_modules(model):
    cls = _model_module().DeepseekV4Attention
    return [m for m in model.modules() if isinstance(m, cls)]


def register() -> None:
    """Register ``"dsattn"`` with transformers' attention and attention-mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register("dsattn", _no_dense_mask)
    AttentionInterface.register("dsattn", _not_enabled)


def _no_dense_mask(*args, **kwargs):
    return None


def _not_enabled(module, *args, **kwargs):
    raise RuntimeError("attn_implementation='dsattn' needs dsattn's attention layers: call "
                       "dsattn.integrations.transformers.enable(model) after loading the model")


def enable(model):
    """Run every DeepseekV4Attention of ``model`` on dsattn's sparse operators; returns ``model``."""
    mods = _attention_modules(model)
    if not mods:
        raise ValueError("model: no DeepseekV4Attention module found; expected a transformers DeepSeek-V4 model")
    register()
    if model.config._attn_implementation != "dsattn":
        model._dsattn_previous_attn = model.config._attn_implementation
        model.set_attn_implementation("dsattn")
    for m in mods:
        if not hasattr(m, _ORIGINAL):
            setattr(m, _ORIGINAL, m.forward)
            m.forward = types.MethodType(_attention_forward, m)
    for m in model.modules():                       # the padding check, once per model forward
        if type(m).__name__ == "DeepseekV4Model" and not hasattr(m, "_dsattn_padding_hook"):
            m._dsattn_padding_hook = m.register_forward_pre_hook(_reject_padding, with_kwargs=True)
    return model


def disable(model):
    """Restore the model's own attention; returns ``model``."""
    previous = getattr(model, "_dsattn_previous_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        del model._dsattn_previous_attn
    for m in _attention_modules(model):
        if hasattr(m, _ORIGINAL):
            m.forward = getattr(m, _ORIGINAL)
            delattr(m, _ORIGINAL)
    for m in model.modules():
        hook = getattr(m, "_dsattn_padding_hook", None)
        if hook is not None:
            hook.remove()
            del m._dsattn_padding_hook
    return model


def _reject_padding(module, args, kwargs):
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all()):
        raise ValueError("attention_mask: padded batches are not supported by dsattn's DeepSeek-V4 attention "
                         "(the sparse operators take right-aligned lengths, not a padding mask); run unpadded "
                         "sequences, one per batch row of equal length, or disable(model)")


def _compressed_entries(comp, hidden_states, cache_layer, name: str, head_dim: int, overlap: bool):
    """The compressor's entries ``[B, T, head_dim]`` so far (the model's arithmetic and cache state)."""
    M = _model_module()
    batch = hidden_states.shape[0]
    ratio = comp.compress_rate
    kv = comp.kv_proj(hidden_states)
    gate = comp.gate_proj(hidden_states)
    if cache_layer is None:
        usable = (kv.shape[1] // ratio) * ratio
        chunk_kv, chunk_gate, first_window_position = kv[:, :usable], gate[:, :usable], 0
    else:
        chunk_kv, chunk_gate, first_window_position = cache_layer.store_compression_weights(name, kv, gate)
    if chunk_kv.shape[1] > 0:
        n_windows = chunk_kv.shape[1] // ratio
        chunk_kv = chunk_kv.view(batch, n_windows, ratio, -1)
        chunk_gate = chunk_gate.view(batch, n_windows, ratio, -1) + comp.position_bias
        if overlap:             # entry w pools window w-1's first half (Ca) with window w's second half (Cb)
            new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * ratio, head_dim))
            new_gate = chunk_gate.new_full((batch, n_windows, 2 * ratio, head_dim), float("-inf"))
            new_kv[:, :, ratio:] = chunk_kv[..., head_dim:]
            new_gate[:, :, ratio:] = chunk_gate[..., head_dim:]
            if n_windows > 1:
                new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :head_dim]
                new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, :head_dim]
            if cache_layer is not None:
                prior_kv, prior_gate = cache_layer.update_overlap_state(name, chunk_kv, chunk_gate, head_dim)
                if prior_kv is not None:
                    new_kv[:, 0, :ratio] = prior_kv.to(new_kv.dtype)
                    new_gate[:, 0, :ratio] = prior_gate.to(new_gate.dtype)
            chunk_kv, chunk_gate = new_kv, new_gate
        compressed = comp.kv_norm((chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype))
                                  .sum(dim=2))
        positions = torch.arange(n_windows, device=compressed.device) * ratio + first_window_position
        cos, sin = comp.rotary_emb(compressed, position_ids=positions.unsqueeze(0).expand(batch, -1),
                                   layer_type=comp.rope_layer_type)
        compressed = M.apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    else:
        compressed = chunk_kv.new_zeros((batch, 0, head_dim))
    if cache_layer is not None:
        compressed = cache_layer.update_compressor_states(name, compressed)
    return compressed


def _topk(indexer, hidden_states, q_residual, position_ids, keys, total):
    """The CSA indexer's top-k list ``[B, S, 1, topk]`` through ``lightning_indexer`` (-1 past the
    causally visible entries)."""
    M = _model_module()
    B, S, _ = hidden_states.shape
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(B, S, -1, indexer.head_dim).transpose(1, 2)
    q = M.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)                          # [B, S, Hi, d]
    scorer = indexer.scorer
    w = scorer.weights_proj(hidden_states).float() * (scorer.weights_scaling * scorer.softmax_scale)
    ratio = indexer.compress_rate
    resid = (total - keys.shape[1] * ratio).to(torch.int32)
    with torch.no_grad():                             # the model's indexer is not differentiable either
        idx, _ = ops.lightning_indexer(q.float().contiguous(), keys.float().unsqueeze(2).contiguous(),
                                       w.contiguous(), indexer.index_topk, cmp_residual_k=resid, mask_mode=3,
                                       cmp_ratio=ratio)
    return idx


def _attention_forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                       past_key_values=None, cache=None, **kwargs):
    """DeepseekV4Attention.forward on dsattn's operators (module docstring).  The cache argument is
    ``past_key_values`` up to transformers 5.23 and ``cache`` from 5.24."""
    M = _model_module()
    past_key_values = cache if cache is not None else past_key_values
    B, S = hidden_states.shape[:2]
    D = self.head_dim
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_residual).view(B, S, -1, D).transpose(1, 2))
    q = M.apply_rotary_pos_emb(q, cos, sin)                                           # [B, H, S, D]
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(B, S, -1, D).transpose(1, 2)
    kv = M.apply_rotary_pos_emb(kv, cos, sin)                                         # [B, 1, S, D]
    cache_layer = None
    if past_key_values is not None:
        kv = past_key_values.update(kv, kv, self.layer_idx)[0]                        # [B, 1, kept + S, D]
        cache_layer = past_key_values.layers[self.layer_idx]
    total = position_ids[:, -1].to(torch.int64).expand(B) + 1                         # tokens seen, per batch row
    kw = dict(ori_kv=kv.transpose(1, 2), sinks=self.sinks.float(), softmax_scale=self.scaling, ori_mask_mode=4,
              ori_win_left=self.sliding_window - 1, ori_win_right=0, layout="BSND")
    comp = self.compressor
    if comp is not None:
        csa = isinstance(comp, M.DeepseekV4CSACompressor)
        entries = _compressed_entries(comp, hidden_states, cache_layer, "compressor", comp.head_dim, overlap=csa)
        ratio = comp.compress_rate
        # (from transformers 5.24 the compressors' norm and position bias are fp32: entries follow q's dtype,
        # as the model's concatenation with the window KV does before its attention)
        kw.update(cmp_kv=entries.to(q.dtype).unsqueeze(2), cmp_ratio=ratio, cmp_mask_mode=3,
                  cmp_residual_kv=(total - entries.shape[1] * ratio).to(torch.int32))
        if csa:
            ind = comp.indexer
            keys = _compressed_entries(ind, hidden_states, cache_layer, "indexer", ind.head_dim, overlap=True)
            kw["cmp_sparse_indices"] = _topk(ind, hidden_states, q_residual, position_ids, keys, total)
    out, _ = npu_sparse_flash_mla(q.transpose(1, 2), **kw)       # [B, S, H, D]; differentiable (training)
    # undo the rope the shared K = V put on the output's rope slice (at the query position)
    attn_output = M.apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = self.o_a_proj(attn_output.reshape(B, S, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped), None
