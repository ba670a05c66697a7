"""Ahead-of-time packages: export once, ship one file, load it in milliseconds.

    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    kwker.package(ep, "ranker.kwk", targets=["znver3"])      # on the build machine
    model = kwker.load_package("ranker.kwk")                  # in the serving process
    scores, items = model(x)

Several programs of one model (a decoder's prompt forward and its decode step) go in one file by
name, their weights stored once and, loaded together, held once in memory:

    kwker.package({"prompt": prompt_ep, "step": step_ep}, "gpt2.kwk")
    programs = kwker.load_package("gpt2.kwk")       # {"prompt": PackagedModel, "step": ...}

A package is a zip file (stored, not compressed) holding:

- ``kwker-package.json``: per program, its graph (``lowering/exported.py``'s document: ATen ops
  by name, argument slots, constants, metadata, input ranges) and where its constants lie in
  ``weights.bin``; the kernel specs, the versions it was built with, one entry per target (CPU
  name and features -> object code members), the tuning records its lowering used on the build
  machine (installed into the loading machine's cache, where they apply only to the same CPU
  type) and the SHA-256 of every other member;
- ``INTEGRITY``: the SHA-256 of ``kwker-package.json``, so any change to any byte is caught;
- ``weights.bin``: the constants, raw, 64-byte aligned, each distinct content once (no pickle:
  loading runs no code);
- ``objects/<key>.o``: object code per kernel and target, keyed like the kernel cache;
- ``exported.pt2`` (``exported/<name>.pt2`` per named program): the ``torch.export`` program,
  for re-lowering elsewhere; never read by ``load_package``, which therefore imports neither
  ``torch.export`` nor dynamo.

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
    describe,
    dtype_name,
    dtype_of,
    lowbit_parts,
    nibbled,
    rebuild,
    stored_names,
    unnibble,
)
from .lowering.kv_append import any_stride_inputs
from .lowering.partition import const_nodes, lower_graph
from .lowering.report import Report, new_graph_id
from .packaged_model import PackagedModel, inputs_text
from .runtime import cache, huge_pages, kernel, tuning
from .runtime.target import Target, host_target, make_target
from .spec import spec_from_json

log = logging.getLogger("kwker")

FORMAT = 2       # 2: named programs sharing one weights.bin; 1: one program at the top level
READS = (1, 2)
SINGLE = "model"  # the name of the program of a package made from one exported program
MANIFEST, INTEGRITY, WEIGHTS, EXPORTED = ("kwker-package.json", "INTEGRITY", "weights.bin",
                                          "exported.pt2")
ALIGN = 64

__all__ = ["PackageError", "PackagedModel", "exported_program", "load_package", "package",
           "package_specs"]


class PackageError(RuntimeError):
    """A file that is not a loadable Kwker package: the message says which file and why."""


# --------------------------------------------------------------------------- writing
def package(exported_program, path, targets=None, keep_exported: bool = True) -> Path:
    """Write ``exported_program`` (a ``torch.export.export`` result, or a dict of them by name:
    programs of one model, such as its prompt forward and decode step) to the package ``path``.
    Tensors of equal content (a weight both programs read) are stored once.

    ``targets``: more CPUs to hold object code for, besides this one: CPU names (``"znver3"``,
    their LLVM features implied) or ``"cpu:features"`` strings (``"znver3:+avx2,+fma"``), as in
    ``KWKER_CPU``/``KWKER_FEATURES``. ``keep_exported=False`` leaves out the ``torch.export``
    programs kept for ``exported_program`` (re-lowering elsewhere), which loading never reads:
    a smaller file to deploy (their graphs, the torchao scales and an example input; 51 of GPT-2
    int4's 287 MB). Returns the path; raises ExportError for a program a package cannot hold
    (mutated buffers, custom or higher-order ops), naming the node.
    """
    path = Path(path)
    named = isinstance(exported_program, dict)
    eps = _named_programs(exported_program) if named else {SINGLE: exported_program}
    described = {name: describe(ep) for name, ep in eps.items()}
    layouts, blob = _pack_weights(described)
    programs = {name: {"graph": doc, "weights": layouts[name]}
                for name, (doc, _) in described.items()}
    host = host_target()
    with tuning.recording() as records:
        specs = _all_specs(_lower_programs(programs, blob))
    per_target = [(host, specs)]
    for t in targets or ():
        target = _parse_target(t)
        if target != host and all(target != p[0] for p in per_target):
            per_target.append((target, _specs_for(target, programs, blob)))
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
    for name, ep in eps.items():
        saved = _save_exported(ep, programs[name]["graph"]) if keep_exported else None
        member = f"exported/{name}.pt2" if named else EXPORTED
        programs[name]["exported"] = member if saved is not None else None
        if saved is not None:
            members[member] = saved
    manifest = {"kwker_package": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                  time.gmtime()),
                "versions": {"torch": torch.__version__, "kwker_package": __version__,
                             **cache.versions()},
                "named": named, "programs": programs, "targets": entries,
                "tuning": list({json.dumps(r, sort_keys=True): r for r in records}.values()),
                "spec_modules": {s.family: type(s).__module__ for s in all_specs},
                "members": {name: hashlib.sha256(data).hexdigest()
                            for name, data in members.items()}}
    text = json.dumps(manifest, indent=1).encode()
    _write_zip(path, {MANIFEST: text, INTEGRITY: hashlib.sha256(text).hexdigest().encode(),
                      **members})
    return path


def _named_programs(eps: dict) -> dict:
    if not eps:
        raise ValueError("kwker.package: the dict of programs is empty")
    for name, ep in eps.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"kwker.package: program names must be identifiers (they name "
                             f"files in the package), got {name!r}")
        if not isinstance(ep, torch.export.ExportedProgram):
            raise TypeError(f"kwker.package: program {name!r} must be a torch.export."
                            f"ExportedProgram, not {type(ep).__name__}")
    return dict(eps)


def _parse_target(t) -> Target:
    if isinstance(t, Target):
        return t
    cpu, _, features = str(t).partition(":")
    return make_target(cpu.strip(), features.strip())


def _pack_weights(described: dict) -> tuple[dict, bytearray]:
    """(each program's layout: where its stored tensors lie, and the blob), each distinct
    content stored once (a weight several programs read; equal constants within one)."""
    layouts, blob, where = {}, bytearray(), {}
    for program, (doc, tensors) in described.items():
        layout = layouts[program] = []
        for name in stored_names(doc):
            t = tensors[name]
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            digest = hashlib.sha256(data).digest()
            if digest not in where:
                blob += b"\0" * (-len(blob) % ALIGN)
                where[digest] = len(blob)
                blob += data
            layout.append({"name": name, "dtype": dtype_name(t.dtype),
                           "shape": list(t.shape), "offset": where[digest], "nbytes": len(data)})
    return layouts, blob


def _tensors_from(program: dict, blob: bytearray, made: dict | None = None) -> dict:
    """A program's stored tensors by name, read from ``blob`` (int4 values unpacked).
    ``made``: the tensors read so far, by where they lie: programs naming the same bytes get
    one tensor, so one copy in memory and one packing into the kernels that read it."""
    made = {} if made is None else made
    unpack = nibbled(program["graph"])
    out = {}
    for w in program["weights"]:
        nibbles = unpack.get(w["name"])
        key = (w["offset"], w["nbytes"], w["dtype"], tuple(w["shape"]), str(nibbles))
        if key not in made:
            made[key] = _tensor_at(w, blob, nibbles)
        out[w["name"]] = made[key]
    return out


def _tensor_at(w: dict, blob: bytearray, nibbles: list | None) -> torch.Tensor:
    dtype = dtype_of(w["dtype"])
    numel = math.prod(w["shape"])
    if numel == 0:
        return torch.empty(w["shape"], dtype=dtype)
    t = torch.frombuffer(blob, dtype=dtype, count=numel, offset=w["offset"]).view(w["shape"])
    if nibbles is not None:
        return unnibble(t, nibbles)
    # a storage of its own: what only kernels read (packed into them) is freed after lowering,
    # instead of the whole file's weights staying alive through one buffer. int8 values are a
    # low-bit weight's, which its decode kernel streams in place each token: on huge pages
    return huge_pages.copy(t) if dtype == torch.int8 else t.clone()


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


def _specs_for(target: Target, programs: dict, blob: bytearray) -> list:
    """The kernel specs lowering picks on ``target`` (blocking depends on the ISA): lowered in a
    child process that takes ``target`` as its CPU, which also compiles them into the cache."""
    import subprocess
    import sys
    with tempfile.TemporaryDirectory(prefix="kwker-package-") as tmp:
        src = Path(tmp) / "graph.kwk"
        text = json.dumps({"kwker_package": FORMAT, "programs": programs}).encode()
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
    lowered = _lower_stored(Path(path), manifest["programs"], blob)
    return [s.to_json() for s in _all_specs(lowered)]


def _lower(doc: dict, tensors: dict):
    """(program, report, kernel specs, names of the inputs it takes at any strides) for a
    stored graph: the backend's lowering, on ``Sym`` sizes where the export declared dynamic
    ones."""
    graph, metas = rebuild(doc, tensors)
    # the rest runs as ATen calls in the flat program, as under inner="eager"
    report = Report(new_graph_id(), "eager", shapes=inputs_text(doc["inputs"]))
    with make.collecting() as specs, B.specialising():
        program, _ = lower_graph(graph, metas, const_nodes(graph, []), report)
    report.specs = list(dict.fromkeys(specs))
    return program, report, report.specs, any_stride_inputs(graph.graph.nodes, report.kernels)


def _lower_programs(programs: dict, blob: bytearray) -> dict:
    """``_lower`` of each program, by name, on tensors read once for all of them."""
    made: dict = {}
    return {name: _lower(p["graph"], _tensors_from(p, blob, made))
            for name, p in programs.items()}


def _all_specs(lowered: dict) -> list:
    return list(dict.fromkeys(s for _, _, specs, _ in lowered.values() for s in specs))


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
        if manifest["kwker_package"] not in READS:
            raise PackageError(
                f"package {path} has format {manifest['kwker_package']}, written by Kwker "
                f"{manifest.get('versions', {}).get('kwker_package')}; this Kwker "
                f"({__version__}) reads formats {', '.join(map(str, READS))}: package the "
                "model again with it")
        if manifest["kwker_package"] == 1:   # one program, at the top level
            manifest["named"] = False
            manifest["programs"] = {SINGLE: {k: manifest.pop(k, None)
                                             for k in ("graph", "weights", "exported")}}
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
    (blocking depends on the ISA, specs on the version) those its programs lower to here, which
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
    return _all_specs(_lower_stored(path, manifest["programs"], blob))


def exported_program(path, name: str | None = None):
    """The ``torch.export`` program stored in the package (to re-lower it, e.g. with another
    Kwker version), checked against its hash; of a package of named programs, the one called
    ``name``, or a dict of them all. Its output structure is a flat tuple where
    ``torch.export.save`` could not store the model's own (``torch.return_types``)."""
    path = Path(path)
    z, manifest = _open(path)
    with z:
        chosen = _chosen(path, manifest, name)
        data = {}
        for which, program in chosen.items():
            member = program.get("exported")
            if not member:
                raise PackageError(f"package {path} holds no exported program"
                                   + (f" for {which!r}" if manifest["named"] else "")
                                   + " (packaged with keep_exported=False, or torch.export.save"
                                   " failed then)")
            data[which] = _read(z, path, member, manifest["members"].get(member))
        blob = bytearray(_read(z, path, WEIGHTS, manifest["members"].get(WEIGHTS)))
    eps, made = {}, {}
    for which, program in chosen.items():
        ep = eps[which] = torch.export.load(io.BytesIO(data[which]))
        # the weights, where the program holds stand-ins (_save_exported)
        tensors = _tensors_from(program, blob, made)
        for c in program["graph"]["constants"]:
            where, key = _holder(ep, c["target"]), c["target"]
            if where is not None:
                stored = lowbit_parts(c, tensors)["qdata"] if "lowbit" in c else \
                    tensors[c["name"]]
                where[key] = _with_data(where[key], lambda _, t=stored: t, "lowbit" in c)
    return eps if manifest["named"] and name is None else next(iter(eps.values()))


def _chosen(path: Path, manifest: dict, name: str | None) -> dict:
    """The programs a call asked for by ``name`` (all of them for None)."""
    programs = manifest["programs"]
    if name is None:
        return programs
    if not manifest["named"]:
        raise ValueError(f"package {path} holds one unnamed program; call without a name")
    if name not in programs:
        raise ValueError(f"package {path} has no program {name!r}; it has "
                         f"{', '.join(map(repr, programs))}")
    return {name: programs[name]}


def _entry_for(manifest: dict, target: Target) -> dict | None:
    want = asdict(target)
    return next((e for e in manifest["targets"] if e["target"] == want), None)


def _code_for_here(manifest: dict) -> dict | None:
    """The target entry whose object code this process can link: built for this CPU (or
    ``KWKER_CPU``) by this Kwker codegen and LLVM (object code is keyed by both)."""
    if _other_versions(manifest):
        return None
    return _entry_for(manifest, host_target())


def _lower_stored(path: Path, programs: dict, blob: bytearray) -> dict:
    """``_lower_programs``; PackageError where this torch cannot run them."""
    try:
        return _lower_programs(programs, blob)
    except ExportError as e:
        raise PackageError(f"package {path} cannot be loaded here: {e}") from None


def _import_families(manifest: dict) -> None:
    import importlib
    for module in (manifest.get("spec_modules") or {}).values():
        if isinstance(module, str) and module.startswith("kwker."):
            importlib.import_module(module)


def load_package(path, name: str | None = None):
    """The model in the package ``path``, ready to call: a ``PackagedModel``; of a package of
    named programs, the one called ``name``, or a dict of them all, which share their weights in
    memory. PackageError for a file that is not an intact Kwker package, or one whose ops this
    torch lacks; ValueError for a name the package does not have."""
    path = Path(path)
    z, manifest = _open(path)
    with z:
        chosen = _chosen(path, manifest, name)
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
    loaded = {which: PackagedModel(path, which if manifest["named"] else None,
                                   chosen[which]["graph"], manifest["versions"], program,
                                   report, any_strides)
              for which, (program, report, _, any_strides)
              in _lower_stored(path, chosen, blob).items()}
    return loaded if manifest["named"] and name is None else next(iter(loaded.values()))


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
