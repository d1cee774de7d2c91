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
    params = list(sig.parameters.values())
    positional = sum(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    keyword_only = {p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY}
    required = [p.name for p in params[:positional] if p.default is inspect.Parameter.empty]

    def fn(*args, **kwargs):
        # the common call (the required positionals given, keyword-only arguments by name) goes to
        # the op as it is: binding it through the signature costs more than a decode step's kernel
        # on small batches; anything else is bound, so that a wrong call gets Python's TypeError
        if len(args) >= len(required) and len(args) <= positional and keyword_only.issuperset(kwargs):
            return op(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        return op(*bound.args, **bound.kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__signature__ = sig
    fn.__doc__ = doc or f"``torch.ops.dsattn.{name}`` ({schema_text(name)})"
    fn.__module__ = "dsattn.ops"
    return fn


def schema_text(name: str) -> str:
    return str(getattr(torch.ops.dsattn, name).default._schema)
