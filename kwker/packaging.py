"""Ahead-of-time packages: export once, ship one file, load it in milliseconds.

    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    kwker.package(ep, "ranker.kwk", targets=["znver3"])      # on the build machine
    model = kwker.load_package("ranker.kwk")                  # in the serving process
    scores, items = model(x)

A package is a zip file (stored, not compressed) holding:

- ``kwker-package.json``: the graph (``lowering/exported.py``'s document: ATen ops by name,
  argument slots, constants, metadata, input ranges), the kernel specs, the versions it was
  built with, one entry per target (CPU name and features -> object code members), the tuning
  records its lowering used on the build machine (installed into the loading machine's cache,
  where they apply only to the same CPU type) and the SHA-256 of every other member;
- ``INTEGRITY``: the SHA-256 of ``kwker-package.json``, so any change to any byte is caught;
- ``weights.bin``: the constants, raw, 64-byte aligned (no pickle: loading runs no code);
- ``objects/<key>.o``: object code per kernel and target, keyed like the kernel cache;
- ``exported.pt2``: the ``torch.export`` program, for re-lowering elsewhere; never read by
  ``load_package``, which therefore imports neither ``torch.export`` nor dynamo.

Loading re-runs Kwker's lowering on the stored graph (the backend's ``inner="eager"`` lowering:
the same kernels, a flat program) with the object code of the running CPU's target handed to the
runtime, so nothing compiles. Without a matching target it compiles the package's kernels into
the kernel cache first, and says so once. Calls are inference only (autograd off, as under
``torch.no_grad()``) and safe from several threads.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import tempfile
import time
import warnings
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch

from . import __version__
from .lowering import build as B
from .lowering import make
from .lowering.exported import (
    ExportError,
    build_tree,
    describe,
    dtype_name,
    dtype_of,
    flatten_tree,
    lowbit_parts,
    rebuild,
    stored_names,
    tree_is_flat_tuple,
)
from .lowering.kv_append import any_stride_inputs
from .lowering.partition import const_nodes, lower_graph
from .lowering.report import Report, new_graph_id
from .runtime import cache, kernel, tuning
from .runtime.target import Target, host_target, make_target
from .spec import spec_from_json

log = logging.getLogger("kwker")

FORMAT = 1
MANIFEST, INTEGRITY, WEIGHTS, EXPORTED = ("kwker-package.json", "INTEGRITY", "weights.bin",
                                          "exported.pt2")
ALIGN = 64

__all__ = ["PackageError", "PackagedModel", "exported_program", "load_package", "package",
           "package_specs"]


class PackageError(RuntimeError):
    """A file that is not a loadable Kwker package: the message says which file and why."""


# --------------------------------------------------------------------------- writing
def package(exported_program, path, targets=None) -> Path:
    """Write ``exported_program`` (a ``torch.export.export`` result) to the package ``path``.

    ``targets``: more CPUs to hold object code for, besides this one: CPU names (``"znver3"``,
    their LLVM features implied) or ``"cpu:features"`` strings (``"znver3:+avx2,+fma"``), as in
    ``KWKER_CPU``/``KWKER_FEATURES``. Returns the path; raises ExportError for a program a
    package cannot hold (mutated buffers, custom or higher-order ops), naming the node.
    """
    path = Path(path)
    doc, tensors = describe(exported_program)
    layout, blob = _pack_weights(doc, tensors)
    host = host_target()
    with tuning.recording() as records:
        specs = _lower(doc, _tensors_from(layout, bytearray(blob)))[2]
    per_target = [(host, specs)]
    for t in targets or ():
        target = _parse_target(t)
        if target != host and all(target != p[0] for p in per_target):
            per_target.append((target, _specs_for(target, doc, layout, blob)))
    members: dict[str, bytes] = {WEIGHTS: bytes(blob)}
    entries, all_specs = [], []
    for target, target_specs in per_target:
        objects = {}
        for spec in target_specs:
            key = cache.entry_key(spec.id, target)
            members[f"objects/{key}.o"] = kernel.object_for(spec, target)
            objects[key] = f"objects/{key}.o"
        entries.append({"target": asdict(target), "describe": target.describe(),
                        "specs": [s.to_json() for s in target_specs], "objects": objects})
        all_specs += target_specs
    saved = _save_exported(exported_program, doc)
    if saved is not None:
        members[EXPORTED] = saved
    manifest = {"kwker_package": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                  time.gmtime()),
                "versions": {"torch": torch.__version__, "kwker_package": __version__,
                             **cache.versions()},
                "graph": doc, "weights": layout, "targets": entries,
                "tuning": list({json.dumps(r, sort_keys=True): r for r in records}.values()),
                "spec_modules": {s.family: type(s).__module__ for s in all_specs},
                "exported": EXPORTED if saved is not None else None,
                "members": {name: hashlib.sha256(data).hexdigest()
                            for name, data in members.items()}}
    text = json.dumps(manifest, indent=1).encode()
    _write_zip(path, {MANIFEST: text, INTEGRITY: hashlib.sha256(text).hexdigest().encode(),
                      **members})
    return path


def _parse_target(t) -> Target:
    if isinstance(t, Target):
        return t
    cpu, _, features = str(t).partition(":")
    return make_target(cpu.strip(), features.strip())


def _pack_weights(doc: dict, tensors: dict) -> tuple[list, bytearray]:
    layout, blob = [], bytearray()
    for name in stored_names(doc):
        t = tensors[name]
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        blob += b"\0" * (-len(blob) % ALIGN)
        layout.append({"name": name, "dtype": dtype_name(t.dtype),
                       "shape": list(t.shape), "offset": len(blob), "nbytes": len(data)})
        blob += data
    return layout, blob


def _tensors_from(layout: list, blob: bytearray) -> dict:
    out = {}
    for w in layout:
        dtype = dtype_of(w["dtype"])
        numel = math.prod(w["shape"])
        if numel == 0:
            out[w["name"]] = torch.empty(w["shape"], dtype=dtype)
            continue
        t = torch.frombuffer(blob, dtype=dtype, count=numel, offset=w["offset"])
        # a storage of its own: what only kernels read (packed into them) is freed after
        # lowering, instead of the whole file's weights staying alive through one buffer
        out[w["name"]] = t.view(w["shape"]).clone()
    return out


def _save_exported(ep, doc: dict) -> bytes | None:
    """``torch.export.save`` bytes; its output structure is stored as a flat tuple (it cannot
    serialise ``torch.return_types`` outputs such as ``topk``'s; the package's own graph keeps
    the real structure). The tensors ``weights.bin`` holds (of a torchao weight, its ``qdata``) go
    in as stand-ins (one element broadcast to their shape), which ``exported_program`` replaces:
    the copy costs the file its graph, not the weights a second time. None, with a log line, if
    it still cannot be saved."""
    from torch.utils import _pytree as pytree
    sig = ep._module_call_graph[0].signature
    old = sig.out_spec if sig is not None else None
    swapped = []
    for c in doc["constants"]:
        where, key = _holder(ep, c["target"]), c["target"]
        if where is not None and where[key].numel() > 1:   # (torch cannot save an empty one)
            swapped.append((where, key, where[key]))
            where[key] = _with_data(where[key], _stand_in, "lowbit" in c)
    buf = io.BytesIO()
    try:
        if old is not None:
            sig.out_spec = pytree.tree_structure(tuple(range(old.num_leaves)))
        with warnings.catch_warnings():   # "no complete tensor": the stand-ins, as meant
            warnings.filterwarnings("ignore", "No complete tensor found")
            torch.export.save(ep, buf)
        return buf.getvalue()
    except Exception as e:  # noqa: BLE001 - the copy is a convenience, not the package
        log.warning("kwker: the package holds no exported program (torch.export.save: %s)", e)
        return None
    finally:
        if old is not None:
            sig.out_spec = old
        for where, key, t in swapped:
            where[key] = t


def _holder(ep, key: str) -> dict | None:
    """The dict of ``ep`` (its state dict or constants) holding the tensor ``key``."""
    return next((d for d in (ep.state_dict, ep.constants)
                 if isinstance(d.get(key), torch.Tensor)), None)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def _with_data(t: torch.Tensor, data, quantized: bool) -> torch.Tensor:
    """``t`` with its values (a torchao weight's: its ``qdata``, the bulk, which the package
    stores as the part of that name) from ``data(old)``, held as ``t`` is (a Parameter or not)."""
    if quantized:
        names, ctx = t.__tensor_flatten__()
        inner = {n: getattr(t, n) for n in names}
        inner["qdata"] = data(inner["qdata"])
        new = type(t).__tensor_unflatten__(inner, ctx, t.shape, t.stride())
    else:
        new = data(t)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def _write_zip(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            for name, data in members.items():
                z.writestr(name, data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _specs_for(target: Target, doc: dict, layout: list, blob: bytearray) -> list:
    """The kernel specs lowering picks on ``target`` (blocking depends on the ISA): lowered in a
    child process that takes ``target`` as its CPU, which also compiles them into the cache."""
    import subprocess
    import sys
    with tempfile.TemporaryDirectory(prefix="kwker-package-") as tmp:
        src = Path(tmp) / "graph.kwk"
        text = json.dumps({"kwker_package": FORMAT, "graph": doc, "weights": layout}).encode()
        _write_zip(src, {MANIFEST: text, WEIGHTS: bytes(blob)})
        env = {**os.environ, "KWKER_CPU": target.cpu, "KWKER_FEATURES": target.features}
        code = ("import json, sys; from kwker.packaging import _child_specs; "
                "print(json.dumps(_child_specs(sys.argv[1])))")
        r = subprocess.run([sys.executable, "-c", code, str(src)], env=env,
                           capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"kwker: lowering for {target.describe()} failed:\n{r.stderr[-2000:]}")
    return [spec_from_json(s) for s in json.loads(r.stdout.strip().splitlines()[-1])]


def _child_specs(path: str) -> list:
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read(MANIFEST))
        blob = bytearray(z.read(WEIGHTS))
    return [s.to_json() for s in _lower_stored(Path(path), manifest, blob)[2]]


def _lower(doc: dict, tensors: dict):
    """(program, report, kernel specs, names of the inputs it takes at any strides) for a
    stored graph: the backend's lowering, on ``Sym`` sizes where the export declared dynamic
    ones."""
    graph, metas = rebuild(doc, tensors)
    # the rest runs as ATen calls in the flat program, as under inner="eager"
    report = Report(new_graph_id(), "eager", shapes=_inputs_text(doc["inputs"]))
    with make.collecting() as specs, B.specialising():
        program, _ = lower_graph(graph, metas, const_nodes(graph, []), report)
    report.specs = list(dict.fromkeys(specs))
    return program, report, report.specs, any_stride_inputs(graph.graph.nodes, report.kernels)


def _inputs_text(inputs: list) -> str:
    def dim(d):
        if isinstance(d, int):
            return str(d)
        if "sym" in d:
            hi = d["max"] if d["max"] is not None else "inf"
            return f"{d['sym']}[{d['min']}..{hi}]"
        return d["expr"]
    return ", ".join(f"{i['name']}: {i['dtype']}[{', '.join(dim(d) for d in i['shape'])}]"
                     for i in inputs)


# --------------------------------------------------------------------------- reading
def _open(path: Path) -> tuple[zipfile.ZipFile, dict]:
    """The zip and its verified manifest; PackageError for anything else."""
    try:
        z = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise PackageError(f"package {path} does not exist") from None
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise PackageError(f"{path} is not a Kwker package (not a readable zip file: {e}); "
                           "it may be truncated or of another format") from None
    try:
        names = set(z.namelist())
        if MANIFEST not in names or INTEGRITY not in names:
            raise PackageError(f"{path} is not a Kwker package (no {MANIFEST})")
        text = _read(z, path, MANIFEST)
        if hashlib.sha256(text).hexdigest().encode() != _read(z, path, INTEGRITY).strip():
            raise PackageError(f"package {path} is corrupted: {MANIFEST} does not match its "
                               "checksum")
        manifest = json.loads(text)
        if not isinstance(manifest, dict) or "kwker_package" not in manifest:
            raise PackageError(f"{path} is not a Kwker package")
        if manifest["kwker_package"] != FORMAT:
            raise PackageError(
                f"package {path} has format {manifest['kwker_package']}, written by Kwker "
                f"{manifest.get('versions', {}).get('kwker_package')}; this Kwker "
                f"({__version__}) reads format {FORMAT}: package the model again with it")
        return z, manifest
    except PackageError:
        z.close()
        raise
    except (ValueError, KeyError, zipfile.BadZipFile, OSError) as e:
        z.close()
        raise PackageError(f"package {path} is corrupted: {e}") from None


def _read(z: zipfile.ZipFile, path: Path, name: str, digest: str | None = None) -> bytes:
    try:
        data = z.read(name)
    except KeyError:
        raise PackageError(f"package {path} is incomplete: it has no {name}") from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise PackageError(f"package {path} is corrupted: {name}: {e}") from None
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise PackageError(f"package {path} is corrupted: {name} does not match its checksum")
    return data


def package_specs(path) -> list:
    """The kernel specs a package needs on this CPU (or ``KWKER_CPU``), for ``kwker-cache
    prewarm --package``: those it records for this target and this Kwker and LLVM; else
    (blocking depends on the ISA, specs on the version) those its graph lowers to here, which
    compiles them into the kernel cache on the way."""
    path = Path(path)
    z, manifest = _open(path)
    with z:
        entry = _code_for_here(manifest)
        if entry is None:
            blob = bytearray(_read(z, path, WEIGHTS, manifest["members"].get(WEIGHTS)))
    if entry is not None:
        _import_families(manifest)
        return [spec_from_json(s) for s in entry["specs"]]
    return _lower_stored(path, manifest, blob)[2]


def exported_program(path):
    """The ``torch.export`` program stored in the package (to re-lower it, e.g. with another
    Kwker version), checked against its hash. Its output structure is a flat tuple where
    ``torch.export.save`` could not store the model's own (``torch.return_types``)."""
    path = Path(path)
    z, manifest = _open(path)
    with z:
        name = manifest.get("exported")
        if not name:
            raise PackageError(f"package {path} holds no exported program")
        data = _read(z, path, name, manifest["members"].get(name))
        blob = bytearray(_read(z, path, WEIGHTS, manifest["members"].get(WEIGHTS)))
    ep = torch.export.load(io.BytesIO(data))
    # the weights, where the program holds stand-ins (_save_exported)
    tensors = _tensors_from(manifest["weights"], blob)
    for c in manifest["graph"]["constants"]:
        where, key = _holder(ep, c["target"]), c["target"]
        if where is not None:
            stored = lowbit_parts(c, tensors)["qdata"] if "lowbit" in c else tensors[c["name"]]
            where[key] = _with_data(where[key], lambda _: stored, "lowbit" in c)
    return ep


