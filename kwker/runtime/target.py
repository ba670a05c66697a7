"""The CPU that kernels are compiled for.

The target is never part of a kernel spec: the same spec compiles to different code on different
CPUs, and the cache key carries the target. ``KWKER_CPU`` / ``KWKER_FEATURES`` override the host
(as numba's NUMBA_CPU_NAME does) so tests can emit AVX-512 code on an AVX2 machine and a fleet
can be prewarmed for another CPU type.

A CPU named without features (``KWKER_CPU=znver3`` alone, ``make_target("znver3", "")``) gets the
features LLVM itself gives that CPU name: llvmlite has no call that lists them, so
``cpu_features`` compiles one tiny probe per feature for that CPU and reads the assembly (AVX2
probe: a ``<8 x i32>`` add is one ``vpaddd %ymm`` only when LLVM may use AVX2). The probes run in
a child process (about 0.1 s, once per process and name) because LLVM aborts the process on a
name it does not know or on a 32-bit CPU; such a name is an error that lists close names.
Explicit features are taken as given, unchecked.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import llvmlite.binding as llvm

from . import tile_permission

TILE_MODES = ("", "amx", "emulated")
# optimisation level of emulated tile kernels (Target.compile_level)
EMULATED_OPT = 1


@dataclass(frozen=True)
class Target:
    triple: str
    cpu: str
    features: str  # LLVM feature string, e.g. "+avx2,+fma,-avx512f"
    opt_level: int = 3
    # how tile kernels (codegen/tiles.py) run: "amx" on the tile unit, "emulated" as AVX-512 code
    # of the same semantics (any AVX-512 CPU: tests), "" not at all (the vector kernels)
    tiles: str = ""

    def has(self, feature: str) -> bool:
        return f"+{feature}" in self.features.split(",")

    @property
    def compile_level(self) -> int:
        """The optimisation level LLVM compiles this target's kernels at: ``opt_level``, but
        ``EMULATED_OPT`` for emulated tiles, which exist to check the tile kernels' logic on any
        AVX-512 CPU, not to run fast: -O1 compiles them in two thirds of the time (the GEMM
        family's emulation test 86.6 -> 57.4 s on Emerald Rapids) to the same values (no level
        reorders floating-point operations)."""
        return min(self.opt_level, EMULATED_OPT) if self.tiles == "emulated" else self.opt_level

    @property
    def vector_bits(self) -> int:
        """Widest vector register the kernels may use."""
        if self.has("avx512f") and self.has("avx512bw") and self.has("avx512vl"):
            return 512
        if self.has("avx2"):
            return 256
        return 128

    def describe(self) -> str:
        isa = {512: "AVX-512", 256: "AVX2", 128: "SSE"}[self.vector_bits]
        tiles = {"amx": ", AMX tiles", "emulated": ", emulated tiles"}.get(self.tiles, "")
        return f"{self.cpu} ({isa}{', FMA' if self.has('fma') else ''}{tiles})"


_INTERESTING = ("sse4.2", "avx", "avx2", "fma", "bmi", "bmi2", "popcnt", "lzcnt", "f16c",
                "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vbmi",
                "avx512vbmi2", "avx512vpopcntdq", "avx512bf16", "avx512fp16", "avx512vnni",
                "avxvnni", "amx-tile", "amx-bf16", "amx-int8", "amx-fp16")

# One probe per feature of _INTERESTING: ``(signature, body, pattern)``, a function in generic IR
# (never a target intrinsic: LLVM cannot select one without its feature) whose assembly matches
# ``pattern`` only when LLVM may use that feature. tests/runtime/test_target.py checks each probe
# both ways (a baseline CPU plus the feature; a CPU that has it minus the feature).
_SHUFFLE = ", ".join(f"i32 {(i * 37 + 11) % 128}" for i in range(64))
_PROBES = {
    # XOP CPUs (bdver*) compare with vpcomgtq, and XOP implies SSE4.2 in LLVM
    "sse4.2": ("<2 x i64> (<2 x i64> %a, <2 x i64> %b)",
               "%c = icmp sgt <2 x i64> %a, %b %r = sext <2 x i1> %c to <2 x i64>",
               r"pcmpgtq|vpcomgtq"),
    "avx": ("<8 x float> (<8 x float> %a, <8 x float> %b)", "%r = fadd <8 x float> %a, %b",
            r"vaddps\s[^\n]*%ymm"),
    "avx2": ("<8 x i32> (<8 x i32> %a, <8 x i32> %b)", "%r = add <8 x i32> %a, %b",
             r"vpaddd\s[^\n]*%ymm"),
    # FMA3 (vfmadd213ps); FMA4 (bdver*) would be vfmaddps
    "fma": ("<4 x float> (<4 x float> %a, <4 x float> %b, <4 x float> %c)",
            "%r = call <4 x float> @llvm.fma.v4f32(<4 x float> %a, <4 x float> %b, "
            "<4 x float> %c)", r"vfmadd\d{3}"),
    "bmi": ("i64 (i64 %a)", "%r = call i64 @llvm.cttz.i64(i64 %a, i1 false)", r"\btzcnt"),
    "bmi2": ("i64 (i64 %a, i64 %b)", "%r = shl i64 %a, %b", r"\bshlx"),
    "popcnt": ("i64 (i64 %a)", "%r = call i64 @llvm.ctpop.i64(i64 %a)", r"\bpopcnt"),
    "lzcnt": ("i64 (i64 %a)", "%r = call i64 @llvm.ctlz.i64(i64 %a, i1 false)", r"\blzcnt"),
    "f16c": ("<4 x float> (<4 x half> %a)", "%r = fpext <4 x half> %a to <4 x float>",
             r"vcvtph2ps"),
    "avx512f": ("<16 x float> (<16 x float> %a, <16 x float> %b)",
                "%r = fadd <16 x float> %a, %b", r"vaddps\s[^\n]*%zmm"),
    "avx512bw": ("<64 x i8> (<64 x i8> %a, <64 x i8> %b)", "%r = add <64 x i8> %a, %b",
                 r"vpaddb\s[^\n]*%zmm"),
    "avx512dq": ("<8 x i64> (<8 x double> %a)", "%r = fptosi <8 x double> %a to <8 x i64>",
                 r"vcvttpd2qq\s[^\n]*%zmm"),
    # ymm vpsravq needs AVX512VL (AVX512F alone widens it to zmm, AVX2 has no vpsravq)
    "avx512vl": ("<4 x i64> (<4 x i64> %a, <4 x i64> %b)", "%r = ashr <4 x i64> %a, %b",
                 r"vpsravq\s[^\n]*%ymm"),
    "avx512cd": ("<16 x i32> (<16 x i32> %a)",
                 "%r = call <16 x i32> @llvm.ctlz.v16i32(<16 x i32> %a, i1 false)", r"vplzcntd"),
    "avx512vbmi": ("<64 x i8> (<64 x i8> %a, <64 x i8> %b)",
                   f"%r = shufflevector <64 x i8> %a, <64 x i8> %b, <64 x i32> <{_SHUFFLE}>",
                   r"vperm(?:t2|i2)?b\s"),
    "avx512vbmi2": ("<32 x i16> (<32 x i16> %a, <32 x i16> %b, <32 x i16> %s)",
                    "%r = call <32 x i16> @llvm.fshl.v32i16(<32 x i16> %a, <32 x i16> %b, "
                    "<32 x i16> %s)", r"vpshldvw"),
    "avx512vpopcntdq": ("<16 x i32> (<16 x i32> %a)",
                        "%r = call <16 x i32> @llvm.ctpop.v16i32(<16 x i32> %a)", r"vpopcntd\s"),
    "avx512bf16": ("<16 x bfloat> (<16 x float> %a)",
                   "%r = fptrunc <16 x float> %a to <16 x bfloat>",
                   r"vcvtneps2bf16\s[^\n]*%zmm"),
    "avx512fp16": ("<32 x half> (<32 x half> %a, <32 x half> %b)",
                   "%r = fadd <32 x half> %a, %b", r"vaddph\s[^\n]*%zmm"),
}

# Features only a target intrinsic shows (no generic IR becomes a tile or VNNI instruction):
# name -> (module defining @p, pattern, features added, feature that must be there first).
# LLVM aborts the process when it cannot select an intrinsic, so these run in a child that
# reports after each probe and is restarted past one that killed it (that feature is missing).
# The AMX products are probed only after amx-tile was found; AVX-VNNI is the VEX form, asked for
# with AVX512_VNNI off.
def _tile_probe(op: str) -> str:
    """Zero a tile, multiply zero tiles with ``op`` (if any) and store the result."""
    decl = call = ""
    result = "%z"
    if op:
        decl = (f"declare x86_amx @llvm.x86.{op}.internal(i16, i16, i16, x86_amx, x86_amx, "
                "x86_amx)\n")
        call = (f"  %r = call x86_amx @llvm.x86.{op}.internal(i16 16, i16 64, i16 64, "
                "x86_amx %z, x86_amx %z, x86_amx %z)\n")
        result = "%r"
    return ("declare x86_amx @llvm.x86.tilezero.internal(i16, i16)\n"
            "declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)\n"
            + decl + "define void @p(ptr %c) {\n"
            "  %z = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)\n" + call +
            "  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c, i64 64, "
            f"x86_amx {result})\n  ret void\n}}\n")


def _vnni_probe(bits: int) -> str:
    acc, ops = f"<{bits // 32} x i32>", f"<{bits // 8} x i8>"
    name = f"@llvm.x86.avx512.vpdpbusd.{bits}"
    return (f"declare {acc} {name}({acc}, {ops}, {ops})\n"
            f"define {acc} @p({acc} %a, {ops} %b, {ops} %c) {{\n"
            f"  %r = call {acc} {name}({acc} %a, {ops} %b, {ops} %c)\n  ret {acc} %r\n}}\n")


_INTRINSIC_PROBES = {
    "avx512vnni": (_vnni_probe(512), r"vpdpbusd\s[^\n]*%zmm", "", "avx512f"),
    "avxvnni": (_vnni_probe(256), r"\{vex\}\s*vpdpbusd", "-avx512vnni", "avx2"),
    "amx-tile": (_tile_probe(""), r"\btilezero\b", "", None),
    "amx-bf16": (_tile_probe("tdpbf16ps"), r"\btdpbf16ps\b", "", "amx-tile"),
    "amx-int8": (_tile_probe("tdpbusd"), r"\btdpbusd\b", "", "amx-tile"),
    "amx-fp16": (_tile_probe("tdpfp16ps"), r"\btdpfp16ps\b", "", "amx-tile"),
}

# As _CHILD, for _INTRINSIC_PROBES ({"triple", "cpu", "features", "probes": {name: [module,
# pattern, extra]}}): a JSON line before and after each probe, flushed, so the parent sees
# which probe killed it.
_INTRINSIC_CHILD = r"""
import json, re, sys
import llvmlite.binding as llvm
req = json.load(sys.stdin)
llvm.initialize_native_target()
llvm.initialize_native_asmprinter()
for name, (module, pattern, extra) in req["probes"].items():
    print(json.dumps([name, None]), flush=True)
    features = ",".join(f for f in (req["features"], extra) if f)
    tm = llvm.Target.from_triple(req["triple"]).create_target_machine(
        cpu=req["cpu"], features=features, opt=2)
    asm = tm.emit_assembly(llvm.parse_assembly(module))
    print(json.dumps([name, re.search(pattern, asm) is not None]), flush=True)
