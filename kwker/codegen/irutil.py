"""Small structured-programming layer over ``llvmlite.ir``.

Kernels are written as loops and branches over mutable locals (allocas in the entry block, which
LLVM's SROA/mem2reg turn into SSA registers at O3), so an emitter reads like the algorithm it
reproduces. Only ``llvmlite.ir`` is used here: emitting IR needs neither LLVM nor torch.
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir

i1, i8, i16, i32, i64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
f32, f64 = ir.FloatType(), ir.DoubleType()
void = ir.VoidType()
ptr = ir.PointerType()

DTYPES = {  # torch dtype name -> (LLVM type, is_float, is_signed)
    "float32": (f32, True, True), "float64": (f64, True, True),
    "int64": (i64, False, True), "int32": (i32, False, True), "int16": (i16, False, True),
    "int8": (i8, False, True), "uint8": (i8, False, False),
    # 16-bit floats are stored and moved as i16 bit patterns, compared after widening to float
    "float16": (i16, True, True), "bfloat16": (i16, True, True),
}
HALF_FLOATS = ("float16", "bfloat16")


class NamedType(ir.types.Type):
    """An LLVM type llvmlite.ir lacks, by its IR name (``bfloat``, ``x86_amx``): enough to
    declare intrinsics that take or return it and to pass such values on."""

    def __init__(self, name: str):
        self.name = name

    def _to_string(self) -> str:
        return self.name

    def __eq__(self, other) -> bool:
        return isinstance(other, NamedType) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class FunctionPointer(ir.PointerType):
    """An opaque ``ptr`` (as it prints) that knows the type of the function it points to, which
    ``IRBuilder.call`` reads from its callee's type: a call through an address held as data."""

    def __init__(self, fnty: ir.FunctionType):
        super().__init__()
        self.pointee = fnty


def const(ty: ir.Type, value) -> ir.Constant:
    return ir.Constant(ty, value)


def smin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """The lesser of two signed integers."""
    return b.select(b.icmp_signed("<", x, y), x, y)


def vec(ty: ir.Type, lanes: int) -> ir.VectorType:
    return ir.VectorType(ty, lanes)


def new_module(name: str) -> ir.Module:
    return ir.Module(name=name)


def defined(module: ir.Module, name: str) -> ir.Function | None:
    """The function ``name`` if this module already has it: shared helpers are emitted once."""
    try:
        return module.get_global(name)
    except KeyError:
        return None