def _entry_for(manifest: dict, target: Target) -> dict | None:
    want = asdict(target)
    return next((e for e in manifest["targets"] if e["target"] == want), None)


def _code_for_here(manifest: dict) -> dict | None:
    """The target entry whose object code this process can link: built for this CPU (or
    ``KWKER_CPU``) by this Kwker codegen and LLVM (object code is keyed by both)."""
    if _other_versions(manifest):
        return None
    return _entry_for(manifest, host_target())


def _lower_stored(path: Path, manifest: dict, blob: bytearray):
    """``_lower`` of the package's graph; PackageError where this torch cannot run it."""
    try:
        return _lower(manifest["graph"], _tensors_from(manifest["weights"], blob))
    except ExportError as e:
        raise PackageError(f"package {path} cannot be loaded here: {e}") from None


def _import_families(manifest: dict) -> None:
    import importlib
    for module in (manifest.get("spec_modules") or {}).values():
        if isinstance(module, str) and module.startswith("kwker."):
            importlib.import_module(module)


def load_package(path) -> PackagedModel:
    """The model in the package ``path``, ready to call. PackageError for a file that is not
    an intact Kwker package, or one whose ops this torch lacks."""
    path = Path(path)
    z, manifest = _open(path)
    with z:
        digests = manifest["members"]
        blob = bytearray(_read(z, path, WEIGHTS, digests.get(WEIGHTS)))
        entry = _code_for_here(manifest)
        if entry is not None:
            kernel.provide({key: _read(z, path, member, digests.get(member))
                            for key, member in entry["objects"].items()})
    stale = _other_versions(manifest)
    if stale:
        log.warning("kwker: package %s was built by %s, this is %s: its object code does not "
                    "apply, compiling its kernels into the kernel cache", path, stale[0],
                    stale[1])
    elif entry is None:
        built = ", ".join(e["describe"] for e in manifest["targets"])
        log.warning("kwker: package %s has no code for this CPU, %s (it has %s): compiling its "
                    "kernels into the kernel cache (kwker-cache prewarm --package does it "
                    "ahead of time)", path, host_target().describe(), built)
    for record in manifest.get("tuning") or ():
        tuning.install(tuning.encode(record))
    program, report, _, any_strides = _lower_stored(path, manifest, blob)
    return PackagedModel(path, manifest, program, report, any_strides)


