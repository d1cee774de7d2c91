"""transformers' DSA models -- DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5.x (``GlmMoeDsaForCausalLM``,
IndexShare and interleaved indexer RoPE) -- on dsattn's indexer and sparse MLA (through
:func:`dsattn.integrations.transformers.enable`).

The model's attention is dense: its indexer scores every (query, key) pair of every indexer head
(``[B, S, H_i, T]``), the top-k is scattered into a boolean mask ``[B, 1, S, T]``, and eager / SDPA attention
runs over keys and values expanded per head from the latent (``kv_b_proj``): at V3.2's widths a 32K prompt's
scores alone are 512 GB a layer.  Here instead, with the model's own parameters and cache objects:

* the indexer selects through ``lightning_indexer`` (``mask_mode`` 3, r = 1): queries ``wq_b(q_resid)`` and keys
  ``k_norm(wk(h))`` roped as the model ropes them (half-split for V3.2, interleaved for GLM-5), the keys kept in
  the model's cache (``update_indexer``), weights ``weights_proj(h) · n_heads**-0.5 · head_dim**-0.5`` (the
  softmax scale is positive: it commutes with the ReLU).  No ``[S, T]`` score tensor is kept;
* attention is ``sparse_flash_mla`` over the latent, one KV head of ``kv_lora_rank + qk_rope_head_dim`` (576):
  ``kv_b_proj`` is absorbed into the query (``q_nope · W_UK`` per head) and the output (``· W_UV``), keys are the
  cached normalised latent and roped ``k_rot``, the value the latent part of the key.  The selection is the
  operator's cmp branch at ratio 1 (``cmp_sparse_indices`` = the indexer's list, ``cmp_mask_mode`` 3).  The
  operator always has an ori branch (spec 20 §2.2), a band that here covers one key, the query's own position of a
  per-query ``ori_kv``: that row is one key of the query's own list (its own token when listed, else the list's
  first), and its slot in the cmp list is skipped (an index past the visible bound).  So each query attends exactly
  its list, as the model does;
* the query rows run in chunks (``QUERY_CHUNK``): absorbed queries and outputs of a 32K prompt at V3.2's 128 heads
  would be several GB each;
* GLM-5's shared layers (``indexer_types`` "shared") reuse the previous full layer's list and run no indexer.

Prefill, ``generate`` (the model's ``DynamicCache``), padded batches (run as their rows alone, as for
DeepSeek-V4: :func:`dsattn.integrations.transformers._padded_model_forward`) and training (``sparse_flash_mla``
is differentiable in q and the KV; the indexer, as the model's, selects without a gradient) are served.  The masks
served are V4's (:func:`dsattn.integrations.transformers._served_mask`): None, the 2-D padding mask and the model's
own 4-D causal mask with key padding; any other (a packed-sequence mask, a 3-D one) raises ``ValueError``.

transformers' attention-function registry is not enough for these models: it receives keys and values already
expanded per head, after the dense indexer ran.  So ``attn_implementation="dsattn"`` (registered by
:func:`dsattn.integrations.transformers.register`) only drops the dense ``[S, T]`` mask; :func:`enable` swaps the
attention modules' forwards.
"""
from __future__ import annotations

import importlib

import torch

from .. import ops
from ..hyper_parallel import npu_sparse_flash_mla

# The oldest transformers the integration serves (pyproject's ``hf`` extra): the first release with every model class
# it swaps forwards in -- DeepseekV4Attention, DeepseekV32Attention, GlmMoeDsaAttention and Glm5NextTextAttention
# (5.16 has the first three; Glm5Next, GLM-5.3-Flash, arrives in 5.17).  The integration replaces transformers'
# private forwards, so it also has a tested ceiling: pyproject's ``<`` bound.
TRANSFORMERS_FLOOR = "5.17"


def check_transformers_version() -> None:
    """Raise ``ImportError`` naming the installed and the needed version when transformers is older than
    :data:`TRANSFORMERS_FLOOR` (or missing).  Run at import of the integration and by ``enable``; reads
    ``transformers.__version__`` (the version actually imported, also for a source checkout)."""
    need = f"dsattn's transformers integration needs transformers >= {TRANSFORMERS_FLOOR}"
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{need} (not installed): pip install 'dsattn[hf]'") from e
    from packaging.version import InvalidVersion, Version
    installed = getattr(transformers, "__version__", None)
    try:
        ok = installed is not None and Version(str(installed)) >= Version(TRANSFORMERS_FLOOR)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ImportError(f"{need} (installed: {installed}): pip install -U 'dsattn[hf]'")


check_transformers_version()

QUERY_CHUNK = 2048                     # query rows a sparse_flash_mla call takes
_SKIP = torch.iinfo(torch.int32).max   # a list slot the walk skips (past any visible bound)


