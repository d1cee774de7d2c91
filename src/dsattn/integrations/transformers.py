"""Hugging Face transformers' DeepSeek-V4 on dsattn's sparse operators (the DSA models, DeepSeek-V3.2 and the
GLM-5 family, in :mod:`dsattn.integrations.transformers_dsa`).

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
* the compressors pool through dsattn's ``compressor`` (differentiable: training reaches the
  compressor's weights through its backward).  The model's weights map one to one: ``wkv`` =
  ``kv_proj.weight`` and ``wgate`` = ``gate_proj.weight`` (``[coff·head_dim, hidden]``), ``ape`` =
  ``position_bias`` (``[ratio, coff·head_dim]``, as fp32).  The ratio-4 overlap is the op's
  ``coff = 2``: the model's Ca half (``[..., :head_dim]``, a token's share of the next window's
  entry) and Cb half (``[..., head_dim:]``, its own window's) are the op's first and last D
  channels, and window 0 of a first call pools zero-kv / -inf-gate slots in both.  The model's
  cache state becomes the op's explicit state rows (``cache_mode`` 2) for the history positions:
  ``buffer_kv`` / ``buffer_gate`` (raw projections of the incomplete window; the bias is added) and
  ``overlap_kv`` / ``overlap_gate`` (the previous window's Ca half, bias included), and the model's
  own bookkeeping advances the cache, so eager and dsattn calls can alternate on one cache.
  ``kv_norm`` (RMSNorm) and the rope at ``i · ratio + first_window_position`` stay the model's
  modules: dsattn's fused ``compressor_inference`` is not differentiable, and the model's rotary
  tables and partial-rope layout are its own; both steps are element-wise on the few entries;
* optionally (``enable(model, indexer_kl_loss=True)``) the CSA indexer's auxiliary KL loss of spec
  10 through ``sparse_lightning_indexer_kl_loss_grad`` (:func:`enable`).

``enable`` also switches the model to ``attn_implementation="dsattn"``, a name registered with
transformers' attention-mask registry (its mask function returns None: the sparse operators apply the
band and causal rules themselves, so the model no longer builds its dense ``[S, S + past]``
sliding-window mask) and with its attention-function registry.  The attention-function registry is
not the natural hook for this model -- the compressor's ``block_bias`` and the indexer's dense scores
are computed before the attention function is called -- so a model loaded with
``from_pretrained(..., attn_implementation="dsattn")`` still needs :func:`enable`; if it runs without
it, the registered function raises a ``RuntimeError`` saying so.

Padded batches (a 2-D ``attention_mask`` with zeros: ``tokenizer(prompts, padding=True)``, left
padding for ``generate()``, right padding for training with ``labels`` -100 on the padding) run as a
ragged batch of their unpadded rows: the base model's forward runs once per row on that row's own
tokens (the mask's ones), with its own positions (0 for its first real token) and its own cache
(one per row, kept on the caller's cache object), and the rows' hidden states go back to their
places (zeros at the padding).  So each row's logits are those of its prompt run alone, the
compressors pool only the row's own tokens and the indexer ranks only its own entries.  (The eager
model does otherwise: its compressors and the indexer's compressor take no mask and pool whatever
tokens fill each window, padding included, and its positions count the padding unless the caller
passes ``position_ids``.)  A cache that has served a padded batch serves that batch only (a batch of
another size raises ``ValueError``); the row loop is B model calls per step.  Unpadded batches run as
one batch.

Masks: None, the 2-D padding mask, and a 4-D mask only when it is exactly the model's own causal (V4: sliding-window
causal) mask with key padding, which then runs as that padding mask.  Every other mask -- a block-diagonal
packed-sequence mask, any other 4-D mask, a 3-D mask, a prepared dict holding masks -- and position ids that restart
within a row (transformers' packed-sequence form) raise ``ValueError`` naming the shape, in the base model's forward
before any layer runs: transformers would pass them on unread or drop them (:func:`_served_mask`).

transformers >= 5.17 (:data:`transformers_dsa.TRANSFORMERS_FLOOR`, the first release with all four model families):
importing this module or calling :func:`enable` on an older one raises ``ImportError`` naming both versions.
"""
from __future__ import annotations

import types

import torch

from .. import ops
from ..hyper_parallel import npu_sparse_flash_mla, npu_sparse_flash_mla_grad
from . import transformers_dsa