def intrinsic(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    """Declare (once) an LLVM intrinsic or external function."""
    return defined(module, name) or ir.Function(module, ir.FunctionType(ret, args), name)


def aligned_malloc(f: Fn, nbytes) -> tuple[ir.Value, ir.Value]:
    """(raw pointer to free, 64-byte aligned pointer) of a ``nbytes`` (int or i64) heap buffer."""
    b = f.b
    malloc = intrinsic(f.module, "malloc", ptr, [i64])
    size = nbytes if isinstance(nbytes, ir.Value) else const(i64, nbytes)
    raw = b.call(malloc, [b.add(size, const(i64, 64))])
    addr = b.ptrtoint(raw, i64)
    pad = b.and_(b.sub(const(i64, 64), b.and_(addr, const(i64, 63))), const(i64, 63))
    return raw, b.gep(raw, [pad], inbounds=True, source_etype=i8)


class Var:
    """A mutable local: an alloca that reads and writes like a variable."""

    def __init__(self, fn: Fn, ty: ir.Type, name: str):
        self.fn, self.ty = fn, ty
        with fn.b.goto_block(fn.entry):
            self.slot = fn.b.alloca(ty, name=name)

    def get(self) -> ir.Value:
        return self.fn.b.load(self.slot, typ=self.ty)

    def set(self, value) -> None:
        if not isinstance(value, ir.Value):
            value = const(self.ty, value)
        self.fn.b.store(value, self.slot)


class Fn:
    """A function under construction with structured control flow helpers.

    ``internal`` functions are helpers private to their module (no symbol clashes when several
    objects are linked into one engine); exported kernels use ``external``.
    """

    def __init__(self, module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type],
                 arg_names: list[str] | None = None, internal: bool = True):
        self.module = module
        self.fn = ir.Function(module, ir.FunctionType(ret, args), name=name)
        if internal:
            self.fn.linkage = "internal"
        for a, n in zip(self.fn.args, arg_names or []):
            a.name = n
        self.entry = self.fn.append_basic_block("entry")
        start = self.fn.append_basic_block("start")
        self.b = ir.IRBuilder(start)
        self._loops: list[tuple[ir.Block, ir.Block]] = []

    @property
    def args(self):
        return self.fn.args

    # -- locals -----------------------------------------------------------------------------
    def var(self, ty: ir.Type, init=None, name: str = "") -> Var:
        v = Var(self, ty, name)
        if init is not None:
            v.set(init)
        return v

    def array(self, ty: ir.Type, count: int, name: str = "") -> ir.Value:
        """A fixed-size local array (in the entry block), as an opaque pointer."""
        with self.b.goto_block(self.entry):
            slot = self.b.alloca(ty, size=const(i32, count), name=name)
        slot.type = ptr  # opaque, so GEPs may address it with any element type
        return slot

    # -- control flow -----------------------------------------------------------------------
    @contextmanager
    def if_(self, cond: ir.Value, likely: bool | None = None):
        with self.b.if_then(cond, likely=likely):
            yield

    def if_else(self, cond: ir.Value, likely: bool | None = None):
        return self.b.if_else(cond, likely=likely)

    @contextmanager
    def while_(self, cond_fn):
        """``while cond_fn(): body``; ``break_``/``continue_`` work inside."""
        head = self.b.append_basic_block("while.head")
        body = self.b.append_basic_block("while.body")
        done = self.b.append_basic_block("while.end")
        self.b.branch(head)
        self.b.position_at_end(head)
        self.b.cbranch(cond_fn(), body, done)
        self.b.position_at_end(body)
        self._loops.append((head, done))
        yield
        self._loops.pop()
        if not self.b.block.is_terminated:
            self.b.branch(head)
        self.b.position_at_end(done)

    @contextmanager
    def loop(self):
        """An endless loop left with ``break_`` (or ``ret``)."""
        with self.while_(lambda: const(i1, 1)):
            yield

    @contextmanager
    def for_range(self, start, stop, step: int = 1, name: str = "i"):
        """``for i in range(start, stop, step)`` over i64; yields the current index value."""
        i = self.var(i64, start if isinstance(start, ir.Value) else const(i64, start), name)
        stop = stop if isinstance(stop, ir.Value) else const(i64, stop)
        cmp = "<" if step > 0 else ">"
        head = self.b.append_basic_block(f"{name}.head")
        body = self.b.append_basic_block(f"{name}.body")
        latch = self.b.append_basic_block(f"{name}.next")
        done = self.b.append_basic_block(f"{name}.end")
        self.b.branch(head)
        self.b.position_at_end(head)
        self.b.cbranch(self.b.icmp_signed(cmp, i.get(), stop), body, done)
        self.b.position_at_end(body)
        self._loops.append((latch, done))
        yield i.get()
        self._loops.pop()
        if not self.b.block.is_terminated:
            self.b.branch(latch)
        self.b.position_at_end(latch)
        i.set(self.b.add(i.get(), const(i64, step)))
        self.b.branch(head)
        self.b.position_at_end(done)

    def _jump(self, target: ir.Block) -> None:
        self.b.branch(target)
        self.b.position_at_end(self.b.append_basic_block("dead"))

    def break_(self) -> None:
        self._jump(self._loops[-1][1])

    def continue_(self) -> None:
        self._jump(self._loops[-1][0])

    def ret(self, value: ir.Value | None = None) -> None:
        if value is None:
            self.b.ret_void()
        else:
            self.b.ret(value)
        self.b.position_at_end(self.b.append_basic_block("dead"))

    def finish(self) -> ir.Function:
        """Close the function: allocas' block jumps to the code, a void tail returns."""
        if not self.b.block.is_terminated:
            if isinstance(self.fn.function_type.return_type, ir.VoidType):
                self.b.ret_void()
            else:
                self.b.unreachable()
        with self.b.goto_block(self.entry):
            self.b.branch(self.fn.blocks[1])
        return self.fn

    # -- memory -----------------------------------------------------------------------------
    def gep(self, base: ir.Value, index: ir.Value, ty: ir.Type) -> ir.Value:
        return self.b.gep(base, [index], inbounds=True, source_etype=ty)

    def load(self, ty: ir.Type, base: ir.Value, index: ir.Value, align: int | None = None):
        return self.b.load(self.gep(base, index, ty), typ=ty, align=align)

    def store(self, value: ir.Value, base: ir.Value, index: ir.Value, align: int | None = None):
        self.b.store(value, self.gep(base, index, value.type), align=align)

    def load_vec(self, ty: ir.Type, lanes: int, base: ir.Value, index: ir.Value) -> ir.Value:
        """Load of ``lanes`` elements starting at ``base[index]``, element-aligned only."""
        vt = vec(ty, lanes)
        size = {f32: 4, f64: 8}.get(ty) or ty.width // 8
        return self.b.load(self.gep(base, index, ty), typ=vt, align=size)

    def arg_ptr(self, args: ir.Value, slot: int) -> ir.Value:
        """The ``slot``-th entry of an i64 argument block, read as a pointer."""
        return self.b.load(self.gep(args, const(i64, slot), i64), typ=ptr)

    def arg_i64(self, args: ir.Value, slot: int) -> ir.Value:
        return self.b.load(self.gep(args, const(i64, slot), i64), typ=i64)

    # -- arithmetic shorthands --------------------------------------------------------------
    def i64(self, v) -> ir.Value:
        return v if isinstance(v, ir.Value) else const(i64, v)

    def call(self, fn: ir.Function, *args) -> ir.Value:
        return self.b.call(fn, list(args))

    def call_intrinsic(self, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
        fn = intrinsic(self.module, name, ret, [a.type for a in args])
        return self.b.call(fn, args)
