"""The AVX512-BF16 GEMM micro-kernel as built: its inner loops keep the accumulators in registers, and
the GEMM paths an AVX512-BF16 CPU can take (the micro-kernel, oneDNN's avx512_core_bf16 ukernel) agree.

The disassembly check reads the compiled layer this process loaded: a loop of a ``dpbf16_tile`` that
holds ``vdpbf16ps`` must store nothing (an accumulator array kept in memory shows up as one zmm store
per accumulator and K step, which halves the rate on CPUs that retire a 512-bit store every other
cycle, Zen 4 among them) but its side work's own output (the FP8 decode's two zmm stores), and the
tiles that run on AVX512-BF16 CPUs without VBMI hold no VBMI instruction."""
import re
import shutil
import subprocess

import pytest
import torch

from dsattn import native

# the CPU lacks AVX512-BF16, or DSATTN_CPU_ISA caps the layer below it
NO_AVX512BF16 = "this CPU has no AVX512-BF16|caps the kernels below AVX512-BF16"

_LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
_NOT_STORES = ("cmp", "test", "prefetch", "vcomi", "vucomi", "bt", "nop")


def _functions(disassembly: str, name: str) -> dict[str, list[tuple[int, str, str]]]:
    """Each function whose demangled name contains ``name``: its (address, mnemonic, operands) lines."""
    out, current = {}, None
    for line in disassembly.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            current = head.group(1) if name in head.group(1) else None
            if current is not None:
                out[current] = []
            continue
        m = _LINE.match(line)
        if current is not None and m:
            out[current].append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def _loops(body):
    """The instructions of each loop: from a conditional backward jump's target to the jump (GCC closes
    a loop with a conditional jump; a backward ``jmp`` is a branch rejoining the straight path)."""
    for addr, op, args in body:
        if op.startswith("j") and op != "jmp":
            target = re.match(r"([0-9a-f]+)\b", args)
            if target and int(target.group(1), 16) <= addr:
                start = int(target.group(1), 16)
                yield [x for x in body if start <= x[0] <= addr]


def _stores(loop):
    """Instructions that write memory: a memory first operand (Intel syntax), other than a compare."""
    return [x for x in loop if "PTR [" in x[2].split(",")[0] and not x[1].startswith(_NOT_STORES)]


def loop_report(disassembly: str, name: str = "dpbf16_tile", product: str = "vdpbf16ps") -> dict[str, tuple[int, list]]:
    """Per function: how many of its loops run ``product`` (an instruction, or the start of its name), and the
    stores inside those loops."""
    report = {}
    for fn, body in _functions(disassembly, name).items():
        fma_loops = [loop for loop in _loops(body) if any(op.startswith(product) for _, op, _ in loop)]
        report[fn] = (len(fma_loops), [s for loop in fma_loops for s in _stores(loop)])
    return report


def accumulator_stores(disassembly: str, name: str) -> dict[str, list]:
    """Per function: the stores, inside a loop that runs vdpbf16ps, of a register that a vdpbf16ps of the
    loop writes (an accumulator kept in memory); other stores (a side step's own output) are not listed."""
    report = {}
    for fn, body in _functions(disassembly, name).items():
        found = []
        for loop in _loops(body):
            sums = {args.split(",")[0].strip() for _, op, args in loop if op == "vdpbf16ps"}
            found += [s for s in _stores(loop) if sums and s[2].split(",")[-1].strip() in sums]
        report[fn] = found
    return report


_VBMI = ("vpermb", "vpermi2b", "vpermt2b", "vpmultishiftqb")


def vbmi_instructions(disassembly: str, name: str) -> dict[str, list]:
    """Per function: its AVX-512 VBMI instructions (byte permutes)."""
    return {fn: [x for x in body if x[1] in _VBMI] for fn, body in _functions(disassembly, name).items()}


def _disassemble(path: str) -> str:
    return subprocess.run([shutil.which("objdump"), "-d", "-C", "--no-show-raw-insn", "-M", "intel", path],
                          capture_output=True, text=True, check=True, timeout=300).stdout


def _built_layer_disassembly(native_module) -> str:
    """The built layer's disassembly, or the test skipped where there is no layer or no objdump."""
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed: the built layer's loops cannot be read")
    return _disassemble(native_module.__file__)


