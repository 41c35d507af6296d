"""Key paths of pytrees as plain strings, one spelling for every module that names leaves (the optimizer's
parameter groups, shardings, checkpoint structures, layout conversion)."""

from __future__ import annotations


def parts(path) -> tuple[str, ...]:
    """A jax key path as strings: dict keys, attribute names (optax states, namedtuples) and sequence indices alike,
    e.g. ('blocks', '0', 'attn', 'q', 'kernel'). Orbax's metadata trees give the same parts as the arrays' trees."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def to_str(path) -> str:
    """'blocks/0/attn/q/kernel' from a jax key path."""
    return "/".join(parts(path))
