"""Content-addressed object-code cache on disk, safe to share between processes.

One file per kernel: ``<dir>/v1/<key[:2]>/<key>.kwo``. The key hashes the spec, the target (CPU
name and features, opt level), the llvmlite/LLVM versions and Kwker's codegen version (a hash of
its codegen sources, so an emitter edit re-keys every entry it touches). Each file is a JSON header
repeating all of that, then the object bytes; a SHA-256 over header and object catches truncated,
corrupted and hand-edited entries. An entry that fails the checksum, or whose header does not
match what was asked for (another CPU, another version), is logged once, removed and rebuilt:
it is never loaded, because loading object code runs it.

Why each mechanism exists:

- Writes go to ``.tmp-<key>-*`` in the entry's directory and ``os.replace`` into place, so a
  reader sees a whole entry or none, even when the writer is killed mid-write.
- ``locks/<key>.lock`` (``fcntl.flock``) lets one process compile a key while the others wait
  and then load it: an entry is written once. The kernel drops a flock when its holder dies.
- Directories are created 0700; a directory or entry that other users may write, or that another
  user owns, is refused (it could hold their code), with the ``chmod`` that fixes it.
- ``KWKER_CACHE_MAX_BYTES`` (default 1 GiB, ``0`` for no limit) bounds the size; the least
  recently used entries go first (a load touches the entry's mtime). Measuring the size means a
  stat of every entry (15-30 ms for 3500 entries), so a process scans only when its running
  count, the size it last scanned plus what it has stored since, would pass the limit, and
  every ``RESCAN_STORES`` stores, to count other processes' entries: scanning on every store
  made a compile cost O(entries), and a fresh cache's filling quadratic.
- Any failure of the cache (read-only, full disk, a file where the directory should be) only
  costs the cache: Kwker compiles in memory and warns once.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import platformdirs

from .. import __version__
from .target import Target

log = logging.getLogger("kwker")

MAGIC = b"KWKER-OBJ-2\n"
LAYOUT = "v1"
SUFFIX = ".kwo"
TMP_PREFIX = ".tmp-"
LOCK_DIR = "locks"
DEFAULT_MAX_BYTES = 1 << 30
LOCK_TIMEOUT = 300.0  # seconds to wait for another process's compile before compiling anyway
RESCAN_STORES = 64    # stores between two scans of the cache's size by one process


@functools.cache
def codegen_version() -> str:
    """Kwker version plus a hash of the sources that decide the emitted code."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    codegen = os.path.join(root, "codegen")
    h = hashlib.sha256(__version__.encode())
    # os.listdir, not Path.glob: glob compiles a regex, which costs ~0.1 s on a cold start
    paths = sorted(os.path.join(codegen, n) for n in os.listdir(codegen) if n.endswith(".py"))
    for path in paths + [os.path.join(root, "spec.py")]:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as fh:
            h.update(fh.read())
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
    return base_dir() / LAYOUT


def base_dir() -> Path:
    return Path(os.environ.get("KWKER_CACHE_DIR") or platformdirs.user_cache_dir("kwker"))


# --- settings ------------------------------------------------------------------------------------

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'1G', '500M', '64KiB', '123' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 500M, 2G or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def max_bytes() -> int:
    """Size limit from KWKER_CACHE_MAX_BYTES; 0 means no limit."""
    text = os.environ.get("KWKER_CACHE_MAX_BYTES")
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        return parse_size(text)
    except ValueError as e:
        warn_once(f"kwker: KWKER_CACHE_MAX_BYTES: {e}; using the default of 1 GiB")
        return DEFAULT_MAX_BYTES


# --- problems ------------------------------------------------------------------------------------

class UnusableCache(Exception):
    """The cache directory cannot be used; Kwker then compiles in memory."""


_warned: set[str] = set()


def warn_once(msg: str, topic: str | None = None) -> None:
    """Log ``msg`` once per process (per ``topic`` when given, so a problem with the whole
    directory is reported once however many kernels run into it)."""
    topic = topic or msg
    if topic not in _warned:
        _warned.add(topic)
        log.warning(msg)