def test_the_micro_kernel_loops_store_no_accumulator(native_module):
    text = _built_layer_disassembly(native_module)
    # every tile shape the GEMM dispatches to: 1-6 rows x 1-4 column slices, with each side work
    plain = loop_report(text, "dpbf16_tile<")
    plain = {fn: r for fn, r in plain.items() if "LinePrefetch>" in fn}
    assert len(plain) == 24, sorted(plain)
    for fn, (fma_loops, stores) in plain.items():
        assert fma_loops >= 1, f"{fn}: no loop with vdpbf16ps found (inlined or renamed?)"
        assert not stores, f"{fn}: stores inside its vdpbf16ps loop: {stores[:4]}"
    # the tiles with the FP8 decode as side work store its bf16 words, and nothing of their sums
    decoding = {fn: r for fn, r in loop_report(text, "dpbf16_tile<").items() if "Fp8RowDecode>" in fn}
    assert len(decoding) == 24, sorted(decoding)
    for fn, stores in accumulator_stores(text, "dpbf16_tile<").items():
        assert not stores, f"{fn}: accumulators stored inside its vdpbf16ps loop: {stores[:4]}"
    for fn, (fma_loops, stores) in decoding.items():
        assert fma_loops >= 1, f"{fn}: no loop with vdpbf16ps found (inlined or renamed?)"
        zmm = [x for x in stores if "ZMMWORD" in x[2]]
        assert len(zmm) <= 2 * fma_loops, f"{fn}: more zmm stores than the decode's two per loop: {zmm[:6]}"


def test_the_fp32_tiles_keep_their_sums_in_registers(native_module):
    # dsattn's fp32 GEMM: every AVX-512 tile (1-6 rows x 1-4 slices of 16) and AVX2 tile (1-6 rows x 1-2 slices of
    # 8, each built for a whole and a partial last slice) runs its FMAs in a loop that stores nothing: the accumulators
    # stay in registers from the first k to the last
    text = _built_layer_disassembly(native_module)
    for name, tiles, register in (("fma512_tile<", 24, "zmm"), ("fma256_tile<", 24, "ymm")):
        report = loop_report(text, name, product="vfmadd")
        assert len(report) == tiles, sorted(report)
        for fn, (fma_loops, stores) in report.items():
            assert fma_loops >= 1, f"{fn}: no loop with vfmadd*ps found (inlined or renamed?)"
            assert not stores, f"{fn}: stores inside its FMA loop: {stores[:4]}"
            body = _functions(text, fn)[fn]
            assert any(register in args for _, op, args in body if op.startswith("vfmadd")), fn


def test_the_tiles_that_run_without_vbmi_hold_no_vbmi_instruction(native_module):
    # the tiles are compiled for AVX-512 VBMI (the FP8 side work's byte permutes); those with a prefetch
    # list as side work run on AVX512-BF16 CPUs without VBMI (Cooper Lake), so none of theirs may be one
    found = vbmi_instructions(_built_layer_disassembly(native_module), "dpbf16_")
    plain = {fn: x for fn, x in found.items() if "LinePrefetch" in fn}
    assert len(plain) >= 24 + 4, sorted(plain)                        # the tiles and the strips
    assert not any(plain.values()), {fn: x[:2] for fn, x in plain.items() if x}
    assert any(x for fn, x in found.items() if "Fp8RowDecode" in fn)  # (the check sees them where they are)


def test_the_loop_check_finds_stores_of_an_accumulator_array():
    # the check itself, on the loop GCC 12 made of the previous kernel's acc[8][2] array: one zmm
    # store per accumulator inside the loop (abridged to two)
    text = """0000000000001000 <void dsattn_native::dpbf16_tile<8, 2>(long)>:
    1000:	vpbroadcastd zmm1,DWORD PTR [rax]
    1006:	vdpbf16ps zmm2,zmm1,zmm0
    100c:	vmovaps ZMMWORD PTR [rsp+0x40],zmm2
    1014:	vdpbf16ps zmm3,zmm1,zmm4
    101a:	vmovaps ZMMWORD PTR [rsp+0x80],zmm3
    1022:	cmp    QWORD PTR [rsp+0x8],rcx
    1027:	jne    1000 <void dsattn_native::dpbf16_tile<8, 2>(long)+0x0>
    102d:	vmovups ZMMWORD PTR [r9],zmm2
"""
    (fma_loops, stores), = loop_report(text).values()
    assert fma_loops == 1 and [s[0] for s in stores] == [0x100C, 0x101A]
    (sums,), = [list(accumulator_stores(text, "dpbf16_tile").values())]
    assert [s[0] for s in sums] == [0x100C, 0x101A]


def test_the_loop_check_tells_a_side_steps_stores_from_accumulator_stores():
    # a decode's words stored beside the products are not accumulators; a spilled sum is
    text = """0000000000001000 <void dsattn_native::dpbf16_tile<1, 1, Side>(long)>:
    1000:	vpbroadcastd zmm1,DWORD PTR [rax]
    1006:	vdpbf16ps zmm2,zmm1,zmm0
    100c:	vpermi2b zmm5,zmm6,zmm7
    1012:	vmovdqu64 ZMMWORD PTR [r8-0x80],zmm5
    101a:	vmovaps ZMMWORD PTR [rsp+0x40],zmm2
    1022:	cmp    QWORD PTR [rsp+0x8],rcx
    1027:	jne    1000 <void dsattn_native::dpbf16_tile<1, 1, Side>(long)+0x0>
"""
    (sums,), = [list(accumulator_stores(text, "dpbf16_tile").values())]
    assert [s[0] for s in sums] == [0x101A]
    assert [x[0] for x in vbmi_instructions(text, "dpbf16_tile")["void dsattn_native::dpbf16_tile<1, 1, Side>(long)"]] \
        == [0x100C]


