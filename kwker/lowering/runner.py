"""The compiled graph for ``inner="eager"``: a flat list of native calls with pre-bound arguments.

Built once per specialisation. Every FX node becomes one step, a closure that reads its arguments
from numbered slots and writes its result into its own slot; a group of nodes replaced by a Kwker
kernel becomes a single step calling the kernel, and a chain of view ops one ``as_strided`` call
(views.py), and a region computed from constants and sizes alone one step keeping its results
per size (memo.py). A call fills the input slots and runs the steps
in order: no FX interpreter and no generated Python walks the graph. A slot is cleared after its
last use, so intermediates die as early as they do in eager mode.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from . import memo, views
from .ops import is_inplace, target_in
from .shapes import TensorMeta


@dataclass
class KernelStep:
    """One kernel call replacing ``covers``; its result is the value of node ``output``."""
    fn: Callable
    args: list                       # Nodes (read from their slots) or constants
    output: Node
    covers: list = field(default_factory=list)  # every node the kernel makes redundant
    name: str = ""
    # nodes whose values the kernel also gives (fn then returns a tuple: output's, then theirs),
    # read only after ``output``'s step, wherever they sit in the graph
    extra: list = field(default_factory=list)
    parts: list = field(default_factory=list)  # a chain's kernels by name (lowering/chain.py)
    # the extra values may be given as ``(base, size, stride)``, made ``base.as_strided(size,
    # stride)`` when the graph's output is built: only where the output alone reads them
    deferred: bool = False


class Program:
    """``program(args)`` runs the steps on a fresh slot list and returns the graph's outputs.

    ``steps`` holds ``(step, slots freed after it)``; a step that calls Kwker kernels carries its
    name as ``step.kernel`` and theirs as ``step.kernels`` (several for a chain), so a benchmark
    can time the kernels apart from the rest.
    """

    __slots__ = ("n_inputs", "output", "steps", "template")

    def __init__(self, n_inputs: int, template: list, steps: list, output: Callable):
        self.n_inputs, self.template, self.steps, self.output = n_inputs, template, steps, output

    def __call__(self, args) -> Any:
        env = self.template.copy()
        env[:self.n_inputs] = args
        for step, dead in self.steps:
            step(env)
            if dead:
                for i in dead:
                    env[i] = None
        return self.output(env)


def _getter(a, slot_of: dict) -> tuple[bool, Any]:
    """(dynamic, value): a constant, or a function of the slot list for anything holding nodes."""
    if isinstance(a, Node):
        i = slot_of[a]
        return True, lambda env: env[i]
    if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        parts = [_getter(x, slot_of) for x in a]
        if not any(d for d, _ in parts):
            return False, a
        kind = type(a)
        fns = [p if d else (lambda env, v=p: v) for d, p in parts]
        return True, lambda env: kind([f(env) for f in fns])
    if isinstance(a, dict):
        items = {k: _getter(v, slot_of) for k, v in a.items()}
        if not any(d for d, _ in items.values()):
            return False, a
        fns = {k: (p if d else (lambda env, v=p: v)) for k, (d, p) in items.items()}
        return True, lambda env: {k: f(env) for k, f in fns.items()}
    if isinstance(a, slice):
        d, parts = _getter((a.start, a.stop, a.step), slot_of)
        return (True, lambda env: slice(*parts(env))) if d else (False, a)
    return False, a


def _output(value, slot_of: dict) -> Callable:
    """The graph's result from the slots; a flat tuple of nodes is one ``itemgetter`` call."""
    if isinstance(value, tuple) and value and all(isinstance(v, Node) for v in value):
        idx = [slot_of[v] for v in value]
        if len(idx) == 1:
            i = idx[0]
            return lambda env: (env[i],)
        return operator.itemgetter(*idx)
    return _reader(value, slot_of)


def make_step(fn: Callable, args: tuple, kwargs: dict, out: int, slot_of: dict) -> Callable:
    """A closure ``step(env)`` computing ``env[out] = fn(*args, **kwargs)`` from slots."""
    nodes_only = all(isinstance(a, Node) for a in args) and not kwargs
    if nodes_only and len(args) <= 3:
        s = [slot_of[a] for a in args]
        if len(s) == 0:
            def step(env):
                env[out] = fn()
        elif len(s) == 1:
            a0, = s

            def step(env):
                env[out] = fn(env[a0])
        elif len(s) == 2:
            a0, a1 = s

            def step(env):
                env[out] = fn(env[a0], env[a1])
        else:
            a0, a1, a2 = s

            def step(env):
                env[out] = fn(env[a0], env[a1], env[a2])
        return step
    rest = [_getter(a, slot_of) for a in args[1:]]
    kw = {k: _getter(v, slot_of) for k, v in kwargs.items()}
    if args and isinstance(args[0], Node) and not any(d for d, _ in rest) \
            and not any(d for d, _ in kw.values()):
        a0, consts = slot_of[args[0]], tuple(v for _, v in rest)
        kwc = {k: v for k, (_, v) in kw.items()}
        if kwc:
            def step(env):
                env[out] = fn(env[a0], *consts, **kwc)
        else:
            def step(env):
                env[out] = fn(env[a0], *consts)
        return step
    get_args, get_kwargs = _reader(tuple(args), slot_of), _reader(dict(kwargs), slot_of)

    def step(env):
        env[out] = fn(*get_args(env), **get_kwargs(env))
    return step


