"""The quantised MLA cache (40-kv-quant): per-tile block quantisation, packed rows and the
fused cache writer.  Plain helpers live here; the operators are ``torch.ops.dsattn.*``."""
from . import op  # noqa: F401  (registers the operators)
from .block import dequant_block
from .index_keys import (dequantize_index_keys, pack_index_blocks, pack_index_rows, quantize_index_keys,
                         store_index_keys)
from .rows import PackedKV, dequant_kv_rows, pack_kv_rows, quantize_kv_rows, row_width, unpack_kv_rows

__all__ = ["PackedKV", "dequant_block", "dequant_kv_rows", "dequantize_index_keys", "pack_index_blocks",
           "pack_index_rows", "quantize_index_keys", "store_index_keys", "pack_kv_rows", "quantize_kv_rows", "row_width",
           "unpack_kv_rows"]
