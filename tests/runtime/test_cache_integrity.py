"""Entries that must never be loaded: torn, corrupted, edited, for another CPU or version, or
left behind by a writer that was killed. Each test runs kernels in fresh processes on a temp
cache and checks both the numbers and whether the entry was loaded (hits) or rebuilt (misses)."""
from __future__ import annotations

import json
import os
import signal
import time

from cache_helpers import WORKER, entries, entry_for, finish, run_worker, spawn, temps

from kwker.runtime import cache


def test_truncated_corrupted_and_edited_entries_are_discarded_once_and_rebuilt(cache_dir):
    keys = run_worker(cache_dir, 1, 2, 3, 4).json["keys"]
    paths = {n: entry_for(cache_dir, keys[str(n)]) for n in (1, 2, 3, 4)}
    good = {n: p.read_bytes() for n, p in paths.items()}
    paths[1].write_bytes(good[1][:len(good[1]) * 2 // 3])           # truncated
    flipped = bytearray(good[2])
    flipped[-100] ^= 0x01                                            # one bit of the code
    paths[2].write_bytes(bytes(flipped))
    paths[3].write_bytes(good[3].replace(b'"opt_level": 3', b'"opt_level": 2'))  # hand-edited
    paths[4].write_bytes(b"")                                        # empty
    done = run_worker(cache_dir, 1, 2, 3, 4, 1, 2)
    assert (done.json["hits"], done.json["misses"]) == (0, 4)
    assert len(done.warnings) == 4, done.stderr
    assert all("discarding bad cache entry" in w for w in done.warnings)
    for p in paths.values():  # rebuilt whole, and loadable by the next process
        cache.decode_entry(p.read_bytes())
    again = run_worker(cache_dir, 1, 2, 3, 4)
    assert (again.json["hits"], again.json["misses"], again.warnings) == (4, 0, [])


def test_avx512_entry_is_never_loaded_on_an_avx2_machine(cache_dir):
    avx512 = {"KWKER_CPU": "skylake-avx512", "KWKER_FEATURES": ""}
    avx2 = {"KWKER_CPU": "haswell", "KWKER_FEATURES": ""}
    built = run_worker(cache_dir, 1, env=avx512)
    on_avx2 = run_worker(cache_dir, 1, env=avx2)
    assert on_avx2.json["misses"] == 1  # another target: another key
    k512, k2 = built.json["keys"]["1"], on_avx2.json["keys"]["1"]
    assert k512 != k2 and len(entries(cache_dir)) == 2
    # Even copied to where the AVX2 machine looks, the AVX-512 entry is refused by its header.
    entry_for(cache_dir, k2).write_bytes(entry_for(cache_dir, k512).read_bytes())
    forged = run_worker(cache_dir, 1, env=avx2)
    assert (forged.json["hits"], forged.json["misses"]) == (0, 1)
    assert len(forged.warnings) == 1 and "different target" in forged.warnings[0]
    header = cache.read_header(entry_for(cache_dir, k2))
    assert header["target"]["cpu"] == "haswell"


def _reseal(path, **changes):
    header, obj = cache.decode_entry(path.read_bytes())
    path.write_bytes(cache.encode_entry(dict(header, **changes), obj))


def test_entries_of_other_kwker_or_llvm_versions_are_never_loaded(cache_dir):
    old = run_worker(cache_dir, 1, faults=["version:0.0.9+0123456789ab"])
    new = run_worker(cache_dir, 1, 2)
    assert new.json["misses"] == 2  # the old release's entry lives under another key
    assert old.json["keys"]["1"] != new.json["keys"]["1"]
    # Entries with a valid checksum but another version, where this version looks:
    _reseal(entry_for(cache_dir, new.json["keys"]["1"]), kwker="0.0.9+0123456789ab")
    _reseal(entry_for(cache_dir, new.json["keys"]["2"]), llvm="21.1.0")
    done = run_worker(cache_dir, 1, 2)
    assert (done.json["hits"], done.json["misses"]) == (0, 2)
    assert sorted(w.split("built for a different ")[1].split()[0] for w in done.warnings) \
        == ["kwker", "llvm"]


def test_killing_a_writer_mid_write_leaves_nothing_that_is_loaded(cache_dir, tmp_path):
    ready = tmp_path / "half-written"
    proc = spawn([str(WORKER), "run", "1", f"--fault=kill-mid-write:{ready}"], cache_dir)
    while not ready.exists():
        assert proc.poll() is None, finish(proc).stderr
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert entries(cache_dir) == [] and len(temps(cache_dir)) == 1  # only the torn temp file
    done = run_worker(cache_dir, 1)  # the dead writer's lock was released by the kernel
    assert (done.json["hits"], done.json["misses"], done.warnings) == (0, 1, [])
    assert temps(cache_dir) == []  # the leftover was removed under the key's lock
    [entry] = entries(cache_dir)
    cache.decode_entry(entry.read_bytes())


def test_four_processes_compiling_the_same_kernels_write_each_entry_once(cache_dir, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    ns = [1, 2, 3, 4, 5, 6]
    procs = [spawn([str(WORKER), "run", *map(str, ns[i:] + ns[:i]), f"--barrier={gate}"],
                   cache_dir, env={"KWKER_DEBUG": "1"}) for i in range(4)]
    while len(list(gate.glob("ready-*"))) < 4:
        assert all(p.poll() is None for p in procs)
        time.sleep(0.01)
    (gate / "go").touch()
    results = [finish(p) for p in procs]
    for r in results:
        assert r.code == 0, r.stderr
        assert r.json["ok"]
        assert not [w for w in r.warnings if "discarding" in w or "cannot" in w], r.stderr
    stores = [line.split()[-1] for r in results for line in r.stderr.splitlines()
              if line.startswith("kwker: stored cache entry")]
    keys = set(results[0].json["keys"].values())
    assert sorted(stores) == sorted(keys)  # each entry written exactly once, by one process
    assert sum(r.json["misses"] for r in results) == len(ns)
    assert sum(r.json["hits"] for r in results) == 3 * len(ns)
    assert len(entries(cache_dir)) == len(ns) and temps(cache_dir) == []
    for e in entries(cache_dir):
        cache.decode_entry(e.read_bytes())


def test_a_load_marks_the_entry_used_so_eviction_keeps_it(cache_dir):
    keys = run_worker(cache_dir, 1, 2, 3).json["keys"]
    paths = {n: entry_for(cache_dir, keys[str(n)]) for n in (1, 2, 3)}
    for age, n in enumerate((1, 2, 3)):  # created long ago, 1 oldest
        os.utime(paths[n], (time.time() - 1000 + age, time.time() - 1000 + age))
    assert run_worker(cache_dir, 1).json["hits"] == 1  # 1 is now the most recently used
    limit = int(2.5 * max(p.stat().st_size for p in paths.values()))
    done = run_worker(cache_dir, 4, env={"KWKER_CACHE_MAX_BYTES": str(limit)})
    assert done.json["misses"] == 1
    left = {json.loads(json.dumps(cache.read_header(p)["spec"]))["n"] for p in entries(cache_dir)}
    assert left == {1, 4}  # 2 and 3 were the least recently used