def _other_versions(manifest: dict) -> tuple[str, str] | None:
    """(built by, this) when the package's Kwker codegen or LLVM differs from this process's:
    its object code is keyed by them, and its graph is lowered again here either way."""
    have = cache.versions()
    built = manifest.get("versions", {})
    keys = ("kwker", "llvm")
    if all(built.get(k) == have[k] for k in keys):
        return None
    return (", ".join(f"{k} {built.get(k)}" for k in keys),
            ", ".join(f"{k} {have[k]}" for k in keys))


# --------------------------------------------------------------------------- calling
class PackagedModel:
    """A loaded package: ``model(*inputs)`` runs its flat program under autograd off.

    The inputs are structured as the exported program took them (tensors, or tuples, lists and
    dicts of them: a decoder's KV cache as a tuple of (key, value) pairs). They are checked
    before any kernel runs: their number, type, dtype, device, rank and sizes (fixed ones
    exactly, dynamic ones in the exported range and equal wherever the export tied them).
    ``report`` says which nodes run as Kwker kernels.
    """

    def __init__(self, path: Path, manifest: dict, program, report: Report,
                 any_strides: set = frozenset()):
        self.path, self.report, self._program = path, report, program
        graph = manifest["graph"]
        self.inputs = graph["inputs"]
        self.versions = manifest["versions"]
        self._check = _checker(self.inputs, any_strides)
        tree = graph.get("in_tree")   # None or a flat tuple: the inputs are taken as they come
        self._flatten = None if tree is None or tree_is_flat_tuple(tree) else \
            lambda args: flatten_tree(tree, args, [], "the inputs")
        tree = graph["out_tree"]
        if tree_is_flat_tuple(tree):
            self._wrap = tuple
        elif isinstance(tree, dict) and "return_type" in tree and \
                all(c == "leaf" for c in tree["items"]):
            self._wrap = getattr(torch.return_types, tree["return_type"])
        elif tree == "leaf":
            self._wrap = _first
        else:
            self._wrap = lambda flat: build_tree(tree, iter(flat))

    def __call__(self, *args):
        if self._flatten is not None:   # the exported program's nested inputs, as it took them
            args = self._flatten(args)
        args = self._check(args)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            out = self._program(args)
        finally:
            torch._C._set_grad_enabled(prev)
        return self._wrap(out)

    def __repr__(self) -> str:
        return (f"PackagedModel({str(self.path)!r}, inputs: {_inputs_text(self.inputs)}; "
                f"{len(self.report.kernels)} Kwker kernels)")


