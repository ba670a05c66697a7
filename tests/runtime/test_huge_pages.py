"""Copies on huge pages (runtime/huge_pages.py): the same values, aligned, alive as long as any
copy is referenced, and on Linux with transparent huge pages backed by them."""
import gc
import re
from pathlib import Path

import pytest
import torch

from kwker.runtime import huge_pages


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.float32, torch.bfloat16])
def test_copies_hold_the_values_aligned(dtype):
    torch.manual_seed(0)
    sources = [torch.randn(shape).to(dtype) for shape in ((3, 5), (1000, 77), (1,), (0, 4))]
    copies = [huge_pages.copy(t) for t in sources]
    for src, c in zip(sources, copies):
        assert c.dtype == dtype and c.shape == src.shape and c.is_contiguous()
        assert torch.equal(c, src)
        assert c.numel() == 0 or c.data_ptr() % huge_pages.ALIGN == 0
    # each a storage of its own, as ordinary tensors (code keys state and aliasing on them)
    live = [c for c in copies if c.numel()]
    assert all(c.untyped_storage().nbytes() == c.numel() * c.element_size() for c in live)
    assert len({c.untyped_storage().data_ptr() for c in live}) == len(live)
    # distinct memory: writing one copy leaves the others (and the sources) as they were
    copies[1].zero_()
    assert torch.equal(copies[0], sources[0]) and torch.equal(sources[1], sources[1].clone())


def test_copies_outlive_their_chunk_and_the_other_copies():
    """A copy keeps its mapping alive after the allocator moved on to other chunks and every
    other copy was freed (reading it then would crash if it had been unmapped)."""
    keep = huge_pages.copy(torch.arange(1000, dtype=torch.int32))
    for _ in range(3):  # more than a chunk of others, then dropped
        others = [huge_pages.empty((huge_pages.CHUNK // 8,), torch.uint8).fill_(7)
                  for _ in range(4)]
        del others
        gc.collect()
    big = huge_pages.copy(torch.ones(huge_pages.CHUNK // 2, dtype=torch.uint8))
    del big
    gc.collect()
    assert torch.equal(keep, torch.arange(1000, dtype=torch.int32))


def test_large_copies_are_advised_from_a_huge_page_boundary():
    """Where Linux offers transparent huge pages, a copy of a quarter chunk or more starts on
    a 2 MB boundary and the advice is taken; elsewhere it is an ordinary copy."""
    before = dict(huge_pages.stats)
    t = huge_pages.empty((huge_pages.CHUNK,), torch.uint8).fill_(1)
    assert t.data_ptr() % huge_pages.HUGE == 0
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages here: {_thp_mode()}")
    assert huge_pages.stats["advised_bytes"] >= before["advised_bytes"] + huge_pages.CHUNK
    assert huge_pages.stats["refused"] == before["refused"]


def test_without_mappings_copies_are_ordinary_memory(monkeypatch):
    """Where the OS refuses a new mapping, a copy is made in ordinary memory all the same."""
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    monkeypatch.setitem(huge_pages._chunk, "view", None)  # the current chunk is full
    src = torch.arange(100_000, dtype=torch.int32)
    for t in (src, torch.ones(huge_pages.CHUNK // 4, dtype=torch.uint8)):
        assert torch.equal(huge_pages.copy(t), t)


def test_move_keeps_the_tensor_and_its_values():
    """``move``: the same tensor object, shape, strides and values on an aligned storage of
    its own; a second move leaves it where it is."""
    torch.manual_seed(0)
    for shape in ((3, 5), (3072, 768)):
        t = torch.randint(-128, 128, shape, dtype=torch.int8)
        ref, old = t.clone(), t.untyped_storage().data_ptr()
        assert huge_pages.move(t)
        assert torch.equal(t, ref) and t.stride() == ref.stride() and t.storage_offset() == 0
        assert t.untyped_storage().data_ptr() != old
        assert t.data_ptr() % huge_pages.ALIGN == 0
        assert t.untyped_storage().nbytes() == t.numel()
        again = t.untyped_storage().data_ptr()
        assert not huge_pages.move(t) and t.untyped_storage().data_ptr() == again
    t.add_(1)   # it is ordinary writable memory
    assert torch.equal(t, ref + 1)


def test_move_leaves_what_it_must_not_change():
    """Views into larger storages, non-contiguous tensors, tensors that need grad, inference
    tensors, shared memory and empty tensors stay where they are."""
    base = torch.ones(10, 10)
    with torch.inference_mode():
        inference = torch.ones(100)
    shared = torch.ones(100).share_memory_()
    cases = [base[2:], base[:, :5], base.t(), torch.ones(10, requires_grad=True), inference,
             shared, torch.ones(0)]
    for t in cases:
        where = t.untyped_storage().data_ptr()
        assert not huge_pages.move(t)
        assert t.untyped_storage().data_ptr() == where
