"""The one place per family that picks the backend: each backend's reasons not to take a call."""
import torch

from dsattn import native
from dsattn.indexer import dispatch as indexer_dispatch
from dsattn.indexer.op import _indexer_parse
from dsattn.sparse_mla import dispatch as mla_dispatch
from dsattn.sparse_mla.problem import parse_mla


def _mla(dtype):
    return parse_mla(torch.randn(1, 2, 16, 64).to(dtype), ori_kv=torch.randn(1, 4, 1, 64).to(dtype))


def test_a_cpu_call_says_why_triton_does_not_take_it():
    why = dict(mla_dispatch.explain(_mla(torch.bfloat16)))
    assert why["triton"] == ["cpu tensors do not run Triton (DSATTN_BACKEND and the device decide)"]
    assert why["torch"] == []


def test_float64_queries_go_to_pytorch_with_the_reason():
    P = _mla(torch.float64)
    why = dict(mla_dispatch.explain(P))
    assert why["compiled"] == ["query dtype torch.float64 (it takes bfloat16, float16, float32)"]
    assert mla_dispatch.choose(P).name == "torch" and mla_dispatch.choose(P, grad=True).name == "torch"


def test_the_flash_opt_in_and_an_unbuilt_layer_are_reasons(monkeypatch):
    import dsattn
    dsattn.set_flash_attention(True)
    try:
        assert "the flash rounding opt-in is on (dsattn.set_flash_attention)" in \
            dict(mla_dispatch.explain(_mla(torch.bfloat16)))["compiled"]
    finally:
        dsattn.set_flash_attention(False)
    with native.suspended():
        P, _, _ = _indexer_parse(torch.randn(1, 1, 16, 64).bfloat16(), torch.randn(1, 4, 1, 64).bfloat16(),
                                 torch.randn(1, 1, 16), 2, {}, True)
        assert dict(indexer_dispatch.explain(P))["compiled"] == [native.status()]
        assert ("suspended" if native.requested() else "DSATTN_NATIVE=0") in native.status()
        assert indexer_dispatch.choose(P).name == "torch"


def test_the_compiled_backend_takes_a_bf16_cpu_call_where_it_is_built(native_module):
    if native_module is None:
        import pytest
        pytest.skip(f"no compiled layer here: {native.status()}")
    assert mla_dispatch.choose(_mla(torch.bfloat16)).name == "compiled"
