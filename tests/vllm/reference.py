"""transformers' eager model as the reference for the vLLM runs (same weights, fp32)."""
from contextlib import contextmanager

import torch

from dsattn.quant.flashmla import V32, dequantize_cache, quantize_cache
from dsattn.quant.index_keys import dequantize_index_keys, quantize_index_keys


def hf_greedy(model_dir, prompts, max_tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    res = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        toks = out.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(l[0].float(), -1) for l in out.logits]
        res.append(dict(tokens=toks, logprobs=[lp[t].item() for lp, t in zip(lps, toks)],
                        top5=[lp.topk(5).indices.tolist() for lp in lps]))
    return res


@contextmanager
def fp8_cache_rounding():
    """transformers' caches hold what vLLM's ``fp8_ds_mla`` caches hold: the latent rows FlashMLA's
    656-byte format keeps (FP8 tiles with power-of-two scales, the rope part in bf16) and the
    indexer keys in FP8 with one fp32 scale per token."""
    from transformers.cache_utils import DynamicIndexedLayer
    update, update_indexer = DynamicIndexedLayer.update, DynamicIndexedLayer.update_indexer

    def rounded_update(self, key_states, value_states, *args, **kwargs):
        # key: the normalised latent [B, 1, S, 512]; value: the roped k_pe [B, 1, S, 64]
        rows = torch.cat([key_states, value_states], -1).reshape(-1, 1, 1, 576).to(torch.bfloat16)
        back = dequantize_cache(quantize_cache(rows, V32), torch.float32).reshape(*key_states.shape[:-1], 576)
        return update(self, back[..., :512].to(key_states.dtype), back[..., 512:].to(value_states.dtype),
                      *args, **kwargs)

    def rounded_indexer(self, k):
        values, scales = quantize_index_keys(k.reshape(-1, k.size(-1)).float())
        return update_indexer(self, dequantize_index_keys(values, scales).to(k.dtype).view_as(k))

    DynamicIndexedLayer.update, DynamicIndexedLayer.update_indexer = rounded_update, rounded_indexer
    try:
        yield
    finally:
        DynamicIndexedLayer.update, DynamicIndexedLayer.update_indexer = update, update_indexer