def check_private(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse a directory or file that other users may write: loading object code runs it."""
    st = st or path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnusableCache(f"{path} is writable by other users; refusing to load code from it "
                            f"(fix with: chmod go-w {path})")
    if st.st_uid != os.getuid():
        raise UnusableCache(f"{path} belongs to another user (uid {st.st_uid}); refusing to load "
                            f"code from it (fix with: chown -R $(id -u) {path}, or remove it)")


def _check_base(base: Path) -> None:
    st = base.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise UnusableCache(f"cache path {base} is not a directory (check KWKER_CACHE_DIR)")
    # A shared sticky directory such as /tmp is fine: others cannot rename our v1/ inside it.
    if not (st.st_mode & stat.S_ISVTX):
        check_private(base, st)


def check_root(root: Path) -> None:
    """Raise UnusableCache if ``root`` (``<dir>/v1``) must not be used; FileNotFoundError if it
    does not exist yet."""
    try:
        _check_base(root.parent)
        st = root.stat()
    except NotADirectoryError:
        blocker = root.parent
        while not blocker.exists() and blocker != blocker.parent:
            blocker = blocker.parent  # the file that stands where a directory should be
        raise UnusableCache(f"cache path {blocker} is not a directory "
                            "(check KWKER_CACHE_DIR)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnusableCache(f"cache path {root} is not a directory")
    check_private(root, st)


def ensure_dir(root: Path) -> Path:
    """Create ``root`` (and its parent) private to this user if missing, then check it."""
    missing = []
    d = root
    while not d.is_dir():
        if d.exists() or d == d.parent:
            if d.is_dir():  # another process or prewarm job created it just now
                break
            raise UnusableCache(f"cache path {d} is not a directory (check KWKER_CACHE_DIR)")
        missing.append(d)
        d = d.parent
    for d in reversed(missing):  # every directory we create is private, whatever the umask
        try:
            d.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise UnusableCache(f"cannot create cache directory {d}: {e.strerror}") from None
    check_root(root)
    return root


# --- entries -------------------------------------------------------------------------------------

def entry_path(root: Path, key: str) -> Path:
    return root / key[:2] / (key + SUFFIX)


def _digest(head: bytes, obj: bytes) -> str:
    return hashlib.sha256(head + b"\0" + obj).hexdigest()


def encode_entry(header: dict, obj: bytes) -> bytes:
    """MAGIC, 4-byte header length, header JSON, object; the checksum covers header and object."""
    header = {k: v for k, v in header.items() if k != "sha256"}
    header["size"] = len(obj)
    body = json.dumps(header, sort_keys=True).encode()
    head = json.dumps(dict(header, sha256=_digest(body, obj)), sort_keys=True).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head + obj


def _split(data: bytes) -> tuple[dict, bytes]:
    if not data.startswith(MAGIC):
        raise ValueError("not a kwker cache entry")
    pos = len(MAGIC)
    n = int.from_bytes(data[pos:pos + 4], "little")
    try:
        header = json.loads(data[pos + 4:pos + 4 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("unreadable header (truncated or corrupted)") from None
    if not isinstance(header, dict):
        raise ValueError("unreadable header")
    return header, data[pos + 4 + n:]


def decode_entry(data: bytes) -> tuple[dict, bytes]:
    """Header and object bytes of an entry; ValueError if it is torn or tampered with."""
    header, obj = _split(data)
    body = json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True)
    if len(obj) != header.get("size") or _digest(body.encode(), obj) != header.get("sha256"):
        raise ValueError("checksum mismatch (truncated, corrupted or edited)")
    return header, obj


def read_header(path: Path) -> dict:
    """The header alone (no checksum: listing must not read every object)."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 4)
        n = int.from_bytes(start[len(MAGIC):], "little")
        return _split(start + f.read(n))[0]


_REASONS = ("target", "kwker", "llvm", "llvmlite")  # checked first: they explain a mismatch


def mismatch(header: dict, expect: dict) -> str | None:
    fields = [f for f in _REASONS if f in expect] + [f for f in expect if f not in _REASONS]
    for field in fields:
        got, want = header.get(field), expect[field]
        if got == want:
            continue
        if field == "target" and isinstance(got, dict) and isinstance(want, dict):
            return (f"built for a different target ({got.get('cpu')} {got.get('features')!r}, "
                    f"this machine: {want.get('cpu')} {want.get('features')!r})")
        return f"built for a different {field} ({got!r}, expected {want!r})"
    return None


def _remove_if_same(path: Path, st: os.stat_result) -> None:
    """Unlink ``path`` unless another process has already replaced it with a new entry."""
    with contextlib.suppress(OSError):
        now = os.lstat(path)
        if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            os.unlink(path)


def load(key: str, expect: dict) -> bytes | None:
    """Object bytes for ``key``, or None on a miss. Bad entries are logged once and removed."""
    root = cache_root()
    if root is None:
        return None
    path = entry_path(root, key)
    try:
        check_root(root)
        check_private(path.parent)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except UnusableCache as e:
        warn_once(f"kwker: {e}; compiling in memory", topic="root")
        return None
    except OSError as e:
        warn_once(f"kwker: cannot read the kernel cache at {path}: {e.strerror}; "
                  "compiling in memory", topic="read")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnusableCache(f"{path} is not a regular file; remove it")
        check_private(path, st)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except UnusableCache as e:
        warn_once(f"kwker: {e}")
        return None
    except OSError as e:
        warn_once(f"kwker: cannot read cache entry {path}: {e.strerror}; compiling in memory")
        return None
    finally:
        os.close(fd)
    try:
        header, obj = decode_entry(data)
        problem = mismatch(header, expect)
        if problem:
            raise ValueError(problem)
    except ValueError as e:
        warn_once(f"kwker: discarding bad cache entry {path}: {e}; it will be rebuilt")
        _remove_if_same(path, st)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # last use, for LRU eviction and `kwker-cache list`
    return obj


def _write(f, data: bytes) -> None:
    f.write(data)  # a seam for the tests that kill a writer half-way


def store(key: str, header: dict, obj: bytes) -> bool:
    """Write an entry atomically; any failure only costs the cache, never the caller."""
    root = cache_root()
    if root is None:
        return False
    try:
        ensure_dir(root)
        final = entry_path(root, key)
        final.parent.mkdir(exist_ok=True, mode=0o700)
        check_private(final.parent)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f"{TMP_PREFIX}{key}-", suffix=SUFFIX)
        try:
            data = encode_entry(dict(header, created=time.time()), obj)
            with os.fdopen(fd, "wb") as f:
                _write(f, data)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except UnusableCache as e:
        warn_once(f"kwker: {e}; compiling in memory", topic="root")
        return False
    except OSError as e:
        warn_once(f"kwker: cannot write to the kernel cache at {root}: {e.strerror}; "
                  "compiling in memory", topic="write")
        return False
    if os.environ.get("KWKER_DEBUG"):
        log.info("kwker: stored cache entry %s", key)
    _evict_when_full(root, final, len(data))
    return True