transformers_dsa.check_transformers_version()      # (also when transformers_dsa was imported before)

_SERVED = "DeepseekV4ForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM or Glm5NextForConditionalGeneration"

_ORIGINAL = "_dsattn_original_forward"
_ROWS = "_dsattn_rows"                        # on a cache object: the per-row caches of a padded batch
_KL_WEIGHT = "_dsattn_indexer_kl_weight"     # set on CSA attention modules by enable()
_KL_VALUE = "_dsattn_indexer_kl_value"       # this forward's KL term of the module


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


def enable(model, indexer_kl_loss: bool = False, indexer_kl_weight: float = 1.0):
    """Run every DeepseekV4Attention of ``model`` on dsattn's sparse operators; returns ``model``.  On a
    DeepSeek-V3.2, GLM-5.x or GLM-5.3-Flash model its sparse attention layers instead
    (:mod:`dsattn.integrations.transformers_dsa`).

    ``indexer_kl_loss``: in forward passes with autograd on, every CSA layer also computes the
    indexer's auxiliary KL loss of spec 10 §2.5 / §3 against the attention's own probabilities at the
    selected slots (``cmp_softmax_l1_norm``), weighted by ``indexer_kl_weight`` and averaged over the
    query tokens; the layers' sum is added to the returned ``loss`` (when the model computes one,
    i.e. with ``labels``) and is also returned as ``indexer_kl_loss``.  Its gradient reaches only the
    indexer's parameters (its query projection, weight projection and compressor): the indexer's
    inputs are detached, and the main loss never reaches the indexer (its top-k is a selection)."""
    transformers_dsa.check_transformers_version()
    mods = _attention_modules(model)
    family = None if mods else transformers_dsa.family_of(model)
    if not mods and family is None:
        raise ValueError(f"model: {type(model).__name__} has no attention module dsattn serves; expected a "
                         f"transformers DeepSeek-V4, V3.2, GLM-5.x or GLM-5.3-Flash model ({_SERVED})")
    if not isinstance(indexer_kl_weight, (int, float)) or isinstance(indexer_kl_weight, bool):
        raise TypeError(f"indexer_kl_weight: expected a float, got {type(indexer_kl_weight).__name__}")
    if family is not None:
        if indexer_kl_loss:
            raise ValueError(f"indexer_kl_loss: True is served for DeepSeek-V4 only, not {type(model).__name__}")
        transformers_dsa.check_config(model, family)
    register()
    # (GLM-5.3-Flash builds no dense [S, T] mask at the model level -- its attention builds it from the list, which
    # dsattn's forward replaces -- and its vision tower keeps its own attention)
    if model.config._attn_implementation != "dsattn" and family != "glm5_next":
        model._dsattn_previous_attn = model.config._attn_implementation
        model.set_attn_implementation("dsattn")
    if family is not None:
        transformers_dsa.enable_modules(model, family, _ORIGINAL, _padded_model_forward)
        return model
    csa_cls = _model_module().DeepseekV4CSACompressor
    for m in mods:
        if not hasattr(m, _ORIGINAL):
            setattr(m, _ORIGINAL, m.forward)
            m.forward = types.MethodType(_attention_forward, m)
        if indexer_kl_loss and isinstance(m.compressor, csa_cls):
            setattr(m, _KL_WEIGHT, float(indexer_kl_weight))
        elif hasattr(m, _KL_WEIGHT):
            delattr(m, _KL_WEIGHT)
    for m in _base_models(model):                   # padded batches: a ragged batch of their rows
        if not hasattr(m, _ORIGINAL):
            setattr(m, _ORIGINAL, m.forward)
            m.forward = types.MethodType(_padded_model_forward, m)
    _remove_hooks(model)
    hooks = []
    if indexer_kl_loss:
        hooks.append(model.register_forward_pre_hook(lambda module, args: _clear_kl(mods)))
        hooks.append(model.register_forward_hook(lambda module, args, output: _add_kl(mods, output)))
    model._dsattn_hooks = hooks
    return model


