"""Where files live: a local path or a bucket URL (gs://), behind one small set of calls.

Every file a run reads or writes goes through here or through Orbax (`orbax_path`), so no
caller tests for a scheme. The two kinds differ in what they promise, and the calls keep
each promise on both:
- A write is whole or absent. Locally: a temporary file, fsync, `os.replace`. A bucket has no
  rename and no append, but an object appears only when its upload ends: one upload.
- Readers of a bucket see what was uploaded, never a half-written file: a directory (a
  replay checkpoint) is uploaded file by file with its completion marker last.
- Only local files are read by libraries that cannot reach buckets (transformers, pyarrow,
  numpy): `staged` copies a bucket file or directory into a local cache first.

gcsfs (a requirement of the default tier) is imported on the first URL, so installs with
`--no-deps` that never name a bucket run without it. Credentials are Google's defaults
(a TPU VM's service account); with `STORAGE_EMULATOR_HOST` set, an emulator's, anonymously.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

SUPPORTED_SCHEMES = ("gs",)
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


class StorageError(ValueError):
    """A path or bucket that cannot be used; the one-line message names it."""


def is_url(path: str | os.PathLike) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None


def check(path: str | os.PathLike, key: str) -> None:
    """Raises `StorageError` naming config key `key` when `path` is a URL this layer cannot use."""
    if not is_url(path):
        return
    scheme = _URL.match(path).group(1)
    if scheme not in SUPPORTED_SCHEMES:
        raise StorageError(f"{key}: {path!r}: only local paths and {', '.join(s + '://' for s in SUPPORTED_SCHEMES)} "
                           "URLs are supported")
    if not re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,221}(/|$)", path):
        raise StorageError(f"{key}: {path!r} does not name a bucket (gs://BUCKET/PATH)")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        raise StorageError(f"{key}: {path!r} needs gcsfs, a requirement of the default install: "
                           "pip install gcsfs") from None


def join(base: str | os.PathLike, *parts: str) -> str:
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(base, *parts)


def _bucket_path(url: str) -> str:
    """gs://bucket/a/b -> bucket/a/b, as gcsfs names objects."""
    return url.split("://", 1)[1].rstrip("/")


@functools.lru_cache(maxsize=None)
def _gcs():
    """One gcsfs filesystem per process (it caches listings: `_fresh` drops them before reads that must see others' writes)."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else every call probes for 60 s off GCP
    import gcsfs
    emulated = bool(os.environ.get("STORAGE_EMULATOR_HOST"))
    return gcsfs.GCSFileSystem(token="anon" if emulated else None, default_location=None)


def _fs(path: str):
    fs = _gcs()
    fs.invalidate_cache(_bucket_path(path))
    return fs


def exists(path: str | os.PathLike) -> bool:
    if is_url(path):
        return _fs(path).exists(_bucket_path(path))
    return os.path.exists(path)


def isdir(path: str | os.PathLike) -> bool:
    if is_url(path):
        return _fs(path).isdir(_bucket_path(path))
    return os.path.isdir(path)


def listdir(path: str | os.PathLike) -> list[str]:
    """The names directly under `path` ([] where there is nothing)."""
    if is_url(path):
        fs, prefix = _fs(path), _bucket_path(path)
        try:
            return sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(prefix, detail=False) if entry.rstrip("/") != prefix)
        except FileNotFoundError:
            return []
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def read_bytes(path: str | os.PathLike) -> bytes:
    """Raises FileNotFoundError where there is no such file."""
    if is_url(path):
        return _fs(path).cat_file(_bucket_path(path))
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode()


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`path` holds `data` or, after a kill at any moment, what it held before."""
    if is_url(path):
        _fs(path).pipe_file(_bucket_path(path), data)
        return
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())


def makedirs(path: str | os.PathLike) -> None:
    """A local directory (a bucket has no directories: a prefix exists once an object is under it)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def remove(path: str | os.PathLike) -> None:
    """Deletes a file; nothing where there is none."""
    try:
        if is_url(path):
            _fs(path).rm_file(_bucket_path(path))
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def rmtree(path: str | os.PathLike) -> None:
    """Deletes a directory and all under it; nothing where there is none."""
    if is_url(path):
        fs = _fs(path)
        try:
            fs.rm(_bucket_path(path), recursive=True)
        except FileNotFoundError:
            pass
        return
    shutil.rmtree(path, ignore_errors=True)


def move(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Moves a directory (or a file) to `target`, which must not exist yet: a rename on a disk; in a
    bucket (no rename), a copy of every object, then the deletion of the originals."""
    if not is_url(source):
        os.makedirs(os.path.dirname(os.fspath(target)) or ".", exist_ok=True)
        os.replace(source, target)
        return
    fs, prefix = _fs(source), _bucket_path(source)
    names = [prefix] if fs.isfile(prefix) else [n for n in fs.find(prefix) if not n.endswith("/")]
    for name in names:
        fs.copy(name, _bucket_path(target) + name[len(prefix):])
    rmtree(source)
    for other in list(getattr(type(fs), "_cache", {}).values()):  # Orbax's own gcsfs (through etils) lists too
        other.invalidate_cache(prefix)


