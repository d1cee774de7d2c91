"""The wheel's compiled layer: ``dsattn/_native`` built at ``pip wheel`` / ``pip install`` time from the sources and
flags the first-use build takes (``src/dsattn/native/sources.py``), with torch's ``CppExtension``.

The module is built against the torch of the build environment and loads only with that torch's minor version
(torch's C++ ABI changes between minors), so the wheel requires ``torch==<major>.<minor>.*`` of it.  Beside the
module, ``_native_build.json`` records that torch and the sources' key: :mod:`dsattn.native` loads the module only
where both match, and otherwise says why and builds the layer for the torch it finds (the first-use build).

``DSATTN_BUILD_NATIVE=0`` builds a pure-Python wheel (``torch>=2.4``; the layer is then built on first use).
"""
import json
import os
import runpy
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
native = runpy.run_path(str(HERE / "src" / "dsattn" / "native" / "sources.py"))
BASE = ["numpy", "rich>=13", "ninja"]            # ninja: the first-use build (a torch the wheel was not built for)


def native_build() -> dict:
    if os.environ.get("DSATTN_BUILD_NATIVE", "1").strip() in ("0", "false", "off", "no"):
        return dict(install_requires=["torch>=2.4", *BASE])
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildNative(BuildExtension):
        def run(self):
            super().run()
            info = dict(torch=torch.__version__, sources_key=native["sources_key"]())
            for root in {self.build_lib, *(["src"] if self.inplace else [])}:
                target = Path(root) / "dsattn" / native["BUILD_INFO"]
                if target.parent.is_dir():
                    target.write_text(json.dumps(info, indent=1) + "\n")

    sources = [os.path.join("src", "dsattn", "native", s) for s in native["SOURCES"]]
    # -g0: Python's own CFLAGS carry -g (a 61 MB module instead of 1.5 MB); the first-use build has none
    ext = CppExtension("dsattn._native", sources, extra_compile_args=[*native["CFLAGS"], "-g0"],
                       extra_link_args=list(native["LDFLAGS"]))
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return dict(ext_modules=[ext], cmdclass={"build_ext": BuildNative.with_options(use_ninja=True)},
                install_requires=[f"torch=={major}.{minor}.*", *BASE])


setup(**native_build())