def _has_onednn(module) -> bool:
    return module is not None and module.bf16_gemm_choice()["onednn_runs"]


@pytest.mark.parametrize("M, K, N", [(9, 14, 40), (17, 66, 1), (8, 130, 17), (1, 512, 64), (64, 640, 512),
                                     (128, 512, 64), (7, 258, 130)])
@pytest.mark.parametrize("path", ["avx512bf16", "onednn"])
def test_each_bf16_gemm_path_is_a_matmul(native_module, request, path, M, K, N):
    # a GEMM through the packed panels the kernels write, on each 16-bit path this CPU has, against an
    # fp64 matmul of the same bf16 values; odd widths exercise the masked slices and K blocks
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    if path == "avx512bf16" and not native_module.cpu_has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    if path == "onednn" and not _has_onednn(native_module):
        pytest.skip("oneDNN's bf16 ukernel without AMX does not run here")
    if path == "onednn" and N % 16:
        pytest.skip("the ukernel reads panels of a multiple of 16 columns (the kernels pack no other)")
    native_module.set_gemm_path(path)
    request.addfinalizer(lambda: native_module.set_gemm_path(native.gemm_requested()))
    assert native_module.attention_gemm("bfloat16") == path
    err = native_module.packed_gemm_error(M, K, N)
    assert err is not None and err <= K * 2.0 ** -24, err


def test_the_bf16_choice_is_measured_once_and_reported(native_module):
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    c = native_module.bf16_gemm_choice()
    assert native_module.bf16_gemm_choice() == c                     # decided once per process
    if not c["measured"]:                                            # AMX, or no AVX512-BF16
        assert c["chosen"] == "" and native_module.attention_gemm("bfloat16") in ("amx", "fp32")
        with pytest.raises(ValueError, match="gemm path 'onednn'"):
            native_module.set_gemm_path("onednn")
        return
    assert c["own_gflops"] > 0 and c["chosen"] in ("avx512bf16", "onednn") and c["why"]
    assert (c["chosen"] == "onednn") == (c["onednn_runs"] and c["onednn_gflops"] > 1.10 * c["own_gflops"])
    if native.gemm_requested() == "best":
        assert native_module.attention_gemm("bfloat16") == c["chosen"]
    from dsattn.which import describe
    line = next(x for x in describe().splitlines() if x.startswith("CPU attention forward"))
    assert f"the process runs {c['chosen']}" in line and "GFLOP/s" in line


def test_gemm_gflops_checks_its_arguments(native_module):
    if native_module is None:
        pytest.skip(f"no compiled layer here: {native.status()}")
    with pytest.raises(ValueError, match="K even"):
        native_module.gemm_gflops("avx512bf16", 4, 4, 3, 64)
    with pytest.raises(ValueError, match="path 'avx512bf16', 'onednn', 'fp32' or 'brgemm_fp32'"):
        native_module.gemm_gflops("amx", 4, 4, 4, 64)
    assert native_module.gemm_gflops("fp32", 12, 64, 64, 64) > 0
    assert native_module.gemm_gflops("brgemm_fp32", 12, 64, 64, 64) > 0
    if native_module.cpu_has_avx512bf16():
        assert native_module.gemm_gflops("avx512bf16", 12, 64, 64, 64) > 0
    else:
        with pytest.raises(ValueError, match=NO_AVX512BF16):
            native_module.gemm_gflops("avx512bf16", 12, 64, 64, 64)
    if _has_onednn(native_module):
        assert native_module.gemm_gflops("onednn", 12, 64, 64, 64) > 0


# the softmax's exp loops: each class's build must multiply packed floats of its width (ymm for AVX2, xmm for the
# baseline): a float select GCC cannot if-convert leaves a build scalar without failing any result test
_EXP_LOOPS = ("exp_and_sum", "softmax_numerators_bf16", "gradient_terms_bf16")
_PACKED = re.compile(r"^v?(mul|fmadd\w*|add)ps$")


def test_each_class_build_of_the_exp_loops_is_vectorised(native_module):
    text = _built_layer_disassembly(native_module)
    for loop in _EXP_LOOPS:
        for build, width in (("avx512", "zmm"), ("avx2", "ymm"), ("generic", "xmm")):
            found = {fn: body for fn, body in _functions(text, f"{loop}_{build}(").items()
                     if "[clone" not in fn}                       # (GCC's .cold parts: the loop is in the body)
            assert len(found) == 1, (loop, build, sorted(found))
            packed = [ins for ins in next(iter(found.values())) if _PACKED.match(ins[1]) and width in ins[2]]
            assert len(packed) >= 8, f"{loop}_{build}: {len(packed)} packed {width} float ops: left scalar?"
