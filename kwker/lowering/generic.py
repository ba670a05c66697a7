"""Which sizes of a Kwker op vary and which its code depends on: the key of its generic kernel.

A kernel generic over the sizes that vary (rows, batch, sequence lengths) is keyed by the sizes
that stay, so the compile (from dynamo's symbolic sizes) and every call (from concrete tensors)
name the same kernel. Used by the builders' no-stall rule (build.py) and the custom ops.
"""
from __future__ import annotations

from .shapes import known_size

# inputs whose sizes a kernel depends on, and their names in ``generic_shapes``
SIZED_INPUTS = {"linear": ("x", "residual"), "linear_topk": ("x",), "matmul": ("a", "b"),
                "gelu": ("x",), "sdpa": ("q", "k", "v", "mask"), "layer_norm": ("x",),
                "silu_mul": ("x", "y"), "grouped_mm": ("x", "offs")}
SHORT_NAMES = {"residual": "r", "mask": "m"}


def pinned(d, pin: bool):
    """``d`` as an int when known; a symbolic size guarded to its value when ``pin``; else
    None (read at call time)."""
    if d is None:
        return None
    d = known_size(d)
    if type(d) is int:
        return d
    return int(d) if pin else None


def generic_shapes(kind: str, shapes: dict) -> dict:
    """The shapes keying ``kind``'s generic kernel: the sizes that vary become None, the ones
    that shape the code stay. Depends only on those (so compile time and call time agree).

    A symbolic size the code depends on is pinned (a guard: dynamo recompiles if it changes)
    where a constant fixes it anyway, the features of a linear's weight and the heads and head
    size of attention; a matmul's inner size and columns stay None, and the builder leaves the
    matmul to the inner compiler instead of recompiling per size."""
    def fixed(shape, keep, pin=True):
        if shape is None:
            return None
        n = len(shape)
        return tuple(pinned(d, pin) if i in keep or i - n in keep else None
                     for i, d in enumerate(shape))
    if kind == "layer_norm":  # rows vary, the normalised size shapes the code
        return {"x": fixed(shapes["x"], {-1})}
    if kind in ("linear", "linear_topk"):
        return {"x": fixed(shapes["x"], {-1}), "r": None if shapes.get("r") is None else
                fixed(shapes["r"], {-1})}
    if kind == "matmul":
        b = shapes["b"]
        return {"a": fixed(shapes["a"], {-1}, False), "b": fixed(b, {-1, -2}, False)}
    if kind == "gelu":
        return {"x": (None,)}
    if kind == "silu_mul":
        return {"x": (None,), "y": (None,)}
    if kind == "grouped_mm":   # the rows vary, the experts and features come with the weight
        return {"x": fixed(shapes["x"], {-1}), "offs": fixed(shapes["offs"], {0})}
    if kind == "sdpa":
        q = shapes["q"]
        heads = {0, 2} if len(q) == 3 else {1, 3}
        mask = shapes.get("m")
        if mask is not None:
            mask = tuple(1 if d == 1 else None for d in mask)
        return {"q": fixed(q, heads), "k": fixed(shapes["k"], heads),
                "v": fixed(shapes["v"], heads), "m": mask}
    raise KeyError(kind)