def _first(flat):
    return flat[0]


def _checker(inputs: list, any_strides: set = frozenset()):
    """A function validating a call's inputs (contiguous copies of strided ones, but for those
    named in ``any_strides``: a KV cache's past); the common case costs a few attribute reads per
    input, the messages are built only on failure."""
    names = ", ".join(i["name"] for i in inputs)
    plan = []
    for pos, i in enumerate(inputs):
        fixed = tuple((d, s) for d, s in enumerate(i["shape"]) if isinstance(s, int))
        syms = tuple((d, s["sym"], s["min"], s["max"]) for d, s in enumerate(i["shape"])
                     if isinstance(s, dict) and "sym" in s)
        plan.append((pos, i, dtype_of(i["dtype"]), i["device"] == "cpu",
                     len(i["shape"]), fixed, syms, i["name"] in any_strides))
    n = len(plan)
    tensor = torch.Tensor

    def check(args):
        if len(args) != n:
            raise TypeError(f"the packaged model takes {n} input(s) ({names}), "
                            f"got {len(args)}")
        out = list(args)
        seen = {}
        for pos, spec, dtype, cpu, rank, fixed, syms, strided in plan:
            a = args[pos]
            if not isinstance(a, tensor):
                raise TypeError(f"input {spec['name']!r} must be a Tensor, not "
                                f"{type(a).__name__}")
            if a.dtype is not dtype or a.is_cpu is not cpu or a.dim() != rank:
                _refuse(spec, dtype, a)
            size = a.shape
            for d, want in fixed:
                if size[d] != want:
                    _refuse(spec, dtype, a)
            for d, sym, lo, hi in syms:
                v = size[d]
                if v < lo or (hi is not None and v > hi):
                    raise RuntimeError(
                        f"input {spec['name']!r}: dim {d} ({sym}) must be in {lo}..{hi}, the "
                        f"range it was exported with, got {v}")
                first = seen.setdefault(sym, (v, spec["name"]))
                if first[0] != v:
                    raise RuntimeError(
                        f"input {spec['name']!r}: dim {d} ({sym}) is {v}, but input "
                        f"{first[1]!r} has {first[0]} in the same dim of the export")
            if not (strided or a.is_contiguous()):
                out[pos] = a.contiguous()
        return out
    return check


def _refuse(spec: dict, dtype: torch.dtype, a: torch.Tensor):
    shape = spec["shape"]
    want = f"a {spec['device']} {spec['dtype']} tensor of shape {_shape_text(shape)}"
    got = f"a {a.device.type} {dtype_name(a.dtype)} tensor of shape " \
          f"{list(a.shape)}"
    if a.dim() == len(shape) and a.dtype == dtype and \
            a.device.type == spec["device"]:
        d = next(d for d, s in enumerate(shape) if isinstance(s, int) and a.shape[d] != s)
        raise RuntimeError(f"input {spec['name']!r} must have size {shape[d]} in dim {d}: "
                           f"expected {want}, got {got}")
    raise RuntimeError(f"input {spec['name']!r}: expected {want} (rank {len(shape)}), got {got}")


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(s) if isinstance(s, int) else s.get("sym", s.get("expr", "?"))
                           for s in shape) + "]"
