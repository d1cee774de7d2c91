"""vLLM's kernel library of each CPU class on this machine (``DSATTN_CPU_ISA`` picks ``_C_AVX2`` / ``_C_AVX512``):
the DSA models serve with each; DeepSeek-V4's engine tests run with each through ``make test`` (``test_v4.py`` under
``python -m dsattn.native --below --only avx512,avx2``), and vLLM's own V4 attention kernels, which those libraries
lack, are refused up front."""
import os
import subprocess
import sys

import pytest

from dsattn.integrations.vllm import tiny
from dsattn.native import isa
from vllm_helpers import MAX_TOKENS, compare, hf_greedy, run_llm

PROMPTS = tiny.prompts((40, 57, 23))
LIBRARIES = {"avx512": "_C_AVX512", "avx2": "_C_AVX2"}


def _as_class(cls: str) -> dict:
    if isa.CLASSES.index(cls) > isa.CLASSES.index(isa.cpu_class()):
        pytest.skip(f"this CPU's class is {isa.cpu_class()}, below {cls}")
    return isa.environment(cls)


@pytest.mark.parametrize("cls", list(LIBRARIES))
def test_the_platform_loads_the_class_library(cls):
    env = _as_class(cls)
    code = ("import torch; from dsattn.integrations.vllm.platform import DsattnCpuPlatform; "
            "DsattnCpuPlatform.import_kernels(); print('onednn_mm', hasattr(torch.ops._C, 'onednn_mm')); "
            "from dsattn.integrations.vllm import v4_ops; print('missing', len(v4_ops.missing())); "
            "print('answers', torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))
    assert proc.returncode == 0, proc.stderr
    assert "onednn_mm True" in proc.stdout
    assert "missing 13" in proc.stdout, proc.stdout        # none of vLLM's V4 ops: they are _C's only
    # vLLM's capability checks answered for the class (its GEMM and attention paths follow them)
    assert f"answers {cls == 'avx512'} False" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def dsa_checkpoint(tmp_path_factory):
    return tiny.write_dsa(tmp_path_factory.mktemp("dsa"), tiny.ARCHS[0])


@pytest.mark.parametrize("cls", list(LIBRARIES))
def test_dsa_serves_on_the_class_library(cls, dsa_checkpoint):
    """DeepSeek-V3.2 in fp32 with vLLM's library of that class loaded: the same tokens as transformers."""
    env = _as_class(cls)
    got = run_llm(dsa_checkpoint, PROMPTS, env=env)
    matched, total = compare(got, hf_greedy(dsa_checkpoint, PROMPTS, MAX_TOKENS), tol=1e-4, min_match=0.95)
    assert matched == total


def test_vllms_v4_attention_kernels_are_refused_up_front_where_missing(tmp_path):
    env = _as_class("avx2")
    with pytest.raises(AssertionError, match="DSATTN_V4_KERNELS=vllm runs vLLM's CPU attention .* which "
                                             "vllm._C_AVX2 lacks"):
        model = tiny.write_v4(tmp_path, index_topk=512)        # (vLLM's indexer refuses any other top-k first)
        run_llm(model, PROMPTS[:1], engine=dict(dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True),
                env=dict(env, DSATTN_V4_KERNELS="vllm"), timeout=300)