def disable(model):
    """Restore the model's own attention; returns ``model``."""
    previous = getattr(model, "_dsattn_previous_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        del model._dsattn_previous_attn
    family = transformers_dsa.family_of(model)
    if family is not None:
        transformers_dsa.disable_modules(model, family, _ORIGINAL)
    for m in _base_models(model):
        if hasattr(m, _ORIGINAL):
            m.forward = getattr(m, _ORIGINAL)
            delattr(m, _ORIGINAL)
    for m in _attention_modules(model):
        if hasattr(m, _ORIGINAL):
            m.forward = getattr(m, _ORIGINAL)
            delattr(m, _ORIGINAL)
        for name in (_KL_WEIGHT, _KL_VALUE):
            if hasattr(m, name):
                delattr(m, name)
    _remove_hooks(model)
    return model


def _remove_hooks(model):
    for hook in getattr(model, "_dsattn_hooks", ()):
        hook.remove()
    model._dsattn_hooks = []


def _clear_kl(mods):
    for m in mods:
        if hasattr(m, _KL_VALUE):
            delattr(m, _KL_VALUE)


def _add_kl(mods, output):
    """After the model's forward: the CSA layers' KL terms, summed, added to ``output.loss``."""
    terms = [getattr(m, _KL_VALUE) for m in mods if hasattr(m, _KL_VALUE)]
    if not terms:
        return output
    kl = torch.stack(terms).sum()
    _clear_kl(mods)                                  # (the graph keeps what the backward needs)
    if getattr(output, "loss", None) is not None:
        output.loss = output.loss + kl
    output["indexer_kl_loss"] = kl
    return output


def _base_models(model):
    cls = _model_module().DeepseekV4Model
    return [m for m in model.modules() if isinstance(m, cls)]


# Which masks dsattn honours (read from transformers 5.17 - 5.25's masking_utils and the four models' forwards).
# With ``enable``, V4, V3.2 and GLM-5 run with attn_implementation "dsattn", whose registered mask function returns
# None: a 2-D padding mask never becomes a 4-D mask -- create_causal_mask / create_sliding_window_causal_mask call
# that function and the attention modules receive None -- and GLM-5.3-Flash's text model keeps its 2-D [B, S]
# mask (create_recurrent_attention_mask).  So on the normal paths (forward, padded batches, generate with the
# default DynamicCache) the base model receives None or a 2-D mask, and the dsattn attention forwards read neither:
# a 2-D mask with zeros is served by the row split below.  Every other mask would be silently dropped: a 3-D mask
# (create_causal_mask passes it to the mask function, which returns None), a 4-D mask (_preprocess_mask_arguments
# returns any 4-D mask as-is, "already prepared, or custom", and the dsattn attention ignores it), a prepared dict
# (generate builds one only for a static / compileable cache), and the block-diagonal mask transformers builds
# itself from position_ids that restart within a row (packed sequences, with no mask and no cache).  So here,
# before anything runs:
# * None and the 2-D padding mask (0 / 1, [batch, past + new tokens]) are served as before;
# * a 4-D mask is honoured only when it is exactly the mask the eager model builds from a 2-D padding mask for this
#   call -- causal (V4: causal within its sliding window, create_sliding_window_causal_mask's) AND a key padding
#   mask, bool (True = attend, sdpa's form) or additive (0 / -inf or the dtype's min, eager's form), with the
#   cache's offsets -- and it then runs as that 2-D padding mask; any other 4-D mask (a block-diagonal packed-
#   sequence mask, a bias, a bidirectional or shifted one) is refused;
# * every other mask (3-D, 1-D, 5-D, a BlockMask, a dict holding masks) and packed position_ids raise ValueError.

def _accepted(window):
    causal = "causal" if window is None else f"sliding-window ({window}) causal"
    return (f"dsattn's attention takes None, a 2-D padding mask [batch, past + new tokens] of 0 / 1, or the model's "
            f"own 4-D {causal} mask with key padding [batch or 1, 1, new tokens, keys]; pass packed sequences as "
            f"the rows of a padded batch")


def _served_mask(self, attention_mask, x, cache, rows, position_ids, use_cache):
    """The mask the base model's forward runs with: None or a 2-D padding mask (``attention_mask`` itself, or the
    padding of a 4-D mask that is the model's own causal one); ``ValueError`` naming the shape for every mask dsattn
    cannot honour (the comment above); ``x``: the input ids or embeddings."""
    B, S = x.shape[:2]
    window = self.config.sliding_window if isinstance(self, _model_module().DeepseekV4Model) else None
    if attention_mask is None:
        # (transformers builds the packed mask only without a cache: none passed and none made, as the model's
        # merge_with_config_defaults resolves use_cache)
        use_cache = use_cache if use_cache is not None else getattr(self.config, "use_cache", None)
        if use_cache and getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
            use_cache = False
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and cache is None and not use_cache and \
                position_ids.shape[-1] > 1 and bool((position_ids.diff(dim=-1) != 1).any()):
            raise ValueError(f"position_ids: they restart within a row (packed sequences, shape "
                             f"{tuple(position_ids.shape)}), from which transformers builds a block-diagonal mask; "
                             + _accepted(window))
        return None
    if isinstance(attention_mask, dict):
        if all(m is None for m in attention_mask.values()):      # (what generate prepares with dsattn's mask function)
            return attention_mask
        shapes = {k: None if m is None else tuple(m.shape) for k, m in attention_mask.items()}
        raise ValueError(f"attention_mask: a dict of prepared masks {shapes} (generate prepares one for a static "
                         f"cache) is not served; " + _accepted(window))
    if not isinstance(attention_mask, torch.Tensor):
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise ValueError(f"attention_mask: a {type(attention_mask).__name__} of shape {shape} is not a mask dsattn "
                         f"can honour; " + _accepted(window))
    shape = tuple(attention_mask.shape)
    if attention_mask.dim() == 2:
        if shape[0] != B or shape[1] < S:
            raise ValueError(f"attention_mask: expected [batch={B}, >= {S} tokens] (past and new tokens), got shape "
                             f"{shape}")
        if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError(f"attention_mask: the 2-D mask of shape {shape} holds values other than 0 and 1 (an "
                             f"additive mask?); a 2-D mask is a padding mask, 1 at tokens and 0 at padding")
        return attention_mask
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask: shape {shape} ({attention_mask.dim()}-D) is not a mask dsattn can honour; "
                         + _accepted(window))
    return _padding_of_causal_mask(attention_mask, B, S, cache, rows, window).to(x.device)