"""


def _intrinsic_features(cpu: str, features: str, found: dict) -> dict[str, bool]:
    """``_INTRINSIC_PROBES`` for ``cpu``, each only once the feature it needs was found."""
    result: dict[str, bool] = {}
    while len(result) < len(_INTRINSIC_PROBES):
        todo, ready = {}, True
        for name, (module, pattern, extra, needs) in _INTRINSIC_PROBES.items():
            if name in result:
                continue
            have = True if needs is None else found.get(needs, result.get(needs))
            if have is None:       # decided by a probe of this round: wait for it
                ready = False
            elif not have:
                result[name] = False
            elif ready:
                todo[name] = [module, pattern, extra]
        if not todo:
            continue
        req = {"triple": llvm.get_process_triple(), "cpu": cpu, "features": features,
               "probes": todo}
        r = subprocess.run([sys.executable, "-c", _INTRINSIC_CHILD], input=json.dumps(req),
                           capture_output=True, text=True, check=False)
        for line in r.stdout.splitlines():
            name, ok = json.loads(line)
            result[name] = bool(ok)      # None: the probe that killed the child
        if r.returncode and not any(n in result for n in todo):
            raise UnknownCPU(f"kwker: LLVM failed probing {cpu!r}: {r.stderr.strip()[-300:]}")
    return result


# Run as ``python -c`` with a JSON request on stdin ({"triple", "cpu", "features", "probes"}):
# prints {name: whether the probe's pattern matched}. LLVM warns on stderr about a CPU name it
# does not know, then aborts when it compiles for it.
_CHILD = r"""
import json, re, sys
import llvmlite.binding as llvm
req = json.load(sys.stdin)
llvm.initialize_native_target()
llvm.initialize_native_asmprinter()
tm = llvm.Target.from_triple(req["triple"]).create_target_machine(
    cpu=req["cpu"], features=req["features"], opt=2)
