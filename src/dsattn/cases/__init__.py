"""Random test cases shared by the test suite, ``dsattn verify`` and ``dsattn demo``, one
module per operator family.

Inputs are drawn fresh from a seeded generator (never zeros); lengths are ragged; every
tensor row that no length, window, table or index can reach is filled with NaN, so a stray
read shows up as a NaN in the output.
"""
from .attention import (NAN, SCENARIOS, Case, indexer_case, kl_case, mla_case, no_key_case,  # noqa: F401
                        sharedkv_case, sharedkv_plan)
from .compressor import CompressorCase, compressor_case  # noqa: F401
from .kv_quant import packed_sharedkv_case, qsfa_case, quant_indexer_case  # noqa: F401