# family: (transformers module, attention class, base model class, indexer rope interleaved (None: no rope),
#          the attention forward)
FAMILIES = {
    "deepseek_v32": ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Attention",
                     "DeepseekV32Model", False, "v32"),
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaAttention",
                    "GlmMoeDsaModel", True, "glm"),
    "glm5_next": ("transformers.models.glm5_next.modeling_glm5_next", "Glm5NextTextAttention",
                  "Glm5NextTextModel", None, "glm5_next"),
}


def _module(family):
    return importlib.import_module(FAMILIES[family][0])


def family_of(model) -> str | None:
    """The DSA family whose attention modules ``model`` holds, or None."""
    for family, (path, attn, _, _, _) in FAMILIES.items():
        try:
            cls = getattr(importlib.import_module(path), attn)
        except (ImportError, AttributeError):
            continue
        if any(isinstance(m, cls) for m in model.modules()):
            return family
    return None


def attention_modules(model, family):
    cls = getattr(_module(family), FAMILIES[family][1])
    return [m for m in model.modules() if isinstance(m, cls)]


def base_models(model, family):
    cls = getattr(_module(family), FAMILIES[family][2])
    return [m for m in model.modules() if isinstance(m, cls)]


def check_config(model, family) -> None:
    """What the dsattn path assumes of the config, checked before any weight is touched."""
    cfg = getattr(model.config, "text_config", model.config)
    if getattr(cfg, "q_lora_rank", None) is None:
        raise ValueError(f"config.q_lora_rank: None (no q LoRA) is not supported by dsattn's {family} attention; "
                         "every released DSA model has one")
    if getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) != cfg.num_attention_heads:
        raise ValueError(f"config.num_key_value_heads: {cfg.num_key_value_heads} != num_attention_heads "
                         f"{cfg.num_attention_heads}; MLA expands its one latent to every head")
    if family == "glm_moe_dsa":
        types = list(getattr(cfg, "indexer_types", None) or [])
        if types and types[0] != "full":
            raise ValueError(f"config.indexer_types: the first layer is {types[0]!r}; a shared layer needs a full "
                             "layer before it")
    if family == "glm5_next":
        layers, types = list(cfg.layer_types), list(cfg.indexer_types)
        for i, (kind, share) in enumerate(zip(layers, types)):
            if kind == "indexed_attention" and share == "shared" and \
                    (i == 0 or layers[i - 1] != "indexed_attention" or types[i - 1] != "full"):
                raise ValueError(f"config.indexer_types: layer {i} is 'shared' but layer {i - 1} is not a full "
                                 "indexed-attention layer (its list would not reach it)")
        if cfg.qk_rope_head_dim != 0:
            raise ValueError(f"config.qk_rope_head_dim: {cfg.qk_rope_head_dim}; GLM-5.3-Flash's sparse layers have "
                             "no rope (0)")


def enable_modules(model, family, forward_key: str, padded_forward) -> None:
    """Swap the attention and base-model forwards (keeping the originals under ``forward_key``)."""
    import types
    forward = {"v32": _v32_forward, "glm": _glm_forward, "glm5_next": _glm5_next_forward}[FAMILIES[family][4]]
    for m in attention_modules(model, family):
        if not hasattr(m, forward_key):
            setattr(m, forward_key, m.forward)
            m.forward = types.MethodType(forward, m)
            m._dsattn_family = family
    for m in base_models(model, family):
        if not hasattr(m, forward_key):
            setattr(m, forward_key, m.forward)
            m.forward = types.MethodType(padded_forward, m)


def disable_modules(model, family, forward_key: str) -> None:
    for m in attention_modules(model, family) + base_models(model, family):
        if hasattr(m, forward_key):
            m.forward = getattr(m, forward_key)
            delattr(m, forward_key)


# ---- the indexer ----

