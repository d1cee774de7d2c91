"""A DeepSeek-V4 attention layer composed only of the library's operators, over paged caches
(60-serving), with a dense float64 reference of the same layer."""
from .config import PRESETS, V4AttentionConfig  # noqa: F401
from .layer import DeepseekV4Attention, LayerCaches, PagedBatch, StepInputs  # noqa: F401