def _reader(value, slot_of: dict) -> Callable:
    """``read(env)``: ``value`` (args or kwargs) with its nodes' values from the slots."""
    dyn, get = _getter(value, slot_of)
    return get if dyn else (lambda env, v=get: v)


def _multi_step(fn: Callable, args: list, outs: list[int], slot_of: dict) -> Callable:
    """A closure ``step(env)`` writing the values ``fn`` returns into the slots ``outs``; the
    arguments taken by one ``itemgetter`` where they are all slots (a decode layer's attention
    step: 5-7 slots, its three results)."""
    if len(args) > 1 and all(isinstance(a, Node) for a in args):
        get_args = operator.itemgetter(*[slot_of[a] for a in args])
    else:
        get_args = _reader(tuple(args), slot_of)
    if len(outs) == 3:
        o0, o1, o2 = outs

        def step(env):
            env[o0], env[o1], env[o2] = fn(*get_args(env))
        return step

    def step(env):
        for slot, value in zip(outs, fn(*get_args(env))):
            env[slot] = value
    return step


# Python wrappers whose C method takes the same arguments: the wrapper only adds its frame
# (``Tensor.split``: 6.1 -> 3.7 us a call; 12 a GPT-2 decode step)
_C_METHODS = {"split": torch._C.TensorBase.split}


def _size_of(x: torch.Tensor, dim: int) -> int:
    return x.shape[dim]


# size arithmetic: the program runs on concrete ints (``torch.sym_sum``: 0.9 -> 0.15 us; an
# exported Llama decode step's ``aten.sym_size.int`` through the dispatcher, the caches cold
# after a token's weights: 9 us)
_CONCRETE = {torch.sym_sum: sum, torch.ops.aten.sym_size.int: _size_of}


# results nothing reads need not be computed when computing them has no effect: size arithmetic
# dynamo leaves behind (a GPT-2 decode step's ``sym_sum`` and ``numel``, 5-10 us each there)
_PURE_METHODS = {"numel", "size", "dim", "stride"}
_PURE_FUNCTIONS = {torch.sym_sum, operator.add, operator.sub, operator.mul, operator.truediv,
                   operator.floordiv, operator.mod, operator.neg, operator.getitem, operator.eq,
                   operator.ne, operator.lt, operator.le, operator.gt, operator.ge}


def _pure(n: Node) -> bool:
    if n.op == "call_method":
        return n.target in _PURE_METHODS
    return n.op == "call_function" and target_in(n, _PURE_FUNCTIONS)


def _concrete(target) -> Callable:
    try:
        return _CONCRETE.get(target, target)
    except TypeError:  # unhashable
        return target


def _method(name: str, self_is_tensor: bool) -> Callable:
    if self_is_tensor and hasattr(torch.Tensor, name):
        return _C_METHODS.get(name) or getattr(torch.Tensor, name)
    return lambda self, *a, **k: getattr(self, name)(*a, **k)


def _is_tensor_node(node: Node, metas: dict | None) -> bool:
    if metas is not None and node in metas:
        return isinstance(metas[node], TensorMeta)
    return isinstance(node.meta.get("example_value"), torch.Tensor)