def _padding_of_causal_mask(mask, B: int, S: int, cache, rows, window):
    """The 2-D padding mask ``[B, past + S]`` of a 4-D mask that is exactly the model's own causal(+padding) mask for
    this call (``ValueError`` for any other): the key columns some query sees are the tokens, and the mask must be
    the causal (V4: sliding-window causal) band over the cache's positions AND those columns."""
    shape = tuple(mask.shape)
    if rows is not None:
        raise ValueError(f"attention_mask: a 4-D mask (shape {shape}) cannot continue a padded batch's cache; pass the "
                         f"batch's 2-D padding mask")
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        masked = torch.isneginf(mask) | (mask == torch.finfo(mask.dtype).min)
        if not bool((visible | masked).all()):
            raise ValueError(f"attention_mask: the 4-D mask of shape {shape} holds values other than 0 and -inf / the "
                             f"dtype's minimum (an attention bias), which dsattn cannot honour; " + _accepted(window))
    else:
        raise ValueError(f"attention_mask: a 4-D {mask.dtype} mask (shape {shape}) is neither a bool nor an additive "
                         f"float mask; " + _accepted(window))
    past = cache.get_seq_length() if cache is not None else 0
    # the key columns the model's own mask covers (transformers' cache get_mask_sizes): the whole past, or for V4's
    # sliding-window layers the last window - 1 past tokens once the window is full
    first = 0 if window is None else max(past - window + 1, 0)
    T = past + S - first
    if shape[0] not in (1, B) or shape[2] != S or shape[3] != T:
        raise ValueError(f"attention_mask: the 4-D mask has shape {shape}; the model's own mask for this call is "
                         f"[{B} or 1, 1, {S}, {T}] ({past} cached tokens); " + _accepted(window))
    q = torch.arange(past, past + S, device=mask.device)[:, None]
    k = torch.arange(first, first + T, device=mask.device)[None, :]
    band = k <= q
    if window is not None:
        band = band & (k > q - window)
    tokens = visible.any(dim=2).any(dim=1)                                           # [b, T]
    if not torch.equal(visible, (band & tokens[:, None, None, :]).expand(visible.shape)):
        raise ValueError(f"attention_mask: the 4-D mask of shape {shape} is not the model's own causal mask with key "
                         f"padding (e.g. a block-diagonal packed-sequence mask); " + _accepted(window))
    tokens = torch.cat([tokens.new_ones(tokens.shape[0], first), tokens], dim=1)
    return tokens.expand(B, -1).long()


