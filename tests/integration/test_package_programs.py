"""Several programs in one package: a decoder's prompt forward and decode step, packaged by name
(``kwker.package({"prompt": ..., "step": ...}, path)``), their weights stored once in the file
and, loaded together, read once into memory."""
import hashlib
import json
import zipfile

import pytest
import torch
from torch.utils._pytree import tree_leaves

import kwker
from kwker import packaging

from .models import GPTDecoder

VOCAB = 512


@pytest.fixture(scope="module")
def decoder_files(tmp_path_factory):
    """(model, prompt, {"both": two-program package, "step": the step alone, "prompt": the
    prompt alone})."""
    torch.manual_seed(0)
    model = GPTDecoder(vocab=VOCAB, d=64, heads=4, layers=2).eval()
    prompt = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        logits, past = model(prompt, None)
    first = torch.export.export(model, (prompt,))
    length = torch.export.Dim("length", min=2, max=200)
    step = torch.export.export(model, (logits.argmax(-1, keepdim=True), past),
                               dynamic_shapes=({}, tuple(({2: length}, {2: length})
                                                         for _ in past)))
    folder = tmp_path_factory.mktemp("programs")
    files = {"both": kwker.package({"prompt": first, "step": step}, folder / "both.kwk"),
             "step": kwker.package(step, folder / "step.kwk"),
             "prompt": kwker.package(first, folder / "prompt.kwk")}
    return model, prompt, files


def weights_bytes(path) -> int:
    with zipfile.ZipFile(path) as z:
        return z.getinfo("weights.bin").file_size


def test_prompt_and_step_from_one_file_decode_as_the_model_does(decoder_files):
    model, prompt, files = decoder_files
    programs = kwker.load_package(files["both"])
    assert sorted(programs) == ["prompt", "step"]
    assert "program 'step'" in repr(programs["step"])
    with torch.no_grad():
        want, want_past = model(prompt, None)
        got, past = programs["prompt"](prompt)
        for _ in range(6):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            ids = want.argmax(-1, keepdim=True)
            want, want_past = model(ids, want_past)
            got, past = programs["step"](ids, past)
        torch.testing.assert_close(past, want_past, rtol=1e-5, atol=1e-6)
    # the weights once: the file's are the step's alone (the prompt reads the same ones)
    assert weights_bytes(files["both"]) == weights_bytes(files["step"])
    assert files["both"].stat().st_size < 0.75 * (files["step"].stat().st_size
                                                 + files["prompt"].stat().st_size)


def test_programs_loaded_together_read_each_weight_once(decoder_files, monkeypatch):
    """Loading both programs makes no more tensors than loading one: they share the weights
    in memory (and so the kernels' packing of them)."""
    _, _, files = decoder_files
    made = []
    real = packaging._tensor_at
    monkeypatch.setattr(packaging, "_tensor_at", lambda *a: made.append(1) or real(*a))
    kwker.load_package(files["step"])
    alone = len(made)
    made.clear()
    kwker.load_package(files["both"])
    assert len(made) == alone > 0


def test_one_program_by_name_and_names_it_lacks(decoder_files):
    model, prompt, files = decoder_files
    step = kwker.load_package(files["both"], "step")
    assert isinstance(step, kwker.PackagedModel) and step.name == "step"
    with pytest.raises(ValueError, match="no program 'decode'.*'prompt', 'step'"):
        kwker.load_package(files["both"], "decode")
    with pytest.raises(ValueError, match="one unnamed program"):
        kwker.load_package(files["step"], "step")
    def ids(name):
        return {s.id for s in kwker.package_specs(files[name])}
    assert ids("both") == ids("step") | ids("prompt")
    # the exported programs come back by name too, with their weights
    eps = kwker.exported_program(files["both"])
    assert sorted(eps) == ["prompt", "step"]
    with torch.no_grad():
        want = model(prompt, None)
        got = kwker.exported_program(files["both"], "prompt").module()(prompt)
    torch.testing.assert_close(got, tree_leaves(want))   # (outputs stored flat: _save_exported)


def test_what_cannot_name_a_program_is_refused(decoder_files, tmp_path):
    model, prompt, _ = decoder_files
    ep = torch.export.export(model, (prompt,))
    with pytest.raises(ValueError, match="empty"):
        kwker.package({}, tmp_path / "none.kwk")
    with pytest.raises(ValueError, match="identifiers.*'the prompt'"):
        kwker.package({"the prompt": ep}, tmp_path / "space.kwk")
    with pytest.raises(TypeError, match="'step' must be a torch.export.ExportedProgram"):
        kwker.package({"prompt": ep, "step": model}, tmp_path / "module.kwk")
    assert not list(tmp_path.iterdir())


def test_a_package_of_the_first_format_still_loads(decoder_files, tmp_path):
    """Format 1 (one program, its graph at the top level of the manifest), as Kwker wrote it
    before named programs, loads as it did."""
    model, prompt, files = decoder_files
    with zipfile.ZipFile(files["prompt"]) as z:
        members = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(members["kwker-package.json"])
    assert manifest["kwker_package"] == 2 and manifest["named"] is False
    manifest.update(manifest.pop("programs")["model"], kwker_package=1)
    del manifest["named"]
    text = json.dumps(manifest).encode()
    members.update({"kwker-package.json": text,
                    "INTEGRITY": hashlib.sha256(text).hexdigest().encode()})
    old = tmp_path / "old.kwk"
    with zipfile.ZipFile(old, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    with torch.no_grad():
        got, want = kwker.load_package(old)(prompt), model(prompt, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kwker.exported_program(old).module()(prompt), tree_leaves(want))


def test_a_package_without_its_exported_programs(decoder_files, tmp_path):
    """``keep_exported=False``: a smaller file that loads and answers the same; asking it for
    the exported program says why there is none. (Packaged again from the programs the first
    package kept, whose outputs come flat: the logits first.)"""
    model, prompt, files = decoder_files
    eps = kwker.exported_program(files["both"])
    lean = kwker.package(eps, tmp_path / "lean.kwk", keep_exported=False)
    with zipfile.ZipFile(lean) as z:
        assert not [n for n in z.namelist() if n.endswith(".pt2")]
    assert lean.stat().st_size < files["both"].stat().st_size
    with torch.no_grad():
        got = kwker.load_package(lean, "prompt")(prompt)[0]
        want, _ = model(prompt, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(kwker.PackageError, match="no exported program for 'step'.*keep_exported"):
        kwker.exported_program(lean, "step")
