"""A transformers decoder served from one Kwker package holding two programs, the prompt's
forward and one decode step (their weights stored, and loaded, once): generation with no dynamo
in the loop (bench_decode.py's "package" rows).

``torch.export`` takes tensors, tuples and dicts, not transformers' ``DynamicCache``, so each
program is exported through a small module that hands the cache over as a tuple of (keys,
values) per layer: the prompt's returns it, the step's takes it (its length a dynamic size) and
returns it one position longer. The loaded step takes the past as that tuple too
(``kwker.load_package``), appends to it in place, and checks nothing but its inputs' shapes, where
``torch.compile`` evaluates dynamo's guards on every call (GPT-2: about 1 ms a token).

``Packaged`` answers as the model does (``.logits``, ``.past_key_values``), so bench_decode's
``generate`` drives it as it drives the others.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

import kwker


def _cache(config, past):
    """A ``DynamicCache`` holding ``past`` ((keys, values) per layer) as its layers' tensors."""
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    for layer, (k, v) in zip(cache.layers, past):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def _as_tuple(cache) -> tuple:
    return tuple((layer.keys, layer.values) for layer in cache.layers)


class _Tupled(torch.nn.Module):
    """``model`` with its cache as a tuple of (keys, values) per layer: ``(ids, past=None) ->
    (logits, past)``; exported once without a past (the prompt) and once with one (a step)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, past=None):
        cache = None if past is None else _cache(self.model.config, past)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits, _as_tuple(out.past_key_values)


class Packaged:
    """``model(input_ids=..., past_key_values=None | tuple, use_cache=True)`` on the package's
    two programs (``Packaged.build``)."""

    def __init__(self, prompt, step, nbytes: int):
        self.prompt, self.step, self.nbytes = prompt, step, nbytes

    @classmethod
    def build(cls, model, prompt_len: int):
        """Export, package and load ``model``'s prompt forward (``prompt_len`` tokens) and its
        decode step (any past length); the file is deleted once loaded."""
        with tempfile.TemporaryDirectory(prefix="kwker-decode-") as folder:
            return cls._build(model, prompt_len, Path(folder))

    @classmethod
    def _build(cls, model, prompt_len: int, folder: Path):
        ids = torch.zeros(1, prompt_len, dtype=torch.long)
        with torch.no_grad():
            logits, past = _Tupled(model)(ids)
        first = torch.export.export(_Tupled(model).eval(), (ids,), strict=False)
        # each layer's past length dynamic (a named Dim with a range made export fail on the
        # Llama, its guards unprovable over the range)
        length = torch.export.Dim.DYNAMIC
        step = torch.export.export(
            _Tupled(model).eval(), (ids[:, :1], past),
            dynamic_shapes=({}, tuple(({2: length}, {2: length}) for _ in past)), strict=False)
        path = kwker.package({"prompt": first, "step": step}, folder / "decoder.kwk")
        programs = kwker.load_package(path)
        return cls(programs["prompt"], programs["step"], path.stat().st_size)

    def __call__(self, input_ids, past_key_values=None, use_cache=True):
        if past_key_values is None:
            logits, past = self.prompt(input_ids)
        else:
            logits, past = self.step(input_ids, past_key_values)
        return SimpleNamespace(logits=logits, past_key_values=past)