def _padded_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                          inputs_embeds=None, use_cache=None, past_key_values=None, **kwargs):
    """DeepseekV4Model.forward; a padded batch (2-D ``attention_mask`` with zeros) runs row by row on each
    row's own tokens, positions and cache (module docstring).  Masks dsattn cannot honour raise first
    (:func:`_served_mask`)."""
    forward = getattr(self, _ORIGINAL)
    cache = cache if cache is not None else past_key_values
    rows = getattr(cache, _ROWS, None)
    x = input_ids if input_ids is not None else inputs_embeds
    if x is not None:                                 # (neither: the model's own forward says so)
        attention_mask = _served_mask(self, attention_mask, x, cache, rows, position_ids, use_cache)
    padded = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and \
        not bool(attention_mask.bool().all())
    if not padded and rows is None:
        return forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                       inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    from transformers import DynamicCache
    B, S = x.shape[:2]
    if attention_mask is None:
        attention_mask = torch.ones(B, S, dtype=torch.long, device=x.device)
    if attention_mask.dim() != 2 or attention_mask.size(0) != B or attention_mask.size(1) < S:
        raise ValueError(f"attention_mask: expected [batch={B}, >= {S} tokens] (past and new tokens), got shape "
                         f"{tuple(attention_mask.shape)}")
    use_cache = use_cache if use_cache is not None else self.config.use_cache
    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)
    if cache is not None:
        if rows is None:
            if cache.get_seq_length() > 0:
                raise ValueError("cache: it holds an unpadded batch's tokens; a padded batch starts on a fresh cache")
            rows = [None] * B
            setattr(cache, _ROWS, rows)
        if len(rows) != B:
            raise ValueError(f"cache: it serves a padded batch of {len(rows)} rows, got a batch of {B}")
    new = attention_mask[:, -S:].bool()
    hidden = None
    for b in range(B):
        keep = new[b]
        if not bool(keep.any()):
            continue
        row_cache = None
        if cache is not None:
            if rows[b] is None:
                rows[b] = (DynamicCache(config=self.config), 0)
            row_cache, seen = rows[b]
        else:
            seen = 0
        n = int(keep.sum())
        pos = torch.arange(seen, seen + n, device=x.device)[None]
        one = dict(input_ids=input_ids[b:b + 1, keep]) if input_ids is not None else \
            dict(inputs_embeds=inputs_embeds[b:b + 1, keep])
        out = forward(**one, attention_mask=None, position_ids=pos, cache=row_cache, use_cache=use_cache, **kwargs)
        if cache is not None:
            rows[b] = (row_cache, seen + n)
        h = out.last_hidden_state[0]
        if hidden is None:
            hidden = h.new_zeros((B, S) + tuple(h.shape[1:]))
        hidden = hidden.index_put((torch.full((n,), b, device=x.device), keep.nonzero()[:, 0]), h)
    if hidden is None:                               # (no row has a token in this call)
        hidden = torch.zeros(B, S, self.config.hidden_size, dtype=self.embed_tokens.weight.dtype, device=x.device)
    import sys
    return sys.modules[type(self).__module__].MoeModelOutputWithPast(last_hidden_state=hidden, cache=cache)


