// Which vector ISA the compiled kernels may use: the CPU's own class, capped by DSATTN_CPU_ISA.
//
// Every runtime ISA test of the compiled layer asks isa_has() (never __builtin_cpu_supports or
// target_clones directly), so that one variable, read once per process as oneDNN's ONEDNN_MAX_CPU_ISA
// and ATen's ATEN_CPU_CAPABILITY are, makes any machine run the code a smaller class runs: the tests
// run the kernels under every cap below the machine's own (dsattn.native.isa), so every class's code
// runs on every developer machine and in CI.
//
// The classes, in order:
//   generic      no vector ISA of ours: the code other architectures build (scalar loops, the
//                compiler's baseline vectorisation);
//   avx2         AVX2 + FMA (Haswell .. Comet Lake, Zen 1-3);
//   avx512       AVX-512 F + BW + VL + DQ + CD, GCC's x86-64-v4 (Skylake-SP, Cascade Lake, Ice Lake);
//   avx512_bf16  + AVX512-BF16 (Cooper Lake, Zen 4 / Zen 5): vdpbf16ps;
//   amx          + AMX tiles for bf16 (Sapphire Rapids on).
// The value is checked by the Python side before the layer is used (a ValueError naming the variable
// and the CPU's class); here an unknown value caps nothing.
#pragma once

// DSATTN_X86: the x86-64 paths (intrinsics, target attributes, cpuid) are built; elsewhere (aarch64, ...) only the
// generic code, which every x86 path falls back to, and isa_has() answers false for every vector class.
#if defined(__x86_64__)
#define DSATTN_X86 1
#define DSATTN_TARGET(isa) __attribute__((target(isa)))
#else
#define DSATTN_X86 0
#define DSATTN_TARGET(isa)
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dsattn_native {

enum CpuIsa : int { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3, ISA_AMX = 4 };

inline const char* isa_name(int isa) {
  static const char* const names[] = {"generic", "avx2", "avx512", "avx512_bf16", "amx"};
  return isa >= ISA_GENERIC && isa <= ISA_AMX ? names[isa] : "unknown";
}

// -1 for an unknown name
inline int isa_parse(const char* name) {
  for (int isa = ISA_GENERIC; isa <= ISA_AMX; ++isa)
    if (std::strcmp(name, isa_name(isa)) == 0) return isa;
  return -1;
}

// The CPU's own class.
inline CpuIsa cpu_isa_own() {
  static const CpuIsa own = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return ISA_GENERIC;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("avx512cd")))
      return ISA_AVX2;
    if (!__builtin_cpu_supports("avx512bf16")) return ISA_AVX512;
    // AMX-TILE and AMX-BF16 (CPUID.(7,0).EDX bits 24, 22): GCC 12's cpuinfo reports no AMX.  (Whether
    // the kernels use it is oneDNN's to say as well: cpu_runs_amx, gemm.h.)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1u) && (d >> 22 & 1u)) return ISA_AMX;
    return ISA_AVX512_BF16;
#else
    return ISA_GENERIC;
#endif
  }();
  return own;
}

// DSATTN_CPU_ISA's class, or ISA_AMX (no cap) when it is unset, empty or unknown.  Read as the Python side
// reads it (dsattn.native.isa.requested): spaces around it and letter case do not count.
inline CpuIsa isa_cap() {
  static const CpuIsa cap = [] {
    const char* value = std::getenv("DSATTN_CPU_ISA");
    std::string name;
    for (const char* c = value; c != nullptr && *c != '\0'; ++c)
      if (*c != ' ' && *c != '\t' && *c != '\n') name += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    const int parsed = name.empty() ? -1 : isa_parse(name.c_str());
    return parsed < 0 ? ISA_AMX : static_cast<CpuIsa>(parsed);
  }();
  return cap;
}

// The class the kernels run as: the CPU's own, capped.
inline CpuIsa cpu_isa() {
  static const CpuIsa isa = std::min(cpu_isa_own(), isa_cap());
  return isa;
}

inline bool isa_has(CpuIsa level) { return cpu_isa() >= level; }

// AVX-512 VBMI (byte permutes: Ice Lake, Zen 4 on) within the AVX-512 classes: a feature, not a class
// (Skylake-SP and Cooper Lake lack it), so it follows the cap's class and the CPU's flag.
inline bool isa_has_avx512vbmi() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = isa_has(ISA_AVX512) && __builtin_cpu_supports("avx512vbmi");
  return has;
#else
  return false;
#endif
}

// Picks one of three builds of a loop by the class: x86-64-v4 (the AVX-512 classes), AVX2, or the
// baseline build.
template <typename F>
F pick_isa(F avx512, F avx2, F generic) {
  return isa_has(ISA_AVX512) ? avx512 : isa_has(ISA_AVX2) ? avx2 : generic;
}

}  // namespace dsattn_native

// A loop compiled per class, in place of target_clones (whose resolver reads the CPU, not the cap):
// ``name##_body`` holds the loop (always inlined, so each build vectorises it for its own target) and
// DSATTN_PER_ISA(name, (params), (args)) defines ``void name(params)`` calling the build of the class.
// The x86-64-v4 build, not bare AVX-512F: loops that mix fp32 lanes with 16-bit stores (bf16 bits)
// need BW's 16-bit vector moves, or GCC leaves them scalar.
#define DSATTN_VECTOR_BODY inline __attribute__((always_inline))
#if defined(__x86_64__)
#define DSATTN_PER_ISA(name, params, args)                                                            \
  __attribute__((target("arch=x86-64-v4"))) static void name##_avx512 params { name##_body args; }   \
  __attribute__((target("avx2"))) static void name##_avx2 params { name##_body args; }               \
  static void name##_generic params { name##_body args; }                                            \
  void name params {                                                                                  \
    static const auto fn = dsattn_native::pick_isa(name##_avx512, name##_avx2, name##_generic);       \
    fn args;                                                                                          \
  }
#else
#define DSATTN_PER_ISA(name, params, args) \
  void name params { name##_body args; }
#endif
