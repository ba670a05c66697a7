"""``kwker-cache``: every command, its --json output and its error paths, in subprocesses on a
temp cache. Most runs go through the test worker, where the smoke family stands in for the
generic eager specs so that prewarming is quick; the installed tool is run as well."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from cache_helpers import CODEGEN_VERSION, child_env, entries, entry_for, run_cli, run_worker
from kwsmoke import CacheSmokeSpec

from kwker.runtime.manifest import write_manifest
from kwker.runtime.target import host_target
from kwker.spec import SortingSpec

COMMANDS = ["info", "list", "prewarm", "clear"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, cache_dir):
    done = run_cli(cache_dir, command, "--help", plain=True)
    assert done.code == 0 and done.stdout.startswith(f"usage: kwker-cache {command}")
    assert "--json" in done.stdout and "--cache-dir" in done.stdout


def test_no_command_is_a_usage_error(cache_dir):
    done = run_cli(cache_dir, plain=True)
    assert done.code == 2 and "usage: kwker-cache" in done.stderr


def test_installed_tool_prewarms_real_kernels_from_a_manifest(cache_dir, tmp_path):
    exe = shutil.which("kwker-cache")
    assert exe, "kwker-cache is not on PATH: run pip install -e ."
    manifest = write_manifest(tmp_path / "model.json", [SortingSpec("topk", "float32", True),
                                                        SortingSpec("sort", "int32")])
    done = subprocess.run([exe, "prewarm", "--manifest", str(manifest), "--json"],
                          env=child_env(cache_dir), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert '"compiled": 2' in done.stdout and len(entries(cache_dir)) == 2


def test_prewarm_in_parallel_with_a_progress_bar_then_list_and_info(cache_dir):
    done = run_cli(cache_dir, "prewarm", "--jobs", "2", "--progress")
    assert done.code == 0, done.stderr
    assert "4/4" in done.stderr and "100%" in done.stderr  # tqdm's bar
    assert "4 compiled, 0 already cached, 0 failed" in done.stdout
    again = run_cli(cache_dir, "prewarm", "-j", "2", "--json").json
    assert (again["compiled"], again["cached"], again["failed"], again["error"]) == (0, 4, 0, None)
    listed = run_cli(cache_dir, "list", "--json").json["entries"]
    assert sorted(e["shapes"] for e in listed) == ["n=1", "n=2", "n=3", "n=4"]
    assert {(e["family"], e["dtype"], e["status"]) for e in listed} == \
        {("cachesmoke", "float32", "current")}
    assert all(e["size"] > 0 and e["last_use"] <= time.time() for e in listed)
    table = run_cli(cache_dir, "list", "--sort", "size").stdout.splitlines()
    assert table[0].split() == ["FAMILY", "KERNEL", "DTYPE", "SHAPES", "SIZE", "LAST", "USE",
                                "STATUS"]
    assert "kw_cachesmoke_n3_float32" in "\n".join(table) and table[-1].startswith("4 entries")
    info = run_cli(cache_dir, "info", "--json", env={"KWKER_CACHE_MAX_BYTES": "10M"}).json
    target = host_target()
    assert (info["status"], info["entries"], info["current"], info["other_target"]) == \
        ("ok", 4, 4, 0)
    assert info["limit_bytes"] == 10 << 20 and info["bytes"] == sum(e["size"] for e in listed)
    assert (info["target"]["cpu"], info["target"]["features"]) == (target.cpu, target.features)
    assert info["versions"]["kwker"] == CODEGEN_VERSION
    text = run_cli(cache_dir, "info").stdout
    assert target.describe() in text and "entries          4" in text


def test_a_prewarmed_manifest_makes_the_next_process_start_warm(cache_dir, tmp_path):
    manifest = write_manifest(tmp_path / "m.json", [CacheSmokeSpec(7), CacheSmokeSpec(8),
                                                    CacheSmokeSpec(7)])
    done = run_cli(cache_dir, "prewarm", "--manifest", str(manifest), "--json")
    assert (done.code, done.json["compiled"], len(done.json["kernels"])) == (0, 2, 2)
    served = run_worker(cache_dir, 7, 8)
    assert (served.json["hits"], served.json["misses"]) == (2, 0)


def test_prewarm_reports_kernels_that_fail_and_still_compiles_the_others(cache_dir, tmp_path):
    manifest = write_manifest(tmp_path / "m.json", [CacheSmokeSpec(-1), CacheSmokeSpec(5)])
    done = run_cli(cache_dir, "prewarm", "--manifest", str(manifest), "-j", "2")
    assert done.code == 1
    assert done.stderr.splitlines()[-1] == (
        "kwker-cache: error: 1 of 2 kernels failed (first: kw_cachesmoke_n-1_float32: "
        "ValueError: cachesmoke cannot emit n=-1)")
    assert "1 compiled" in done.stdout and len(entries(cache_dir)) == 1


@pytest.mark.parametrize("content, reason", [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ('{"specs": []}', "is not a Kwker manifest"),
    ('{"kwker_manifest": 1, "specs": [{"family": "gemm9000", "m": 1}]}',
     "unknown kernel family 'gemm9000'"),
])
def test_prewarm_with_a_bad_manifest_fails_with_the_reason(content, reason, cache_dir, tmp_path):
    path = tmp_path / "manifest.json"
    if content is not None:
        path.write_text(content)
    done = run_cli(cache_dir, "prewarm", "--manifest", str(path))
    assert done.code == 1 and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith("kwker-cache: error: ") and reason in done.stderr


def test_prewarm_usage_errors_and_switched_off_cache(cache_dir):
    bad = run_cli(cache_dir, "prewarm", "--jobs", "many")
    assert bad.code == 2 and "not a number of jobs" in bad.stderr
    off = run_cli(cache_dir, "prewarm", env={"KWKER_CACHE": "0"})
    assert off.code == 1 and "switched off (KWKER_CACHE=0)" in off.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_cache_dir_that_is_a_file_fails_every_command_with_one_line(command, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    done = run_cli(a_file, command)
    assert done.code == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("kwker-cache: error: ")
    assert line.endswith(f"cache path {a_file} is not a directory (check KWKER_CACHE_DIR)")
    as_json = run_cli(tmp_path / "elsewhere", command, "--json", "--cache-dir", str(a_file))
    assert as_json.code == 1 and "is not a directory" in as_json.json["error"]


def test_missing_cache_dir_is_not_an_error(cache_dir):
    info = run_cli(cache_dir, "info", "--json")
    assert (info.code, info.json["status"], info.json["entries"]) == (0, "missing", 0)
    for command in ("list", "clear"):
        done = run_cli(cache_dir, command)
        assert done.code == 0 and "0 entries" in done.stdout
    assert not cache_dir.exists()


@pytest.fixture
def mixed_cache(cache_dir):
    """Entries for this machine (1, 2), an older Kwker (3), another CPU (4), and a bad one."""
    keys = run_worker(cache_dir, 1, 2).json["keys"]
    run_worker(cache_dir, 3, faults=["version:0.0.9+0123456789ab"])
    run_worker(cache_dir, 4, env={"KWKER_CPU": "haswell", "KWKER_FEATURES": ""})
    bad = entry_for(cache_dir, "ab" * 32)
    bad.parent.mkdir(mode=0o700, exist_ok=True)
    bad.write_bytes(b"garbage")
    return keys


def test_info_and_list_tell_stale_entries_apart(cache_dir, mixed_cache):
    info = run_cli(cache_dir, "info", "--json").json
    assert (info["entries"], info["current"], info["other_version"], info["other_target"],
            info["bad"]) == (5, 2, 1, 1, 1)
    stale = run_cli(cache_dir, "list", "--stale", "--json").json["entries"]
    assert sorted(e["status"] for e in stale) == ["bad", "other target", "other version"]
    assert "other target (haswell)" in run_cli(cache_dir, "list").stdout


def test_clear_stale_old_and_all(cache_dir, mixed_cache):
    dry = run_cli(cache_dir, "clear", "--stale", "--dry-run", "--json").json
    assert len(dry["removed"]) == 3 and len(entries(cache_dir)) == 5
    stale = run_cli(cache_dir, "clear", "--stale")
    assert stale.code == 0 and stale.stdout.splitlines()[-1].startswith("removed 3 entries")
    assert "(other target, " in stale.stdout and "(other version, " in stale.stdout
    assert len(entries(cache_dir)) == 2
    old = entry_for(cache_dir, mixed_cache["1"])
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    done = run_cli(cache_dir, "clear", "--older-than", "1h", "--json").json
    assert [e["path"] for e in done["removed"]] == [str(old)] and done["error"] is None
    rest = run_cli(cache_dir, "clear")
    assert rest.code == 0 and "removed 1 entries" in rest.stdout
    assert entries(cache_dir) == [] and list((cache_dir / "v1" / "locks").iterdir()) == []
    assert run_worker(cache_dir, 1).json["misses"] == 1  # and the cache still works


def test_clear_usage_errors(cache_dir):
    done = run_cli(cache_dir, "clear", "--older-than", "banana")
    assert done.code == 2 and "not an age: 'banana'" in done.stderr
    both = run_cli(cache_dir, "clear", "--stale", "--older-than", "1d")
    assert both.code == 2 and "not allowed with" in both.stderr