def _compressed_entries(comp, hidden_states, cache_layer, name: str, head_dim: int, overlap: bool):
    """The compressor's entries ``[B, T, head_dim]`` so far: the pooling through dsattn's ``compressor``
    (differentiable), then the model's ``kv_norm`` and rope, and the model's cache state kept current."""
    B, S, _ = hidden_states.shape
    r, D = comp.compress_rate, head_dim
    coff = 2 if overlap else 1
    ape = comp.position_bias.float()
    f32 = dict(dtype=torch.float32, device=hidden_states.device)
    if cache_layer is None:
        sp = 0
        state, table = torch.zeros(1, 1, 2 * coff * D, **f32), None
    else:
        sp, state, table = _compressor_history(comp, cache_layer, name, B, S, D, coff, ape)
    pooled = ops.compressor(hidden_states, comp.kv_proj.weight, comp.gate_proj.weight, state, ape, r,
                            state_block_table=table, start_pos=torch.full((B,), sp, dtype=torch.int32,
                                                                          device=hidden_states.device),
                            coff=coff, cache_mode=2)
    n = (sp + S) // r - sp // r
    if cache_layer is not None:
        _advance_model_cache(comp, cache_layer, name, hidden_states, D, overlap)
    if n > 0:
        compressed = comp.kv_norm(pooled[:, :n])
        positions = torch.arange(n, device=compressed.device) * r + (sp // r) * r
        cos, sin = comp.rotary_emb(compressed, position_ids=positions.unsqueeze(0).expand(B, -1),
                                   layer_type=comp.rope_layer_type)
        compressed = _model_module().apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    else:
        compressed = pooled.new_zeros((B, 0, D))
    if cache_layer is not None:
        compressed = cache_layer.update_compressor_states(name, compressed)
    return compressed


def _compressor_history(comp, cache_layer, name: str, B: int, S: int, D: int, coff: int, ape):
    """``(start_pos, state rows, cache_mode-2 table)`` for a cached call: the model's cache holds the
    raw projections of the trailing incomplete window (``buffer_kv`` / ``buffer_gate``, without
    ``position_bias``) and, with overlap, the last complete window's Ca half (``overlap_kv`` /
    ``overlap_gate``, bias included); they become the state rows of the history positions
    ``[start_pos - coff·r, start_pos)``.  The Cb half of the previous window is never read (it
    belongs to an entry already emitted), so those rows hold zeros there; new tokens are not
    written (table -1): the model's cache is advanced by the model's own bookkeeping."""
    r = comp.compress_rate
    dev = ape.device
    buf_kv, buf_gate = cache_layer.buffer_kv[name], cache_layer.buffer_gate[name]
    n_buf = 0 if buf_kv is None else buf_kv.shape[1]
    sp = cache_layer.entry_count[name] * r + n_buf
    hist = coff * r
    state = torch.zeros(B, hist, 2 * coff * D, dtype=torch.float32, device=dev)
    table = torch.full((B, hist + S), -1, dtype=torch.int32, device=dev)
    rows = torch.arange(B, device=dev)[:, None] * hist
    if n_buf:                                        # positions sp - n_buf .. sp - 1: the last columns
        pos = torch.arange(sp - n_buf, sp, device=dev)
        state[:, hist - n_buf:, :coff * D] = buf_kv.float()
        state[:, hist - n_buf:, coff * D:] = buf_gate.float() + ape[pos % r]
        table[:, hist - n_buf:hist] = (rows + torch.arange(hist - n_buf, hist, device=dev)).to(torch.int32)
    prior_kv = cache_layer.overlap_kv.get(name) if coff == 2 else None
    if prior_kv is not None:                         # the previous complete window: its Ca half
        cols = slice(hist - n_buf - r, hist - n_buf)
        state[:, cols, :D] = prior_kv.float()
        state[:, cols, coff * D:coff * D + D] = cache_layer.overlap_gate[name].float()
        table[:, cols] = (rows + torch.arange(hist - n_buf - r, hist - n_buf, device=dev)).to(torch.int32)
    return sp, state, table


def _advance_model_cache(comp, cache_layer, name: str, hidden_states, D: int, overlap: bool):
    """The model's own cache bookkeeping for this call (buffer of the incomplete window, the overlap
    state), so that the cache stays what the model's compressor would have left."""
    kv, gate = comp.kv_proj(hidden_states), comp.gate_proj(hidden_states)
    chunk_kv, chunk_gate, _ = cache_layer.store_compression_weights(name, kv, gate)
    if overlap and chunk_kv.shape[1] > 0:
        B, r = hidden_states.shape[0], comp.compress_rate
        chunk_kv = chunk_kv.view(B, -1, r, chunk_kv.shape[-1])
        chunk_gate = chunk_gate.view(B, -1, r, chunk_gate.shape[-1]) + comp.position_bias
        cache_layer.update_overlap_state(name, chunk_kv, chunk_gate, D)


def _indexer_inputs(indexer, hidden_states, q_residual, position_ids):
    """The CSA indexer's roped queries ``[B, S, Hi, d]`` (fp32) and weights ``[B, S, Hi]`` (fp32): its
    weights are ``weights_proj(h) · index_n_heads**-0.5 · index_head_dim**-0.5`` (the model's two
    positive scales commute with the ReLU)."""
    M = _model_module()
    B, S, _ = hidden_states.shape
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(B, S, -1, indexer.head_dim).transpose(1, 2)
    q = M.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)                          # [B, S, Hi, d]
    scorer = indexer.scorer
    w = scorer.weights_proj(hidden_states).float() * (scorer.weights_scaling * scorer.softmax_scale)
    return q.float(), w


