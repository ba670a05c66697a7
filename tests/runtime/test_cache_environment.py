"""A cache directory Kwker cannot or must not use: read-only, missing, on a full disk, a file, or
writable by other users. Kwker still computes correctly (compiling in memory), warns once per
process, and never loads code from a directory or entry that others could have written.

Read-only and full disks are real tmpfs mounts where this process may mount (root), and
simulated by injecting EROFS/ENOSPC into the worker process otherwise; both variants run here."""
from __future__ import annotations

import os
import stat

import pytest
from cache_helpers import entries, entry_for, fill, remount_readonly, run_cli, run_worker, temps


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_one_warning(done, *words):
    assert len(done.warnings) == 1, done.stderr
    for w in words:
        assert w in done.warnings[0], done.warnings[0]


@pytest.mark.parametrize("how", ["tmpfs-remounted-ro", "simulated-erofs"])
def test_read_only_cache_loads_what_it_has_and_compiles_the_rest_in_memory(how, tmpfs,
                                                                          cache_dir):
    if how == "tmpfs-remounted-ro":
        mnt = tmpfs("1m")
        cache_dir = mnt / "cache"
    run_worker(cache_dir, 1)
    env = {}
    if how == "tmpfs-remounted-ro":
        remount_readonly(mnt)
    else:
        env = {"KWKER_TEST_FAULTS": "erofs"}
    done = run_worker(cache_dir, 1, 2, 3, env=env)
    assert (done.json["hits"], done.json["misses"]) == (1, 2)
    assert_one_warning(done, "Read-only file system", "compiling in memory")
    assert len(entries(cache_dir)) == 1
    info = run_cli(cache_dir, "info", env=env)
    assert info.code == 1 and info.stderr.strip().endswith(
        "is read-only; new kernels are compiled in memory on every run")
    prewarm = run_cli(cache_dir, "prewarm", "--jobs", "1", env=env)
    assert prewarm.code == 1 and "cannot prewarm" in prewarm.stderr
    clear = run_cli(cache_dir, "clear", env=env)
    assert clear.code == 1 and "Read-only file system" in clear.stderr.splitlines()[-1]
    assert len(entries(cache_dir)) == 1


@pytest.mark.parametrize("how", ["tmpfs-remounted-ro", "simulated-erofs"])
def test_missing_cache_dir_that_cannot_be_created(how, tmpfs, tmp_path):
    env = {}
    if how == "tmpfs-remounted-ro":
        mnt = tmpfs("64k")
        remount_readonly(mnt)
        where = mnt / "not" / "there"
    else:
        env = {"KWKER_TEST_FAULTS": "erofs"}
        where = tmp_path / "not" / "there"
    done = run_worker(where, 1, 2, env=env)
    assert done.json["misses"] == 2
    assert_one_warning(done, "cannot create cache directory", "Read-only file system")
    assert not where.exists()
    if how == "tmpfs-remounted-ro":  # the CLI probes with os.access, which the OS answers
        info = run_cli(where, "info")
        assert info.code == 1 and "cannot create cache directory" in info.stderr


def test_missing_cache_dir_is_created_private_and_recreated_if_deleted(tmp_path):
    where = tmp_path / "a" / "b" / "cache"
    done = run_worker(where, 1, 2, extra=("--umask=000", "--wipe-after=1"))
    assert (done.json["misses"], done.warnings) == (2, [])
    [entry] = entries(where)  # 1's entry went with the wipe; 2's is in the recreated dir
    for d in (tmp_path / "a", tmp_path / "a" / "b", where, where / "v1", entry.parent,
              where / "v1" / "locks"):
        assert mode(d) == 0o700, d
    assert mode(entry) == 0o600
    assert all(mode(p) == 0o600 for p in (where / "v1" / "locks").iterdir())


@pytest.mark.parametrize("how", ["tmpfs-full", "simulated-enospc"])
def test_full_disk(how, tmpfs, cache_dir):
    env = {}
    if how == "tmpfs-full":
        cache_dir = tmpfs("256k") / "cache"
        run_worker(cache_dir, 1)
        fill(cache_dir.parent)
    else:
        run_worker(cache_dir, 1)
        env = {"KWKER_TEST_FAULTS": "enospc"}
    done = run_worker(cache_dir, 1, 2, 3, env=env)
    assert (done.json["hits"], done.json["misses"]) == (1, 2)
    assert_one_warning(done, "No space left on device", "compiling in memory")
    assert temps(cache_dir) == [] and len(entries(cache_dir)) == 1
    info = run_cli(cache_dir, "info", env=env)
    assert info.code == 1 and "is on a full disk" in info.stderr
    assert len(info.stderr.strip().splitlines()) == 1


def test_cache_dir_pointing_at_a_file(tmp_path):
    a_file = tmp_path / "cache-is-a-file"
    a_file.write_text("not a directory")
    for where in (a_file, a_file / "below"):
        done = run_worker(where, 1, 2)
        assert done.json["misses"] == 2
        assert_one_warning(done, f"cache path {a_file} is not a directory", "KWKER_CACHE_DIR")
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize("which", ["KWKER_CACHE_DIR", "v1"])
def test_cache_dir_writable_by_others_is_refused(which, cache_dir):
    run_worker(cache_dir, 1)
    d = cache_dir if which == "KWKER_CACHE_DIR" else cache_dir / "v1"
    d.chmod(0o777)
    done = run_worker(cache_dir, 1, 2)
    assert (done.json["hits"], done.json["misses"]) == (0, 2)
    assert_one_warning(done, f"{d} is writable by other users", f"chmod go-w {d}")
    assert len(entries(cache_dir)) == 1  # nothing written into it either
    info = run_cli(cache_dir, "info")
    assert info.code == 1 and f"fix with: chmod go-w {d}" in info.stderr


def test_sticky_shared_parent_like_tmp_is_accepted(cache_dir):
    run_worker(cache_dir, 1)
    cache_dir.chmod(0o1777)
    done = run_worker(cache_dir, 1)
    assert (done.json["hits"], done.warnings) == (1, [])


def test_entries_writable_by_others_or_owned_by_another_user_are_refused(cache_dir):
    # three kernels whose entries sit in three different shard directories (keys follow the
    # codegen version and the CPU: two of three kernels share a shard in ~1% of versions)
    keys = run_worker(cache_dir, *range(1, 9)).json["keys"]
    by_shard = {}
    for n, key in sorted(keys.items()):
        by_shard.setdefault(key[:2], n)
    ns = sorted(by_shard.values())[:3]
    assert len(ns) == 3
    writable, foreign, subdir = (entry_for(cache_dir, keys[n]) for n in ns)
    writable.chmod(0o666)
    os.chown(foreign, 4242, 4242)
    subdir.parent.chmod(0o777)
    done = run_worker(cache_dir, *map(int, ns))
    assert (done.json["hits"], done.json["misses"]) == (0, 3)
    assert len(done.warnings) == 3, done.stderr
    text = "\n".join(done.warnings)
    assert f"{writable} is writable by other users" in text
    assert f"{foreign} belongs to another user (uid 4242)" in text
    assert f"{subdir.parent} is writable by other users" in text
    # The directory is ours, so the rebuilt entries replaced the refused ones.
    for p in (writable, foreign):
        assert mode(p) == 0o600 and p.stat().st_uid == os.getuid()