_sizes: dict[Path, list] = {}   # cache root -> [its bytes by this process's count, stores since]


def _evict_when_full(root: Path, stored: Path, size: int) -> None:
    """``evict`` after a store of ``size`` bytes, when the running count says the cache may be
    over its limit, or ``RESCAN_STORES`` stores after the last scan (the module's docstring)."""
    limit = max_bytes()
    if limit <= 0:
        return
    count = _sizes.get(root)
    if count is not None and count[1] < RESCAN_STORES and count[0] + size <= limit:
        count[0] += size
        count[1] += 1
        return
    _sizes[root] = [_evict(root, stored, limit)[1], 0]


# --- locking ---------------------------------------------------------------------------------

def lock_path(root: Path, key: str) -> Path:
    return root / LOCK_DIR / f"{key}.lock"


def try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # `kwker-cache clear` may have unlinked the file between our open and flock.
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except (BlockingIOError, FileNotFoundError):
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def key_lock(root: Path, key: str, timeout: float = LOCK_TIMEOUT) -> Iterator[bool]:
    """Hold the per-key lock (True), or go on without it (False) if it cannot be had."""
    path = lock_path(root, key)
    fd = None
    try:
        path.parent.mkdir(exist_ok=True, mode=0o700)
        deadline, delay = time.monotonic() + timeout, 0.002
        while (fd := try_lock(path)) is None and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if fd is None:
            warn_once(f"kwker: waited {timeout:.0f} s for another process to compile into "
                      f"{root}; compiling without waiting longer", topic="lock")
    except OSError:
        fd = None  # read-only cache: store() will say so
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def remove_temps(root: Path, key: str) -> None:
    """Leftovers of writers of ``key`` that died; call while holding the key's lock."""
    for tmp in entry_path(root, key).parent.glob(f"{TMP_PREFIX}{key}-*{SUFFIX}"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def get_or_build(key: str, expect: dict, header: dict,
                 build: Callable[[], bytes]) -> tuple[bytes, bool]:
    """(object bytes, loaded from cache?). Across processes one builds a key, the others wait
    for it and then load its entry."""
    obj = load(key, expect)
    if obj is not None:
        return obj, True
    root = cache_root()
    if root is None:
        return build(), False
    try:
        ensure_dir(root)
    except UnusableCache as e:
        warn_once(f"kwker: {e}; compiling in memory", topic="root")
        return build(), False
    with key_lock(root, key) as locked:
        if locked:
            obj = load(key, expect)
            if obj is not None:
                return obj, True
            remove_temps(root, key)
        obj = build()
        store(key, header, obj)
    return obj, False


# --- inventory and eviction ----------------------------------------------------------------------

@dataclass
class Entry:
    path: Path
    key: str
    size: int
    mtime: float  # last use


def iter_entries(root: Path) -> Iterator[Entry]:
    """Every entry file under ``root`` (temp files and locks excluded)."""
    try:
        subdirs = sorted(os.scandir(root), key=lambda d: d.name)
    except FileNotFoundError:
        return
    for sub in subdirs:
        if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
            continue
        for e in os.scandir(sub.path):
            if e.name.endswith(SUFFIX) and not e.name.startswith(TMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat(follow_symlinks=False)
                    yield Entry(Path(e.path), e.name[:-len(SUFFIX)], st.st_size, st.st_mtime)


def iter_temps(root: Path) -> Iterator[Path]:
    try:
        subdirs = [d for d in os.scandir(root) if len(d.name) == 2 and d.is_dir()]
    except FileNotFoundError:
        return
    for sub in subdirs:
        yield from (Path(e.path) for e in os.scandir(sub.path) if e.name.startswith(TMP_PREFIX))


def evict(root: Path, keep: Path | None = None, limit: int | None = None) -> list[Entry]:
    """Remove least recently used entries until the cache fits the size limit."""
    limit = max_bytes() if limit is None else limit
    return _evict(root, keep, limit)[0] if limit > 0 else []


def _evict(root: Path, keep: Path | None, limit: int) -> tuple[list[Entry], int]:
    """(the entries removed, the bytes left)."""
    entries = sorted(iter_entries(root), key=lambda e: e.mtime)
    total = sum(e.size for e in entries)
    removed = []
    for e in entries:
        if total <= limit:
            break
        if e.path == keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            e.path.unlink()
            removed.append(e)
        total -= e.size
    if removed and os.environ.get("KWKER_DEBUG"):
        log.info("kwker: evicted %d cache entries to stay under %d bytes", len(removed), limit)
    return removed, total


def probe_writable(root: Path, nbytes: int = 64 << 10) -> None:
    """Raise UnusableCache unless an entry-sized file can be written into ``root``."""
    try:
        with tempfile.NamedTemporaryFile(dir=root, prefix=TMP_PREFIX + "probe-") as f:
            _write(f, b"\0" * nbytes)
            f.flush()
    except OSError as e:
        what = {errno.EROFS: "is read-only", errno.ENOSPC: "is on a full disk",
                errno.EDQUOT: "is over its disk quota"}.get(e.errno, f"is not writable "
                                                                    f"({e.strerror})")
        raise UnusableCache(f"cache directory {root} {what}; new kernels are compiled in "
                            "memory on every run") from None