def indexer_topk(module, indexer, hidden_states, q_resid, position_embeddings, cache):
    """The layer's list ``[B, S, 1, index_topk]`` int32 (batch-local key positions, -1 past the visible keys)
    through ``lightning_indexer``."""
    family = module._dsattn_family
    M = _module(family)
    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope = indexer.qk_rope_head_dim
    with torch.no_grad():                        # (the model's indexer is no_grad too: it only selects)
        q = indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim)
        q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
        k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
        ropes = M.apply_rotary_pos_emb_interleave if FAMILIES[family][3] else M.apply_rotary_pos_emb
        q_rot, k_rot = ropes(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        if cache is not None:
            k = cache.update_indexer(k, indexer.layer_idx)
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (indexer.n_heads ** -0.5 * indexer.softmax_scale)
        idx, _ = ops.lightning_indexer(q.float().contiguous(), k.float().unsqueeze(2).contiguous(), w.contiguous(),
                                       indexer.index_topk, mask_mode=3)
    return idx


def kpool_topk(indexer, hidden_states, q_resid, attention_mask, cache):
    """GLM-5.3-Flash's list ``[B, S, 1, K]`` (K = ``index_topk`` rounded down to pools, plus ``index_kpool - 1``
    tail slots; the valid token positions first, -1 after): each ``index_kpool`` tokens pooled by the gated
    softmax over their gate scores plus the position embedding (the model's pooling, elementwise on its cached
    keys and gates), the complete pools whose last token the query sees ranked by ``lightning_indexer``
    (``cmp_ratio`` = the pool, ``mask_mode`` 3: pool j is visible from position p iff (j + 1) · pool <= p + 1),
    the ``index_topk // index_kpool`` best expanded to their tokens, then the open tail (the query's incomplete
    pool) appended.  Rows run alone (padded batches are split into their rows), so pooling starts at token 0."""
    B, S, _ = hidden_states.shape
    D, r = indexer.head_dim, indexer.index_kpool
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(B, S, -1, D)
        k = indexer.k_norm(indexer.wk(hidden_states)).view(B, S, D)
        gate = torch.nn.functional.linear(hidden_states, indexer.index_kpool_compress_gate)
        valid = (torch.ones(B, S, dtype=k.dtype, device=k.device) if attention_mask is None
                 else attention_mask.to(k.dtype))[..., None]
        packed = torch.cat([k, gate, valid], dim=-1)          # (the model's cache layout: eager can continue it)
        if cache is not None:
            packed = cache.update_indexer(packed, indexer.layer_idx)
        T = packed.shape[1]
        P = T // r
        keys = packed[:, :P * r, :D].view(B, P, r, D)
        logits = packed[:, :P * r, D:2 * D].view(B, P, r, D).float() + indexer.index_kpool_compress_ape.float()
        pooled = (logits.softmax(dim=2).to(keys.dtype) * keys).sum(dim=2)          # [B, P, D]
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (indexer.n_heads ** -0.5 * indexer.softmax_scale)
        kp = indexer.index_topk // r
        if P > 0:
            pools, _ = ops.lightning_indexer(q.float().contiguous(), pooled.float().unsqueeze(2).contiguous(),
                                             w.contiguous(), kp, mask_mode=3, cmp_ratio=r,
                                             cmp_residual_k=torch.full((B,), T % r, dtype=torch.int32,
                                                                       device=q.device))
        else:
            pools = torch.full((B, S, 1, kp), -1, dtype=torch.int32, device=q.device)
        pools = pools.to(torch.int64)
        span = torch.arange(r, device=q.device)
        tokens = torch.where(pools[..., None] >= 0, pools[..., None] * r + span, -1).flatten(-2)   # [B, S, 1, kp·r]
        if indexer.index_kpool_always_select_tail and r > 1:
            p = torch.arange(T - S, T, device=q.device)
            count = (p + 1) % r
            tail = (p + 1 - count)[:, None] + span[:-1]
            tail = torch.where(span[:-1] < count[:, None], tail, -1)
            tokens = torch.cat([tokens, tail[None, :, None].expand(B, S, 1, r - 1)], dim=-1)
        order = torch.sort((tokens < 0).to(torch.int8), dim=-1, stable=True).indices   # (-1 ends a list)
        return tokens.gather(-1, order).to(torch.int32)


# ---- the attention ----

def _own_key_first(idx, kv, positions):
    """``(ori_kv [B, S, 1, D], cmp list)``: each query's ori row is one key of its list -- its own position when
    listed, else the list's first slot -- and that slot is skipped in the cmp list (module docstring)."""
    B, S, _, K = idx.shape
    lst = idx[:, :, 0].to(torch.int64)                                   # [B, S, K]
    own = lst == positions[None, :, None]
    has_own = own.any(-1)
    slot = torch.where(has_own, own.to(torch.int8).argmax(-1), torch.zeros_like(has_own, dtype=torch.int64))
    key = torch.where(has_own, positions[None, :].expand(B, S), lst[:, :, 0].clamp_min(0))
    rows = torch.arange(B, device=kv.device)[:, None]
    ori_kv = kv[rows, key].unsqueeze(2)                                  # [B, S, 1, D] (a gather: differentiable)
    cmp = idx.clone()
    cmp[:, :, 0].scatter_(-1, slot[..., None], _SKIP)
    return ori_kv, cmp


def sparse_mla(module, q_pass, q_rot, k_pass, k_rot, idx):
    """``sparse_flash_mla`` over the latent: q_pass ``[B, S, H, nope]``, q_rot ``[B, S, H, rope]`` (roped),
    k_pass ``[B, T, kv_lora_rank]``, k_rot ``[B, T, rope]`` -> the heads' outputs ``[B, S, H, v_head_dim]``."""
    B, S, H, _ = q_pass.shape
    T = k_pass.shape[1]
    c = module.kv_lora_rank
    w = module.kv_b_proj.weight.view(H, module.qk_nope_head_dim + module.v_head_dim, c)
    w_uk, w_uv = w[:, :module.qk_nope_head_dim], w[:, module.qk_nope_head_dim:]
    kv = torch.cat([k_pass, k_rot], dim=-1)                               # [B, T, 576]
    outs = []
    for s0 in range(0, S, QUERY_CHUNK):
        s1 = min(S, s0 + QUERY_CHUNK)
        visible = T - S + s1                  # keys the chunk's last row sees (the cmp bound: right-aligned)
        q = torch.cat([torch.einsum("bshn,hnc->bshc", q_pass[:, s0:s1], w_uk), q_rot[:, s0:s1]], dim=-1)
        positions = torch.arange(T - S + s0, visible, device=q.device)
        ori_kv, cmp = _own_key_first(idx[:, s0:s1], kv, positions)
        out, _ = npu_sparse_flash_mla(q.contiguous(), ori_kv=ori_kv.to(q.dtype).contiguous(),
                                      cmp_kv=kv[:, :visible].unsqueeze(2).to(q.dtype),
                                      cmp_sparse_indices=cmp.contiguous(),
                                      cmp_residual_kv=torch.zeros(B, dtype=torch.int32, device=q.device),
                                      softmax_scale=module.scaling, cmp_ratio=1, ori_mask_mode=4, ori_win_left=0,
                                      ori_win_right=0, cmp_mask_mode=3, layout="BSND")
        outs.append(torch.einsum("bshc,hvc->bshv", out[..., :c], w_uv))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _attention(self, hidden_states, position_embeddings, cache, prev_topk_indices, attention_mask=None):
    """(output before ``o_proj`` ``[B, S, H · v]``, the layer's list); ``position_embeddings`` None: no rope
    (GLM-5.3-Flash)."""
    M = _module(self._dsattn_family)
    B, S = hidden_states.shape[:2]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(B, S, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim],
                                 dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(B, 1, S, self.kv_lora_rank)
    k_rot = k_rot.view(B, 1, S, self.qk_rope_head_dim)
    if position_embeddings is not None:
        cos, sin = position_embeddings
        q_rot, k_rot = M.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)   # (the model's own rope)
    if cache is not None:
        k_pass, k_rot = cache.update(k_pass, k_rot, self.layer_idx)
    indexer = getattr(self, "indexer", None)
    if indexer is not None and position_embeddings is None:
        idx = kpool_topk(indexer, hidden_states, q_resid, attention_mask, cache)
    elif indexer is not None:
        idx = indexer_topk(self, indexer, hidden_states, q_resid, position_embeddings, cache)
    elif prev_topk_indices is None:
        raise ValueError("prev_topk_indices: a shared DSA layer needs the list of a full indexer layer before it")
    else:
        idx = prev_topk_indices
    out = sparse_mla(self, q_pass.transpose(1, 2), q_rot.transpose(1, 2), k_pass[:, 0], k_rot[:, 0], idx)
    return out.reshape(B, S, -1), idx


