"""KV compressor: ``compressor`` (training, differentiable) and ``compressor_inference``
(fused RMSNorm + RoPE) (30-compressor)."""
from . import op  # noqa: F401  (registers the operators)