def upload(local: str | os.PathLike, url: str, *, last: Iterable[str] = ()) -> None:
    """Copies a local file, or a directory's files, to `url`. Files named in `last` (a directory's
    completion marker) go after all others, so a reader that sees the marker sees every file."""
    local = Path(local)
    if local.is_file():
        _fs(url).put_file(str(local), _bucket_path(url))
        return
    files = sorted(p for p in local.rglob("*") if p.is_file())
    tail = [p for p in files if p.name in set(last)]
    for file in [p for p in files if p not in tail] + tail:
        _fs(url).put_file(str(file), _bucket_path(join(url, file.relative_to(local).as_posix())))


def download(url: str, local: str | os.PathLike) -> None:
    """Copies a bucket file, or everything under a prefix, to `local` (FileNotFoundError if none)."""
    fs, source = _fs(url), _bucket_path(url)
    local = Path(local)
    if fs.isfile(source):
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(source, str(local))
        return
    names = [n for n in fs.find(source) if not n.endswith("/")]
    if not names:
        raise FileNotFoundError(url)
    for name in names:
        target = local / name[len(source):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(name, str(target))


def cache_root() -> Path:
    """Where bucket files are staged for local readers: $JAXREPLAY_CACHE, else ~/.cache/jaxreplay."""
    return Path(os.environ.get("JAXREPLAY_CACHE") or Path.home() / ".cache" / "jaxreplay")


def staged(path: str | os.PathLike) -> Path:
    """A local path holding what `path` holds: `path` itself when local, else a copy in the cache,
    fetched again when the bucket's objects changed (their generations are the cache key)."""
    if not is_url(path):
        return Path(path)
    fs, source = _fs(path), _bucket_path(path)
    if fs.isfile(source):
        listing = {source: fs.info(source)}
    else:
        listing = {name: fs.info(name) for name in fs.find(source) if not name.endswith("/")}
        if not listing:
            raise FileNotFoundError(path)
    key = json.dumps(sorted((name, str(info.get("generation", "")), info.get("size")) for name, info in listing.items()))
    digest = hashlib.sha256(f"{path}\n{key}".encode()).hexdigest()[:20]
    target = cache_root() / "staged" / digest / source.rsplit("/", 1)[-1]
    if not (target.parent / ".complete").exists():
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_made(cache_root() / "staged")))
        try:
            download(str(path), staging / target.name)
            shutil.rmtree(target.parent, ignore_errors=True)
            (staging / ".complete").touch()
            os.replace(staging, target.parent)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def staged_files(path: str | os.PathLike, names: Iterable[str]) -> Path:
    """A local directory holding the named files of directory `path` (those that exist): `path`
    itself when local, else a fresh copy in the cache named like it (a bucket run dir's records,
    without its checkpoints)."""
    if not is_url(path):
        return Path(path)
    url = str(path).rstrip("/")
    target = cache_root() / "runs" / hashlib.sha256(url.encode()).hexdigest()[:20] / url.rsplit("/", 1)[-1]
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in names:
        try:
            download(join(url, name), target / name)
        except FileNotFoundError:
            pass
    return target


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def orbax_path(path: str | os.PathLike) -> Any:
    """The path Orbax takes: an absolute local path, or the URL as etils.epath (Orbax's own path type)."""
    if is_url(path):
        from etils import epath
        return epath.Path(str(path))
    return Path(path).absolute()


# -- objects written only if absent or unchanged (the run dir lease) -----------------------------

def _blob(url: str, *, fetch: bool = False):
    """The object `url` names; with `fetch`, with its metadata read (None where there is no such object)."""
    from google.cloud import storage
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials
        client = storage.Client(project="emulator", credentials=AnonymousCredentials())
    else:
        client = storage.Client()
    bucket, _, name = _bucket_path(url).partition("/")
    return client.bucket(bucket).get_blob(name) if fetch else client.bucket(bucket).blob(name)


def read_versioned(url: str) -> Optional[tuple[bytes, int, float]]:
    """(data, generation, updated as Unix time) of a bucket object, or None where there is none."""
    from google.api_core.exceptions import NotFound
    blob = _blob(url, fetch=True)
    if blob is None:
        return None
    generation, updated = int(blob.generation), blob.updated.timestamp()
    try:
        data = blob.download_as_bytes()
    except NotFound:
        return None
    return data, generation, updated


def write_if_generation(url: str, data: bytes, generation: int) -> bool:
    """Writes `url` only if its generation is `generation` (0: only if absent); False if it was not.
    GCS checks the precondition atomically (an emulator may not)."""
    from google.api_core.exceptions import PreconditionFailed
    try:
        _blob(url).upload_from_string(data, if_generation_match=generation)
    except PreconditionFailed:
        return False
    return True


def delete_if_generation(url: str, generation: int) -> bool:
    from google.api_core.exceptions import NotFound, PreconditionFailed
    try:
        _blob(url).delete(if_generation_match=generation)
    except (PreconditionFailed, NotFound):
        return False
    return True
