"""The plug-in's torch versions of vLLM's DeepSeek-V4 metadata kernels against vLLM's own Triton kernel
source, run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``): ragged random batches, every
output buffer pre-filled with a sentinel so a missed or stray write shows."""
import types

import pytest
import torch

triton = pytest.importorskip("triton")

from dsattn.integrations.vllm import v4_metadata as ports  # noqa: E402

SENTINEL = -7


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def interpreted(fn):
    """vLLM's kernel (a plain function where vLLM found no Triton backend) under the real Triton's
    interpreter: the same code, its module's ``tl`` / ``triton`` and nested helpers rebound."""
    import triton.language as tl
    fn = getattr(fn, "fn", fn)
    g = dict(fn.__globals__, tl=tl, triton=triton)
    for name, v in list(g.items()):
        if isinstance(v, types.FunctionType) and v.__module__ == fn.__module__:
            g[name] = types.FunctionType(v.__code__, g, v.__name__, v.__defaults__)
    f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__)
    f.__module__ = fn.__module__
    return triton.jit(f)


def batch(seed, num_reqs=5, max_q=9, max_prefix=40, block_size=8):
    """A ragged batch: decodes (query 1) first, then prefills; a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.cat([torch.ones(2, dtype=torch.int64), torch.randint(1, max_q, (num_reqs - 2,), generator=g)])
    prefix = torch.randint(0, max_prefix, (num_reqs,), generator=g)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    seq = (prefix + q_lens).to(torch.int32)
    width = (int(seq.max()) + block_size - 1) // block_size + 1
    table = torch.randperm(2 * num_reqs * width, generator=g)[:num_reqs * width].view(num_reqs, width).to(torch.int32)
    return qsl, seq, table, g


def full(n, *shape, dtype=torch.int32):
    return torch.full((n, *shape), SENTINEL, dtype=dtype)


@pytest.mark.parametrize("seed", range(3))
def test_token_request_mapping(seed):
    from vllm.v1.attention.ops import metadata as M
    qsl, _, _, _ = batch(seed)
    T = int(qsl[-1])
    for mapped, tokens in ((T, T), (T, T + 5), (T - 2, T)):
        want, got = full(T + 8), full(T + 8)
        interpreted(M._token_request_mapping_kernel)[(triton.cdiv(tokens, 256),)](qsl, want, 5, mapped, tokens)
        ports.token_request_mapping(qsl, got, 5, mapped, tokens, num_warps=4)
        assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(3))
def test_swa_indices_and_lens(seed):
    from vllm.v1.attention.backends.mla import sparse_swa as S
    qsl, seq, table, g = batch(seed)
    T = int(qsl[-1])
    t2r = torch.repeat_interleave(torch.arange(5, dtype=torch.int32), (qsl[1:] - qsl[:-1]).long())
    valid = torch.rand(T, generator=g) > 0.1
    replay = torch.randint(0, 6, (6,), generator=g).to(torch.int32)
    W, width, bs = 6, 9, 8
    for offset, n in ((0, 2), (2, T - 2)):
        want, got = full(n, 1, width), full(n, 1, width)
        lw, lg = full(n), full(n)
        interpreted(S._compute_swa_indices_and_lens_kernel)[(n,)](
            want, want.stride(0), lw, W, width, lw, lw, qsl, seq, t2r, valid, table, table.stride(0), bs, replay,
            offset, HAS_IMAGE=False, TRITON_BLOCK_SIZE=16)
        ports.swa_indices_and_lens(got, lg, W, width, lg, lg, qsl, seq, t2r, valid, table, bs, replay,
                                   num_tokens=n, token_offset=offset)
        assert torch.equal(lg, lw) and torch.equal(got, want)


@pytest.mark.parametrize("seed", range(3))
def test_prefill_gather_lens(seed):
    from vllm.v1.attention.backends.mla import sparse_swa as S
    qsl, seq, _, g = batch(seed)
    replay = torch.randint(0, 6, (5,), generator=g).to(torch.int32)
    want, got = full(8), full(8)
    interpreted(S.ComputePrefillMetadataKernel.kernel)[(1,)](want, seq, qsl, replay, 3, 2, 6, BLOCK_SIZE=4)
    ports.prefill_gather_lens(got, seq, qsl, replay, 3, 2, 6)
    assert torch.equal(got, want)


@pytest.mark.parametrize("ratio", (4, 128))
@pytest.mark.parametrize("seed", range(3))
def test_compressed_slot_mapping(seed, ratio):
    from vllm.v1.attention.backends.mla import compressor_utils as C
    qsl, seq, table, g = batch(seed, max_prefix=600 if ratio == 128 else 40)
    seq = seq * (ratio // 4 if ratio > 4 else 1)
    T = int(qsl[-1])
    slots = torch.randint(0, 1000, (T,), generator=g)
    slots[torch.rand(T, generator=g) < 0.2] = -1
    bs = 2 if ratio == 128 else 4
    want, got = full(T + 3, dtype=torch.int64), full(T + 3, dtype=torch.int64)
    interpreted(C.CompressedSlotMappingKernel.kernel)[(5,)](
        want, slots, qsl, seq, table, table.stride(0), bs, 1, 1, COMPRESS_RATIO=ratio, PAD_ID=-1, TRITON_BLOCK_SIZE=16)
    ports.compressed_slot_mapping(got, slots, qsl, seq, table, bs, ratio, 1, 1)
    assert torch.equal(got, want)


def indexer_decode_loop(qsl, seq, table, out_lens, out_table, decode_lens, indices, per_req, reqs, tokens, cap):
    """``_indexer_decode_metadata_kernel`` transcribed one program at a time (Triton's interpreter cannot
    run it: a scalar-and-vector load mask)."""
    actual = int(qsl[reqs])
    grid = max(reqs, tokens + triton.cdiv(cap - tokens, 256))
    for token in range(grid):
        if token < tokens:
            req = min(sum(1 for r in range(reqs) if int(qsl[r + 1]) <= token), reqs - 1)
            valid = token < actual
            start, end = int(qsl[req]), int(qsl[req + 1])
            out_lens[token] = int(seq[req]) - (end - start) + token - start + 1 if valid else 0
            decode_lens[token] = 1
            indices[token] = req if valid else reqs + token - actual
            out_table[token, :table.shape[1]] = table[req] if valid else 0
        else:
            tail = tokens + (token - tokens) * 256
            out_lens[tail:min(tail + 256, cap)] = 0
        if token < reqs:
            per_req[token] = int(qsl[token + 1]) - int(qsl[token])


@pytest.mark.parametrize("seed", range(3))
def test_indexer_decode_metadata(seed):
    qsl, seq, table, _ = batch(seed)
    reqs, tokens, cap = 3, int(qsl[3]) + 2, 40
    w = [full(cap), full(tokens + 2, table.shape[1] + 2), full(cap), full(cap), full(8)]
    o = [t.clone() for t in w]
    indexer_decode_loop(qsl, seq, table, *w, reqs, tokens, cap)
    ports.indexer_decode_metadata(qsl, seq, table, o[0], o[1], o[2], o[3], o[4], reqs, tokens, cap, table.stride(0),
                                  o[1].stride(0), BLOCK_COLS=table.shape[1], num_warps=4)
    for a, b in zip(o, w):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(3))
def test_uniform_decode(seed):
    from vllm.v1.attention.backends.mla import indexer as I
    _, seq, table, _ = batch(seed)
    n, mdl = 6, 2
    w = [full(8), full(8, table.shape[1]), full(8)]
    o = [t.clone() for t in w]
    interpreted(I.PrepareUniformDecodeKernel.kernel)[(n,)](seq, w[0], table, table.stride(0), w[1], w[1].stride(0),
                                                           w[2], mdl, BLOCK_SIZE=16)
    ports.uniform_decode(seq, o[0], table, o[1], o[2], n, mdl)
    for a, b in zip(o, w):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ratio", (1, 4))
@pytest.mark.parametrize("seed", range(3))
def test_prefill_chunk_metadata(seed, ratio):
    from vllm.v1.attention.backends.mla import indexer as I
    qsl, seq, _, _ = batch(seed)
    compressed = (seq // ratio).to(torch.int32)
    cu = torch.zeros(6, dtype=torch.int32)
    cu[1:] = compressed.cumsum(0)
    T = int(qsl[-1])
    for start, stop in ((0, T), (1, T - 1)):
        w = [full(int(cu[-1]) + 3), full(stop - start), full(stop - start)]
        o = [t.clone() for t in w]
        interpreted(I.BuildPrefillChunkMetadataKernel.kernel)[(5,)](
            qsl, seq, cu, cu, w[0], w[1], w[2], start, stop, 0, 1, 1, BLOCK_SIZE=16, COMPRESS_RATIO=ratio)
        ports.prefill_chunk_metadata(qsl, seq, cu, cu, o[0], o[1], o[2], start, stop, 0, 1, 1, num_reqs=5,
                                     COMPRESS_RATIO=ratio)
        for a, b in zip(o, w):
            assert torch.equal(a, b)


def test_tile_schedule_has_every_layer_type():
    from vllm.v1.attention.backends.mla import sparse_swa as S
    plans = ports.no_tile_schedule(None, 4)
    for key in (S._LAYER_TYPE_SWAONLY, S._LAYER_TYPE_C4A, S._LAYER_TYPE_C128A, S._LAYER_TYPE_C1A, S._LAYER_TYPE_C2A):
        assert key in plans and plans[key] is None


def test_kernel_switch_is_validated(monkeypatch):
    from dsattn.integrations.vllm import v4
    for choice, want in (("", "dsattn"), ("VLLM", "vllm"), ("vllm-decode", "vllm-decode")):
        monkeypatch.setenv(v4.KERNELS_ENV, choice)
        assert v4.kernels() == want
    monkeypatch.setenv(v4.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="DSATTN_V4_KERNELS='cuda'.*dsattn, vllm, vllm-decode"):
        v4.kernels()
