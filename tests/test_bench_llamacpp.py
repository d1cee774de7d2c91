"""bench/llamacpp.py's writers, in seconds: the V3.2 checkpoint with its byte-level BPE tokenizer, the FP4
packing of V4's routed experts (what llama.cpp's converter repacks to MXFP4), and -- where llama-cpp-python's
sources are here (``make .venv-llama/.installed``; CI has no llama.cpp) -- the GGUF conversion."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_llamacpp", ROOT / "bench" / "llamacpp.py")
llamacpp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llamacpp)

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=64, index_n_heads=4, index_topk=8, max_position_embeddings=512)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return llamacpp.write_v32(tmp_path_factory.mktemp("v32"), **SMALL)


def test_v32_checkpoint_and_tokenizer(v32):
    """The attention keeps V3.2's latent widths; the tokenizer is a byte-level BPE with merges (what llama.cpp's
    ``gpt2`` model reads), round-trips text, and asks for a BOS token, as DeepSeek's does."""
    cfg = json.loads((v32 / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]) == (512, 64, 128)
    tok = json.loads((v32 / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "BPE" and len(tok["model"]["merges"]) > 0
    assert tok["pre_tokenizer"]["type"] == "ByteLevel"
    assert json.loads((v32 / "tokenizer_config.json").read_text())["add_bos_token"] is True
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(str(v32))
    ids = t.encode("the quick fox, 3.14 ünïcode", add_special_tokens=False)
    assert t.decode(ids) == "the quick fox, 3.14 ünïcode"
    assert max(t.get_vocab().values()) < SMALL["vocab_size"]
    assert [t.convert_tokens_to_ids(x) for x in ("<s>", "</s>")] == [cfg["bos_token_id"], cfg["eos_token_id"]]


def test_fp4_quantize_packs_deepseeks_format():
    """Codes two a byte (element 2i low), one e8m0 scale a 32-group, the values they encode within half an e2m1
    step of the input, the group's largest value in e2m1's range, the bytes decoding to ``values`` exactly."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-3, 2, 24)[:, None]
    packed, scales, values = llamacpp.fp4_quantize(w)
    assert packed.dtype == scales.dtype == torch.uint8
    assert packed.shape == (24, 48) and scales.shape == (24, 3)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(24, 96).long()
    from dsattn.weights.problem import E2M1
    decoded = torch.tensor(E2M1)[codes] * torch.exp2(scales.float() - 127).repeat_interleave(32, 1)
    assert torch.equal(decoded, values)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, 1)
    assert ((w - values).abs() <= scale + 1e-30).all()                 # half of e2m1's widest step (2)
    assert (w.abs() / scale <= 6).all()
    assert (values.sign() * w.sign() >= 0).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        llamacpp.fp4_quantize(torch.randn(2, 40))


def test_gguf_conversion(v32, tmp_path):
    """llama.cpp's own converter on the checkpoint: a ``deepseek32`` GGUF with the indexer's keys."""
    try:
        src = llamacpp.llama_source()
    except FileNotFoundError as e:
        pytest.skip(f"no llama.cpp sources here ({e})")
    import sys
    sys.path.insert(0, str(src / "gguf-py"))
    import gguf
    out = llamacpp.convert(v32, tmp_path / "v32.gguf", src=src)
    reader = gguf.GGUFReader(str(out))
    fields = {k: v for k, v in reader.fields.items()}
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    assert arch == "deepseek32"
    assert int(fields["deepseek32.attention.indexer.head_count"].parts[-1][0]) == SMALL["index_n_heads"]
    assert int(fields["deepseek32.attention.indexer.top_k"].parts[-1][0]) == SMALL["index_topk"]
    assert any(t.name.startswith("blk.0.indexer") for t in reader.tensors)


def test_a_row_over_its_limit_says_how_far_the_prefill_got():
    """A llama.cpp row cut by ``--timeout`` reports the prompt tokens its worker had prefilled (a lower bound on
    its prefill time), not only that it ran over."""
    import sys
    worker = ("import time\nfor n in (2048, 4096):\n    print(f'PROGRESS {n} {n / 1000:.1f}', flush=True)\n"
              "time.sleep(60)\n")
    res = llamacpp.run([sys.executable, "-c", worker], timeout=3)
    assert res == {"error": "over the 3 s limit (4096 prompt tokens prefilled in 4.1 s)"}


def test_the_llama_worker_runs_without_dsattn():
    """The llama.cpp side runs this script in llama-cpp-python's own venv, which has no dsattn (nor torch's
    extras): the module must load with dsattn absent, importing it only where the vLLM side needs it."""
    import subprocess
    import sys
    code = ("import sys, runpy; sys.modules['dsattn'] = None; "
            f"runpy.run_path({str(ROOT / 'bench' / 'llamacpp.py')!r}, run_name='llama_worker_check')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