def _topk(indexer, q, w, keys, resid):
    """The CSA indexer's top-k list ``[B, S, 1, topk]`` through ``lightning_indexer`` (-1 past the
    causally visible entries)."""
    with torch.no_grad():                             # the model's indexer is not differentiable either
        idx, _ = ops.lightning_indexer(q.contiguous(), keys.float().unsqueeze(2).contiguous(), w.contiguous(),
                                       indexer.index_topk, cmp_residual_k=resid, mask_mode=3,
                                       cmp_ratio=indexer.compress_rate)
    return idx


class IndexerKLLoss(torch.autograd.Function):
    """The indexer's auxiliary loss of spec 10 §2.5, ``Σ_t -Σ_s p[t,s] · log y[t,s]`` with the teacher
    ``p`` (already scaled by the loss weight) a constant: its forward runs
    ``sparse_lightning_indexer_kl_loss_grad`` once, which gives both the indexer's softmax ``y`` (for
    the value) and the gradients (kept for the backward, scaled by the incoming gradient)."""

    @staticmethod
    def forward(ctx, q, keys, w, idx, p, resid, ratio: int):
        dq, dk, dw, y = ops.sparse_lightning_indexer_kl_loss_grad(
            q, keys, w, idx, p, cmp_residual_k=resid, layout_q="BSND", layout_k="BSND", mask_mode=3,
            cmp_ratio=ratio)
        ctx.save_for_backward(dq, dk, dw)
        # valid slots have y > 0 unless it underflows; a slot without teacher mass adds nothing
        tiny = torch.finfo(y.dtype).tiny
        return -torch.where(p != 0, p * torch.log(y.clamp_min(tiny)), torch.zeros((), dtype=y.dtype)).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dq, dk, dw = ctx.saved_tensors
        return grad * dq, grad * dk, grad * dw, None, None, None, None


def _indexer_kl(q, out, lse, kw, q_ind, keys, w_ind, resid, ratio: int, weight: float):
    """This layer's indexer KL term (spec 10 §3): the teacher is the attention's own probability mass
    at each selected slot, ``cmp_softmax_l1_norm`` of ``sparse_flash_mla_grad`` (computed here with a
    zero output gradient, so the term's value exists in the forward), scaled by ``weight`` over the
    number of query tokens; a constant to the loss."""
    with torch.no_grad():
        detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out_d = out.detach()
        p = npu_sparse_flash_mla_grad(q.detach(), torch.zeros_like(out_d), out_d, lse, **detached)[5]
        p = p * (weight / (q.shape[0] * q.shape[1]))
    return IndexerKLLoss.apply(q_ind, keys.float().unsqueeze(2), w_ind, kw["cmp_sparse_indices"], p, resid, ratio)


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
    kl_weight = None
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
            kl_weight = getattr(self, _KL_WEIGHT, None) if torch.is_grad_enabled() else None
            # the indexer only selects (no gradient reaches the model through it): with the KL loss on, its
            # inputs are detached so that the loss trains the indexer alone (spec 10 §3)
            h_ind, q_res_ind = ((hidden_states.detach(), q_residual.detach()) if kl_weight is not None
                                else (hidden_states, q_residual))
            keys = _compressed_entries(ind, h_ind, cache_layer, "indexer", ind.head_dim, overlap=True)
            q_ind, w_ind = _indexer_inputs(ind, h_ind, q_res_ind, position_ids)
            resid_ind = (total - keys.shape[1] * ind.compress_rate).to(torch.int32)
            kw["cmp_sparse_indices"] = _topk(ind, q_ind, w_ind, keys, resid_ind)
    out, lse = npu_sparse_flash_mla(q.transpose(1, 2), return_softmax_lse=kl_weight is not None,
                                    **kw)                        # [B, S, H, D]; differentiable (training)
    if kl_weight is not None:
        setattr(self, _KL_VALUE, _indexer_kl(q.transpose(1, 2), out, lse, kw, q_ind, keys, w_ind, resid_ind,
                                             ind.compress_rate, kl_weight))
    # undo the rope the shared K = V put on the output's rope slice (at the query position)
    attn_output = M.apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = self.o_a_proj(attn_output.reshape(B, S, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped), None