def fetch_attr(gm: GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _drop_unread(nodes: list[Node], kernels: list[KernelStep], strided: dict,
                 no_step: set) -> None:
    """Add to ``no_step`` the nodes whose results nothing reads, where computing them has no
    effect: dynamo's leftover size arithmetic, and in an exported graph the functional ATen ops
    that only fed what a kernel replaced without reading them (a decode step's causal mask for its
    lone query, which attention drops: 11 ATen calls a token, 0.1 ms with the caches cold after
    the weights' stream). A made view reads its chain's root, so a root stays while a view of it
    does."""
    reads = {}   # a node a kernel replaces -> the nodes that kernel reads
    needed_roots = set()   # and the nodes kernels read, which stay (a view's root read in place)
    for k in kernels:
        args = {a for a in k.args if isinstance(a, Node)}
        needed_roots |= args
        for c in (*k.covers, k.output):
            reads[c] = args
    for n in reversed(nodes):
        if n not in reads and n not in needed_roots and _droppable(n) and all(
                u in no_step or (u in reads and n not in reads[u]) for u in n.users):
            no_step.add(n)
        elif n in strided:
            needed_roots.add(strided[n].root)


def _droppable(n: Node) -> bool:
    if _pure(n):
        return True
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
        not n.is_impure()


_TO = {torch.ops.aten.to.dtype_layout, torch.ops.aten.to.dtype, torch.ops.aten.to.device}


def is_identity(n: Node, metas: dict | None) -> bool:
    """Whether ``n`` gives back its input tensor itself, as an exported graph's eval-mode dropout
    does (``aten.dropout(x, p, False)``), and its ``aten.to`` to the dtype, device and layout
    the input has (GPT-2's position embeddings: 20 us a token, the caches cold); or may be taken
    to, as a view keeping the input's shape and strides, or a product by exactly 1 (``_MULS``),
    that is not an output of the graph and whose input and result nothing changes in place
    (GPT-2's ``view`` and ``alias`` of the final norm: a chain then reaches through them,
    lowering/chain.py)."""
    if n.op not in ("call_function", "call_method") or not n.args or \
            not isinstance(n.args[0], Node):
        return False
    if _same_layout_view(n, metas):
        return True
    if n.op != "call_function":
        return False
    if n.target is torch.ops.aten.dropout.default:
        return len(n.args) == 3 and n.args[2] is False
    if _times_one(n):
        return _same_layout(n, metas)
    if n.target not in _TO or metas is None:
        return False
    meta = metas.get(n.args[0])
    params = n.target._schema.arguments[1:]   # positional ones named (``copy`` may be one)
    kw = {**{a.name: v for a, v in zip(params, n.args[1:])}, **n.kwargs}
    return isinstance(meta, TensorMeta) and kw.get("dtype", meta.dtype) == meta.dtype and \
        torch.device(kw.get("device") or meta.device).type == meta.device and \
        kw.get("layout") in (None, torch.strided) and not kw.get("copy") and \
        kw.get("memory_format") in (None, torch.preserve_format)


# views whose result, where it keeps the input's shape and strides, is the input's memory from
# its first element (``as_strided`` and slices may start elsewhere)
SAME_LAYOUT_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.alias.default,
                     torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                     "view", "reshape"}


# ``x * 1`` gives x's own values, bit for bit (-0.0, inf and NaN included): transformers' rotary
# embeddings scale cos and sin by an ``attention_scaling`` of 1.0 (two steps of 6 us a token,
# the caches cold, in an exported Llama decode step)
_MULS = {torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, operator.mul, torch.mul}


def _times_one(n: Node) -> bool:
    if not target_in(n, _MULS) or n.kwargs or len(n.args) != 2:
        return False
    one = n.args[1]
    return type(one) in (int, float) and one == 1


def _same_layout_view(n: Node, metas: dict | None) -> bool:
    return target_in(n, SAME_LAYOUT_VIEWS) and _same_layout(n, metas)


def _same_layout(n: Node, metas: dict | None) -> bool:
    """Whether ``n``'s result has its input's shape, strides and dtype, and neither is an output
    of the graph nor changed in place: the input may stand for it."""
    if metas is None:
        return False
    a, b = metas.get(n.args[0]), metas.get(n)
    return isinstance(a, TensorMeta) and isinstance(b, TensorMeta) and \
        tuple(a.shape) == tuple(b.shape) and tuple(a.stride) == tuple(b.stride) and \
        a.dtype == b.dtype and not any(u.op == "output" or is_inplace(u)
                                       for u in (*n.users, *n.args[0].users))


