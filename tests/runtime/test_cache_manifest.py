"""Manifests: write the specs a compiled model used, read them back on another machine."""
from __future__ import annotations

import json
import re
import sys

import pytest
from kwsmoke import CacheSmokeSpec

from kwker.runtime import manifest
from kwker.runtime.manifest import ManifestError, read_manifest, write_manifest
from kwker.spec import SPEC_CLASSES, SortingSpec


def test_round_trip_keeps_first_use_order_without_duplicates(tmp_path):
    specs = [SortingSpec("topk", "float32", True), CacheSmokeSpec(3), SortingSpec("sort", "int8"),
             CacheSmokeSpec(3)]
    path = write_manifest(tmp_path / "sub" / "model.kwm.json", specs)
    assert read_manifest(path) == specs[:3]
    doc = json.loads(path.read_text())
    assert doc["kwker_manifest"] == 1 and doc["modules"]["sorting"] == "kwker.spec"
    assert [p.name for p in path.parent.iterdir()] == ["model.kwm.json"]  # no temp file left


@pytest.mark.parametrize("specs, reason", [
    ("{}", "'specs' must be a list"),
    ('[{"n": 1}]', "spec #0 has no kernel family"),
    ('[{"family": "cachesmoke", "n": 1, "colour": "red"}]', "spec #0 (cachesmoke) does not fit"),
    ('[{"family": "nosuchfamily"}]', "unknown kernel family 'nosuchfamily'"),
])
def test_bad_specs_are_reported_with_their_position(specs, reason, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(f'{{"kwker_manifest": 1, "specs": {specs}}}')
    with pytest.raises(ManifestError, match=re.escape(reason)):
        read_manifest(path)


def test_only_kwker_modules_are_imported_to_find_a_family(tmp_path, monkeypatch):
    (tmp_path / "not_kwker_plugin.py").write_text(
        "import kwker.spec\nkwker.spec.SPEC_CLASSES['sneaky'] = object\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = []

    def fake_import(name):  # stands for a Kwker module that defines the family when imported
        imported.append(name)
        monkeypatch.setitem(SPEC_CLASSES, "lazyfam", CacheSmokeSpec)
    monkeypatch.setattr(manifest.importlib, "import_module", fake_import)
    doc = {"kwker_manifest": 1, "specs": [{"family": "sneaky"}],
           "modules": {"sneaky": "not_kwker_plugin"}}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="unknown kernel family 'sneaky'"):
        read_manifest(tmp_path / "a.json")
    assert imported == [] and "not_kwker_plugin" not in sys.modules
    doc = {"kwker_manifest": 1, "specs": [{"family": "lazyfam", "n": 2}],
           "modules": {"lazyfam": "kwker.some_family"}}
    (tmp_path / "b.json").write_text(json.dumps(doc))
    assert read_manifest(tmp_path / "b.json") == [CacheSmokeSpec(2)]
    assert imported == ["kwker.some_family"]
