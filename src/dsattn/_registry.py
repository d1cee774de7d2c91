"""The ``dsattn`` torch.library namespace and a helper to register one operator.

Each operator family registers its schema (exactly the spec's), one kernel for every
device (``CompositeExplicitAutograd``: the vectorised PyTorch path runs on any device) and
a fake kernel so that ``torch.compile`` / ``torch.export`` can trace it.
"""
from __future__ import annotations

import inspect

import torch

LIB = torch.library.Library("dsattn", "DEF")


def register(schema: str, kernel, fake) -> None:
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dsattn::{name}", fake, lib=LIB)


def python_signature(name: str) -> inspect.Signature:
    """The Python signature of a registered op, read from its schema."""
    schema = getattr(torch.ops.dsattn, name).default._schema
    params = []
    for a in schema.arguments:
        kind = inspect.Parameter.KEYWORD_ONLY if a.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = a.default_value if a.has_default_value() else inspect.Parameter.empty
        params.append(inspect.Parameter(a.name, kind, default=default))
    return inspect.Signature(params)


def op_function(name: str, doc: str = ""):
    """A plain Python function with exactly the schema's signature that calls the op."""
    op = getattr(torch.ops.dsattn, name)
    sig = python_signature(name)

    def fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        return op(*bound.args, **bound.kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__signature__ = sig
    fn.__doc__ = doc or f"``torch.ops.dsattn.{name}`` ({schema_text(name)})"
    fn.__module__ = "dsattn.ops"
    return fn


def schema_text(name: str) -> str:
    return str(getattr(torch.ops.dsattn, name).default._schema)