def build_program(gm: GraphModule, kernels: list[KernelStep] | None = None,
                  metas: dict | None = None) -> Program:
    """The flat program for ``gm`` with the given kernel steps replacing the nodes they cover."""
    kernels = kernels or []
    by_output = {k.output: k for k in kernels}
    given = {x for k in kernels for x in k.extra}   # a slot, filled by their kernel's step
    covered = {n for k in kernels for n in k.covers} - set(by_output) - given
    nodes = list(gm.graph.nodes)
    strided, no_step = views.collapse(nodes, metas, covered, set(by_output) | given)
    _drop_unread(nodes, kernels, strided, no_step)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    slot_of: dict[Node, int] = {n: i for i, n in enumerate(placeholders)}
    template: list = [None] * len(placeholders)
    planned: list[tuple[Callable, list[Node]]] = []  # (step, nodes it reads)
    owners: list[Node | None] = []                  # the node of each (None: the output)
    output_fn = None
    deferred: list[int] = []   # slots of views made with the output (KernelStep.deferred)
    for n in nodes:
        if n.op == "placeholder" or n in covered:
            continue
        if n not in by_output and is_identity(n, metas):   # its input's slot is its own
            if n.args[0] in slot_of:   # (none where nothing reads either)
                slot_of[n] = slot_of[n.args[0]]
            continue
        if n in no_step:
            continue
        if n.op == "get_attr":
            slot_of[n] = len(template)
            template.append(fetch_attr(gm, n.target))
            continue
        if n.op == "output":
            output_fn = _output(n.args[0], slot_of)
            reads = n.all_input_nodes
            planned.append((None, reads))
            owners.append(None)
            continue
        if n in given:   # its kernel's step fills it, before or after this point
            _slot(n, slot_of, template)
            continue
        slot_of[n] = len(template)
        template.append(None)
        k = by_output.get(n)
        if n in strided:
            chain = strided[n]
            step = views.make_step(chain, slot_of[chain.root], slot_of[n])
            reads = [chain.root]
        elif k is not None:
            for c in k.covers:
                if c is not n and c not in k.extra and any(u not in k.covers for u in c.users):
                    raise ValueError(f"kernel {k.name} covers {c.name}, which is used outside it")
            if k.extra:
                outs = [slot_of[n]] + [_slot(x, slot_of, template) for x in k.extra]
                step = _multi_step(k.fn, k.args, outs, slot_of)
                if k.deferred:
                    for x in k.extra:
                        if any(u.op != "output" and u not in k.covers for u in x.users):
                            raise ValueError(f"kernel {k.name} defers {x.name}, which "
                                             "a node other than the output reads")
                    deferred += outs[1:]
            else:
                step = make_step(k.fn, tuple(k.args), {}, slot_of[n], slot_of)
            step.kernel, step.kernels = k.name, k.parts or [k.name]
            reads = [a for a in k.args if isinstance(a, Node)]
        elif n.op == "call_function":
            step = make_step(_concrete(n.target), n.args, n.kwargs, slot_of[n], slot_of)
            reads = n.all_input_nodes
        elif n.op == "call_method":
            fn = _method(n.target, _is_tensor_node(n.args[0], metas))
            step = make_step(fn, n.args, n.kwargs, slot_of[n], slot_of)
            reads = n.all_input_nodes
        elif n.op == "call_module":
            step = make_step(gm.get_submodule(n.target), n.args, n.kwargs, slot_of[n], slot_of)
            reads = n.all_input_nodes
        else:
            raise NotImplementedError(f"FX node kind {n.op!r} ({n.name})")
        planned.append((step, reads))
        owners.append(n)
    planned = memo.memoise(planned, owners, slot_of, metas, nodes)
    # free each intermediate slot after the step that reads it last
    last: dict[int, int] = {}
    for idx, (_, reads) in enumerate(planned):
        for r in reads:
            last[slot_of[r]] = idx
    n_in = len(placeholders)
    for n, s in slot_of.items():  # constants only kernels read (packed into them): not held
        if n.op == "get_attr" and s not in last:
            template[s] = None
    dead_at: dict[int, list[int]] = {}
    for s, idx in last.items():
        if s >= n_in and template[s] is None:
            dead_at.setdefault(idx, []).append(s)
    steps = [(step, tuple(dead_at.get(i, ()))) for i, (step, _) in enumerate(planned)
             if step is not None]
    output_fn = output_fn or (lambda env: None)
    if deferred:
        output_fn = _made_views(output_fn, deferred)
    return Program(n_in, template, steps, output_fn)


def _made_views(output_fn: Callable, slots: list[int]) -> Callable:
    """``output_fn`` after the deferred views in ``slots`` are made: back to back, where each
    costs its warm price (a decode step's KV cache views, made between two layers' weight
    streams, cost several times that; kernels/kv_cache.py)."""
    as_strided = torch.Tensor.as_strided

    def output(env):
        for s in slots:
            v = env[s]
            if type(v) is tuple:
                env[s] = as_strided(*v)
        return output_fn(env)
    return output


def _slot(n: Node, slot_of: dict, template: list) -> int:
    """``n``'s slot, made on first asking."""
    if n not in slot_of:
        slot_of[n] = len(template)
        template.append(None)
    return slot_of[n]


def getitem_node(node: Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
