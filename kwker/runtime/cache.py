"""Content-addressed object-code cache on disk.

One file per kernel: ``<dir>/v1/<key[:2]>/<key>.kwo``. The key hashes the spec, the target (CPU
name and features, opt level), the llvmlite/LLVM versions and Kwker's codegen version (a hash of
its codegen sources, so an emitter edit re-keys every entry it touches). The file starts with a
JSON header that repeats all of that plus a SHA-256 of the object bytes; an entry whose header does
not match what was asked for, or whose checksum fails, is a miss: it is removed and rebuilt, never
loaded. Writes go to a temp file in the same directory and ``os.replace`` into place, so a reader
sees a whole entry or none.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import platformdirs

from .. import __version__
from .target import Target

log = logging.getLogger("kwker")

MAGIC = b"KWKER-OBJ-1\n"
LAYOUT = "v1"
SUFFIX = ".kwo"


@functools.lru_cache(maxsize=None)
def codegen_version() -> str:
    """Kwker version plus a hash of the sources that decide the emitted code."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(__version__.encode())
    for path in sorted((root / "codegen").glob("*.py")) + [root / "spec.py"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


def versions() -> dict:
    return {"kwker": codegen_version(), "llvmlite": llvmlite.__version__,
            "llvm": ".".join(map(str, llvm.llvm_version_info))}


def entry_key(spec_id: str, target: Target) -> str:
    blob = json.dumps({"spec": spec_id, "target": asdict(target), **versions()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_root() -> Path | None:
    """The cache directory, or None when caching is switched off (KWKER_CACHE=0)."""
    if os.environ.get("KWKER_CACHE", "1") == "0":
        return None
    base = os.environ.get("KWKER_CACHE_DIR") or platformdirs.user_cache_dir("kwker")
    return Path(base) / LAYOUT


class UnusableCache(Exception):
    """The cache directory cannot be used; Kwker then compiles in memory."""


_warned: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def check_private(path: Path) -> None:
    """Refuse a directory or file that other users may write: loading object code runs it."""
    st = path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnusableCache(f"{path} is writable by other users; refusing to load code from it "
                            f"(fix with: chmod go-w {path})")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnusableCache(f"{path} belongs to another user; refusing to load code from it")


def ensure_dir(root: Path) -> Path:
    if root.exists() and not root.is_dir():
        raise UnusableCache(f"cache path {root} is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise UnusableCache(f"cannot create cache directory {root}: {e.strerror}") from None
    check_private(root)
    return root


def entry_path(root: Path, key: str) -> Path:
    return root / key[:2] / (key + SUFFIX)


def encode_entry(header: dict, obj: bytes) -> bytes:
    header = dict(header, sha256=hashlib.sha256(obj).hexdigest(), size=len(obj))
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head + obj


def decode_entry(data: bytes) -> tuple[dict, bytes]:
    """Header and object bytes of an entry; ValueError if it is torn or tampered with."""
    if not data.startswith(MAGIC):
        raise ValueError("not a kwker cache entry")
    pos = len(MAGIC)
    n = int.from_bytes(data[pos:pos + 4], "little")
    header = json.loads(data[pos + 4:pos + 4 + n])
    obj = data[pos + 4 + n:]
    if len(obj) != header.get("size") or hashlib.sha256(obj).hexdigest() != header.get("sha256"):
        raise ValueError("checksum mismatch (truncated or corrupted)")
    return header, obj


def read_header(path: Path) -> dict:
    return decode_entry(path.read_bytes())[0]


def load(key: str, expect: dict) -> bytes | None:
    """Object bytes for ``key``, or None on a miss. Bad entries are logged once and removed."""
    root = cache_root()
    if root is None:
        return None
    path = entry_path(root, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warn_once(f"kwker: cannot read cache entry {path}: {e.strerror}; compiling in memory")
        return None
    try:
        check_private(path)
        check_private(path.parent.parent)
        header, obj = decode_entry(data)
        for field, want in expect.items():
            if header.get(field) != want:
                raise ValueError(f"built for a different {field}")
    except UnusableCache as e:
        warn_once(f"kwker: {e}")
        return None
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        warn_once(f"kwker: discarding bad cache entry {path.name}: {e}; it will be rebuilt")
        try:
            path.unlink()
        except OSError:
            pass
        return None
    try:
        os.utime(path)  # last use, for LRU eviction and `kwker-cache list`
    except OSError:
        pass
    return obj


def store(key: str, header: dict, obj: bytes) -> None:
    """Write an entry atomically; any failure only costs the cache, never the caller."""
    root = cache_root()
    if root is None:
        return
    try:
        ensure_dir(root)
        final = entry_path(root, key)
        final.parent.mkdir(exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(encode_entry(dict(header, created=time.time()), obj))
            os.replace(tmp, final)
        except BaseException:
            os.unlink(tmp)
            raise
    except UnusableCache as e:
        warn_once(f"kwker: {e}; compiling in memory")
    except OSError as e:
        warn_once(f"kwker: cannot write to the kernel cache under {root}: {e.strerror}; "
                  "compiling in memory")
