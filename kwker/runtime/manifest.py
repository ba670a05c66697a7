"""Kernel manifests: the specs a compiled model used, so another machine can be warmed up.

A model compiled on one machine records its kernel specs with ``write_manifest``; on a deployment
machine ``kwker-cache prewarm --manifest FILE`` compiles them for that machine's CPU before it
serves. The file is JSON and holds specs only, never code or a target: each machine compiles for
itself.

    {"kwker_manifest": 1, "kwker": "0.1.0", "specs": [{"family": "sorting", ...}, ...],
     "modules": {"sorting": "kwker.spec"}}
"""
from __future__ import annotations

import importlib
import json
import os
import tempfile
from pathlib import Path

from .. import __version__
from ..spec import SPEC_CLASSES, Spec, spec_from_json

FORMAT = 1


class ManifestError(ValueError):
    """A manifest that cannot be read; the message says which file and why."""


def write_manifest(path: str | os.PathLike, specs) -> Path:
    """Write the distinct ``specs`` (in first-use order) to ``path`` atomically."""
    path = Path(path)
    unique = list(dict.fromkeys(specs))
    doc = {"kwker_manifest": FORMAT, "kwker": __version__,
           "specs": [s.to_json() for s in unique],
           "modules": {s.family: type(s).__module__ for s in unique}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def _import_family(family: str, modules: dict) -> None:
    """Import the module that defines ``family``'s spec class. Only Kwker's own modules are
    imported: a manifest is data and must not name arbitrary code to run."""
    module = modules.get(family)
    if isinstance(module, str) and (module == "kwker" or module.startswith("kwker.")):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def read_manifest(path: str | os.PathLike) -> list[Spec]:
    """The specs recorded in ``path``; ManifestError with a precise reason otherwise."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} does not exist") from None
    except OSError as e:
        raise ManifestError(f"cannot read manifest {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"manifest {path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("kwker_manifest") != FORMAT:
        raise ManifestError(f"{path} is not a Kwker manifest (format {FORMAT})")
    raw, modules = doc.get("specs"), doc.get("modules") or {}
    if not isinstance(raw, list) or not isinstance(modules, dict):
        raise ManifestError(f"manifest {path}: 'specs' must be a list")
    specs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("family"), str):
            raise ManifestError(f"manifest {path}: spec #{i} has no kernel family")
        family = item["family"]
        if family not in SPEC_CLASSES:
            _import_family(family, modules)
        if family not in SPEC_CLASSES:
            raise ManifestError(f"manifest {path}: spec #{i} has unknown kernel family "
                                f"{family!r} (written by a newer Kwker or a plugin that is not "
                                "imported?)")
        try:
            specs.append(spec_from_json(item))
        except TypeError as e:
            raise ManifestError(f"manifest {path}: spec #{i} ({family}) does not fit this "
                                f"Kwker version: {e}") from None
    return specs
