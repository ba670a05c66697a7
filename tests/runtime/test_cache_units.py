"""In-process checks of the cache's building blocks: entry encoding, sizes, eviction, locks."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from cache_tools.inventory import parse_age
from kwker.runtime import cache


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("KWKER_CACHE", raising=False)
    monkeypatch.delenv("KWKER_CACHE_MAX_BYTES", raising=False)
    monkeypatch.setattr(cache, "_warned", set())
    return cache.cache_root()


HEADER = {"key": "k", "symbol": "kw_x", "target": {"cpu": "znver4"}, "kwker": "1", "llvm": "22"}


def test_every_truncation_and_every_flipped_byte_is_detected():
    data = cache.encode_entry(HEADER, bytes(range(64)))
    assert cache.decode_entry(data) == (dict(HEADER, size=64, sha256=cache.decode_entry(data)[0]
                                             ["sha256"]), bytes(range(64)))
    for n in range(len(data)):
        with pytest.raises(ValueError):
            cache.decode_entry(data[:n])
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x20
        with pytest.raises(ValueError):
            cache.decode_entry(bytes(bad))


def test_header_mismatch_names_the_reason():
    want = dict(HEADER, target={"cpu": "haswell", "features": ""})
    assert "different target (znver4" in cache.mismatch(HEADER, want)
    assert "different kwker ('1', expected '2')" in cache.mismatch(HEADER, dict(HEADER, kwker="2"))
    assert cache.mismatch(HEADER, HEADER) is None


@pytest.mark.parametrize("text, size", [("123", 123), ("64k", 64 << 10), ("64KiB", 64 << 10),
                                        ("500M", 500 << 20), ("1G", 1 << 30), ("1.5k", 1536),
                                        ("2 gb", 2 << 30)])
def test_parse_size(text, size):
    assert cache.parse_size(text) == size


def test_bad_size_limit_warns_and_falls_back_to_the_default(root, monkeypatch, caplog):
    monkeypatch.setenv("KWKER_CACHE_MAX_BYTES", "lots")
    with caplog.at_level(logging.WARNING, "kwker"):
        assert cache.max_bytes() == cache.DEFAULT_MAX_BYTES
    assert "not a size: 'lots'" in caplog.text
    monkeypatch.setenv("KWKER_CACHE_MAX_BYTES", "0")
    assert cache.max_bytes() == 0


def test_parse_age():
    assert [parse_age(t) for t in ("30s", "15m", "12h", "7d", "2w")] == \
        [30, 900, 43200, 604800, 1209600]
    for bad in ("7", "d", "-1d", "soon"):
        with pytest.raises(ValueError):
            parse_age(bad)


def test_store_evicts_least_recently_used_entries_beyond_the_limit(root, monkeypatch):
    obj = b"\x90" * 1000
    now = time.time()
    for i, key in enumerate(["a1" * 32, "b2" * 32, "c3" * 32]):
        assert cache.store(key, HEADER, obj)
        path = cache.entry_path(root, key)
        os.utime(path, (now - 100 + i, now - 100 + i))
    os.utime(cache.entry_path(root, "a1" * 32))  # used just now
    size = cache.entry_path(root, "a1" * 32).stat().st_size
    monkeypatch.setenv("KWKER_CACHE_MAX_BYTES", str(3 * size + 100))  # headers vary by a byte
    assert cache.store("d4" * 32, HEADER, obj)
    left = {e.key[:2] for e in cache.iter_entries(root)}
    assert left == {"a1", "c3", "d4"}  # b2 was the least recently used
    removed = cache.evict(root, keep=cache.entry_path(root, "d4" * 32), limit=size + 100)
    assert {e.key[:2] for e in removed} == {"a1", "c3"}
    assert [e.key[:2] for e in cache.iter_entries(root)] == ["d4"]


def test_stores_scan_the_cache_only_when_it_may_be_full(root, monkeypatch):
    """A store stats every entry only when this process's running count of the cache's bytes
    would pass the limit, or ``RESCAN_STORES`` stores after its last scan (other processes'
    entries count too); the limit still holds, entries stored by another process included."""
    scans = []
    real = cache._evict
    monkeypatch.setattr(cache, "_evict", lambda *a: scans.append(1) or real(*a))
    monkeypatch.setattr(cache, "RESCAN_STORES", 4)
    obj = b"\x90" * 1000
    keys = [f"{i:02x}" * 32 for i in range(10)]
    for key in keys[:6]:
        assert cache.store(key, HEADER, obj)
    assert len(scans) == 2   # the first store, then the sixth after 4 counted ones
    size = cache.entry_path(root, keys[0]).stat().st_size
    # another process fills the cache behind this one's count: the next scan finds it
    cache.entry_path(root, "ff" * 32).parent.mkdir()
    cache.entry_path(root, "ff" * 32).write_bytes(b"\0" * (20 * size))
    monkeypatch.setenv("KWKER_CACHE_MAX_BYTES", str(int(7.5 * size)))
    for key in keys[6:8]:    # counted: 8 entries of this process's, 7.5 allowed
        assert cache.store(key, HEADER, obj)
    assert len(scans) == 3   # the count passed the limit at the eighth
    # older than the last two, and too large to keep: its 20 entries' bytes were seen
    assert not cache.entry_path(root, "ff" * 32).exists()
    assert {e.key for e in cache.iter_entries(root)} == set(keys[6:8])
    assert sum(e.size for e in cache.iter_entries(root)) <= 7.5 * size


def test_switched_off_cache_builds_and_writes_nothing(root, monkeypatch):
    monkeypatch.setenv("KWKER_CACHE", "0")
    assert cache.get_or_build("e5" * 32, HEADER, HEADER, lambda: b"obj") == (b"obj", False)
    assert not root.parent.exists()


def test_second_build_of_a_key_loads_instead(root):
    builds = []

    def build():
        builds.append(1)
        return b"object code"
    key = "f6" * 32
    expect = dict(HEADER, key=key)
    assert cache.get_or_build(key, expect, expect, build) == (b"object code", False)
    assert cache.get_or_build(key, expect, expect, build) == (b"object code", True)
    assert len(builds) == 1


def test_key_lock_is_exclusive_and_gives_up_after_its_timeout(root, caplog):
    cache.ensure_dir(root)
    key = "0a" * 32
    with cache.key_lock(root, key) as held:
        assert held
        assert cache.try_lock(cache.lock_path(root, key)) is None  # a second holder is refused
        with caplog.at_level(logging.WARNING, "kwker"), cache.key_lock(root, key, 0.05) as other:
            assert not other
    assert "compiling without waiting longer" in caplog.text
    fd = cache.try_lock(cache.lock_path(root, key))
    assert fd is not None  # released on exit
    os.close(fd)


def test_lock_file_removed_while_held_is_not_trusted(root):
    cache.ensure_dir(root)
    path = cache.lock_path(root, "0b" * 32)
    path.parent.mkdir(exist_ok=True)
    stale = os.open(path, os.O_RDWR | os.O_CREAT)  # a waiter's open file, as `clear` unlinks it
    path.unlink()
    fd = cache.try_lock(path)  # a new lock file: the old inode no longer guards the key
    assert fd is not None and os.fstat(fd).st_ino != os.fstat(stale).st_ino
    os.close(fd)
    os.close(stale)


def test_a_directory_where_an_entry_should_be_is_not_fatal(root, caplog):
    key = "1c" * 32
    path = cache.entry_path(cache.ensure_dir(root), key)
    path.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, "kwker"):
        assert cache.get_or_build(key, HEADER, HEADER, lambda: b"obj") == (b"obj", False)
    assert "is not a regular file; remove it" in caplog.text


def test_directory_created_by_another_job_meanwhile_is_used(root, monkeypatch):
    """Prewarm jobs create the cache at the same time: a directory that appears between the
    check that it is missing and the next one is taken, not reported as "not a directory"."""
    real_exists = Path.exists

    def exists_after_another_job(self, *args, **kwargs):
        if self == root and not real_exists(self):
            self.parent.mkdir(parents=True, exist_ok=True)
            self.mkdir(mode=0o700)  # the other job wins the race
        return real_exists(self, *args, **kwargs)
    monkeypatch.setattr(Path, "exists", exists_after_another_job)
    assert cache.ensure_dir(root) == root and root.is_dir()


def test_building_pauses_the_garbage_collector_and_restores_it():
    """Emitting pauses the cyclic collector (its walks of the heap tripled the emit time); nested
    and concurrent pauses share one, and the collector ends as it was before the first."""
    import gc
    import threading

    from kwker.runtime.kernel import gc_paused
    was = gc.isenabled()
    try:
        for before in (True, False):
            gc.enable() if before else gc.disable()
            with gc_paused():
                assert not gc.isenabled()
                inner_done = threading.Event()

                def other():
                    with gc_paused():
                        pass
                    inner_done.set()
                t = threading.Thread(target=other)
                t.start()
                t.join()
                assert inner_done.is_set() and not gc.isenabled()  # the outer pause holds
            assert gc.isenabled() == before
    finally:
        gc.enable() if was else gc.disable()
