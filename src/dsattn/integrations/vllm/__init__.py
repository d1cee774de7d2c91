"""vLLM on CPU through dsattn's kernels: ``pip install dsattn[vllm]``, then ``vllm serve <model>``.

vLLM finds this package through two entry points (``pyproject.toml``):

* ``vllm.platform_plugins`` -> :func:`platform_plugin`: where vLLM would pick its own CPU platform,
  it gets :class:`dsattn.integrations.vllm.platform.DsattnCpuPlatform`, a subclass that differs
  only for DeepSeek's sparse-attention models: for DSA (``DeepseekV32ForCausalLM``,
  ``GlmMoeDsaForCausalLM``) their attention goes to dsattn's backend instead of vLLM's refusal and
  their scheduler settings (chunked prefill, prefix caching) stay the user's; for DeepSeek-V4 it
  says what vLLM's CPU model cannot run before it starts, and on CPUs whose vLLM kernel library lacks the V4 ops
  (AVX-512 without BF16, AVX2) supplies them (``.v4_ops``);
* ``vllm.general_plugins`` -> :func:`register`, run in every vLLM process (driver, engine core,
  workers): installs the DSA indexer on dsattn's kernels, the CPU rotary fix, the torch versions of
  the V4 metadata kernels and V4's attention / CSA indexer on dsattn, only when the platform above
  is active.

Everything else (other models, GPU platforms) runs exactly as without the plug-in.  A vLLM outside
:data:`SUPPORTED` leaves vLLM alone with one warning naming the reason.
"""
from __future__ import annotations

import logging

SUPPORTED = ("0.32.0", "0.33.0")   # tested: [low, high)
PLATFORM = "dsattn.integrations.vllm.platform.DsattnCpuPlatform"

log = logging.getLogger("dsattn.vllm")


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def unsupported_reason(version: str | None = None) -> str | None:
    """Why the installed vLLM cannot take the plug-in, or None when it can."""
    if version is None:
        try:
            import vllm
        except ImportError as e:          # pragma: no cover - entry points need vllm
            return f"vllm is not importable ({e})"
        version = getattr(vllm, "__version__", "0")
    low, high = (_version_tuple(v) for v in SUPPORTED)
    if not low <= _version_tuple(version) < high:
        return (f"vLLM {version} is outside the versions dsattn's plug-in supports "
                f"(>= {SUPPORTED[0]}, < {SUPPORTED[1]})")
    return None


def platform_plugin() -> str | None:
    """vLLM's platform detector: dsattn's CPU platform where vLLM would choose its CPU platform."""
    from vllm.platforms import cpu_platform_plugin
    if cpu_platform_plugin() is None:
        return None                     # not a CPU build: vLLM's own platform, said in register()
    reason = unsupported_reason()
    if reason is not None:
        log.warning("dsattn: the vLLM plug-in is off: %s", reason)
        return None
    return PLATFORM


def active() -> bool:
    """True in a vLLM process whose platform is dsattn's."""
    from vllm.platforms import current_platform
    from .platform import DsattnCpuPlatform
    return isinstance(current_platform, DsattnCpuPlatform)


_REGISTERED = False


def register() -> None:
    """vLLM's general-plugin hook (every process): install dsattn's DSA pieces when active."""
    global _REGISTERED
    if _REGISTERED:
        return
    if unsupported_reason() is not None:
        return                          # said once by platform_plugin()
    if not active():
        from vllm.platforms import current_platform
        log.info("dsattn: the vLLM plug-in serves CPUs only; platform %s runs vLLM's own kernels",
                 type(current_platform).__name__)
        _REGISTERED = True
        return
    from . import dsa, fp8_weights, rope, v4, v4_fp32, v4_metadata, v4_ops
    rope.install()
    fp8_weights.install()               # (FP8 checkpoints where vLLM's CPU kernels need AMX)
    v4_ops.install()                    # (vLLM's V4 ops where its kernel library lacks them)
    v4_ops.install_routing()            # (and its routing where its kernels refuse the model's expert count)
    dsa.install()
    v4_metadata.install()
    v4_fp32.install()
    v4.install()
    _REGISTERED = True
