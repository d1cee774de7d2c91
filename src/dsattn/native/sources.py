"""What the compiled layer is built from, read by both builds: the wheel's (``setup.py``: setuptools'
``build_ext`` with torch's ``CppExtension``) and the first-use build (:mod:`dsattn.native`).  No torch import:
``setup.py`` reads this file before torch is needed."""
from __future__ import annotations

import hashlib
import os

SOURCES = ("module.cpp", "planner.cpp", "attention.cpp", "indexer.cpp", "compressor.cpp", "paged.cpp", "matmul.cpp",
           "sharedkv.cpp", "flashmla.cpp", "kv_quant.cpp", "v4_model.cpp",
           "weights.cpp")
HEADERS = ("attention.h", "common.h", "fp8.h", "gemm.h", "isa.h", "keys.h")

# -fopenmp: at::parallel_for is a header template whose OpenMP pragma is compiled here (without the flag the rows
# would run on one thread); torch itself links the same libgomp.  No -march: every ISA path is built and picked at
# run time (isa.h), so one build serves every CPU of its architecture.
CFLAGS = ("-O3", "-std=c++17", "-fopenmp")
LDFLAGS = ("-fopenmp",)

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = "_native_build.json"        # beside the wheel's module: the torch it was built against, sources_key


def paths(names) -> list[str]:
    return [os.path.join(HERE, n) for n in names]


def files_digest(paths_, seed: bytes) -> str:
    """A hash of ``seed`` and each file's name and bytes (16 hex digits): the build keys' common part."""
    h = hashlib.sha256(seed)
    for path in paths_:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def sources_key() -> str:
    """A hash of the sources, headers and flags: a prebuilt module whose key differs was built from other sources
    (an edited checkout) and is not loaded."""
    return files_digest(paths(SOURCES + HEADERS), repr((CFLAGS, LDFLAGS)).encode())