found = {}
for i, (name, (signature, body, pattern)) in enumerate(req["probes"].items()):
    ret, args = signature.split(" (", 1)
    ir = f"define {ret} @p{i}({args} {{\n  {body}\n  ret {ret} %r\n}}\n"
    found[name] = re.search(pattern, tm.emit_assembly(llvm.parse_assembly(ir))) is not None
print(json.dumps(found))
"""
_UNKNOWN = "is not a recognized processor"


class UnknownCPU(ValueError):
    """A CPU name LLVM does not know (or not a 64-bit x86 CPU), and no features given."""


def _run_child(cpu: str, features: str, probes: dict) -> subprocess.CompletedProcess:
    req = {"triple": llvm.get_process_triple(), "cpu": cpu, "features": features,
           "probes": probes}
    return subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(req),
                          capture_output=True, text=True, check=False)


def _known_cpus() -> list[str]:
    """The CPU names LLVM knows (what ``llc -mcpu=help`` lists)."""
    r = _run_child("help", "", {})
    return [line.split()[0] for line in r.stderr.splitlines()
            if line.startswith("  ") and "- Select the" in line]


def llvm_features(cpu: str, features: str = "") -> dict[str, bool]:
    """Which ``_INTERESTING`` features LLVM uses in code for ``cpu`` with ``features`` added
    (empty: the CPU name's own), found by compiling the probes in a child process."""
    r = _run_child(cpu, features, _PROBES)
    if r.returncode == 0 and _UNKNOWN not in r.stderr:
        found = json.loads(r.stdout.strip().splitlines()[-1])
        return {**found, **_intrinsic_features(cpu, features, found)}
    if _UNKNOWN in r.stderr:
        why = f"LLVM {llvm.llvm_version_info[0]} does not know the CPU name {cpu!r}"
        close = difflib.get_close_matches(cpu, _known_cpus(), n=4, cutoff=0.6)
        if close:
            why += f" (did you mean {' or '.join(map(repr, close))}?)"
    else:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        why = f"LLVM cannot compile x86-64 code for the CPU {cpu!r} ({last})"
    raise UnknownCPU(
        f"kwker: {why}. Set KWKER_CPU to an x86-64 CPU name LLVM knows (e.g. x86-64-v3, "
        f"haswell, skylake-avx512, icelake-server, sapphirerapids, znver3, znver4), or give "
        f"its features too, e.g. KWKER_FEATURES=+avx,+avx2,+fma,-avx512f")


@functools.lru_cache(maxsize=None)
def cpu_features(cpu: str) -> str:
    """The feature string a CPU name implies, in ``_INTERESTING`` order ("+sse4.2,+avx,+avx2,
    +fma,...,-avx512f,..."), as LLVM sees it; ``UnknownCPU`` for a name LLVM does not know."""
    found = llvm_features(cpu)
    return ",".join(("+" if found[f] else "-") + f for f in _INTERESTING)


def _host_features() -> str:
    host = llvm.get_host_cpu_features()
    return ",".join(("+" if host.get(f) else "-") + f for f in _INTERESTING if f in host)


def host_has_amx() -> bool:
    """Whether this machine's CPU (not a ``KWKER_CPU`` override) has the AMX tile unit."""
    return "+amx-tile" in _host_features().split(",")


@functools.lru_cache(maxsize=None)
def host_target() -> Target:
    """Host CPU name and features from LLVM, unless overridden by the environment.

    ``KWKER_FEATURES`` (non-empty) is used as given; else a ``KWKER_CPU`` name implies the
    features LLVM gives that CPU (``cpu_features``); else both are the host's. ``KWKER_TILES``
    picks how tile kernels run (``tile_mode``)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    named = os.environ.get("KWKER_CPU")
    cpu = named or llvm.get_host_cpu_name()
    features = os.environ.get("KWKER_FEATURES")
    if not features:
        features = cpu_features(cpu) if named else _host_features()
    return Target(llvm.get_process_triple(), cpu, features,
                  tiles=tile_mode(features, os.environ.get("KWKER_TILES", ""), own=not named))


def tile_mode(features: str, asked: str = "", own: bool = False) -> str:
    """``Target.tiles`` for a CPU with ``features``: ``asked`` is ``KWKER_TILES`` ("" or auto:
    the tile unit where the CPU has AMX-BF16; "off"; "emulate": AVX-512 code of the tile
    instructions' semantics, on any AVX-512 CPU). ``own``: the target is this machine, so the
    tile state is requested from Linux now, and a refusal means no tiles."""
    probe = Target("", "", features)
    asked = asked.strip().lower()
    if asked in ("", "auto", "amx"):
        if not (probe.has("amx-tile") and probe.has("amx-bf16")):
            if asked == "amx":
                raise ValueError("kwker: KWKER_TILES=amx, but the target CPU has no AMX-BF16 "
                                 f"(features {features})")
            return ""
        return "amx" if not own or tile_permission.granted() else ""
    if asked == "off":
        return ""
    if asked in ("emulate", "emulated"):
        if probe.vector_bits != 512:
            raise ValueError("kwker: KWKER_TILES=emulate runs the tile kernels as AVX-512 code; "
                             f"the target CPU has no AVX-512F/BW/VL (features {features})")
        return "emulated"
    raise ValueError(f"kwker: KWKER_TILES must be auto, amx, emulate or off, not {asked!r}")


def make_target(cpu: str, features: str = "", tiles: str | None = None) -> Target:
    """A target for another CPU (cross-prewarming, tests of the AVX-512 path); empty
    ``features`` means the CPU name's own (``cpu_features``), as for ``KWKER_CPU``; ``tiles``
    (default: AMX where the features have it) as ``Target.tiles``."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = features or cpu_features(cpu)
    if tiles is None:
        tiles = tile_mode(features)
    elif tiles not in TILE_MODES:
        raise ValueError(f"kwker: tiles must be one of {TILE_MODES}, not {tiles!r}")
    return Target(llvm.get_process_triple(), cpu, features, tiles=tiles)