def _v32_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, position_ids=None,
                 past_key_values=None, **kwargs):
    """DeepseekV32Attention.forward on dsattn's operators (module docstring)."""
    out, _ = _attention(self, hidden_states, position_embeddings, cache if cache is not None else past_key_values,
                        None)
    return self.o_proj(out), None


def _glm_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, position_ids=None,
                 prev_topk_indices=None, past_key_values=None, **kwargs):
    """GlmMoeDsaAttention.forward on dsattn's operators; returns the layer's list for the shared layers after it
    (dsattn's ``[B, S, 1, K]`` form, which only these forwards read)."""
    out, idx = _attention(self, hidden_states, position_embeddings,
                          cache if cache is not None else past_key_values, prev_topk_indices)
    return self.o_proj(out), None, idx


def _glm5_next_forward(self, hidden_states, attention_mask=None, cache=None, prev_topk_indices=None,
                       past_key_values=None, **kwargs):
    """Glm5NextTextAttention.forward on dsattn's operators (no rope; KPool indexer); as the model, returns its list
    only when the next layer shares it."""
    out, idx = _attention(self, hidden_states, None, cache if cache is not None else past_key_values,
                          prev_topk_indices, attention_mask)
    return self.o_proj(out), None, idx if self.next_skip_topk else None
