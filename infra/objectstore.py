"""Checkpoints in an S3-compatible object store: a directory uploaded to ``s3://bucket/prefix``, and fetched back
into a local cache on a machine that does not share the trainer's disk.

Layout: each file of the directory is one object under the prefix (``prefix/<relative path>``), and
``prefix/fulmen-manifest.json`` (:data:`MANIFEST`: each file's size and SHA-256) is written last. The manifest
is what makes a checkpoint exist: a reader that finds none (an upload cut short by a crash) sees no checkpoint;
one that finds it checks every file it downloads against it, so a half-written or replaced object is never
served. A fetch downloads into ``<cache>/.tmp-<pid>-<name>`` and renames it into place only when every file
matched: a cached directory with its manifest is complete, and is reused by later fetches of the same URI.

The client is obstore (Rust's object_store): it reads the credentials, region and endpoint from the environment
variables the AWS tools read (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
``AWS_ENDPOINT_URL``; ``AWS_ALLOW_HTTP=true`` for an endpoint without TLS, such as a SeaweedFS or MinIO on the
local network), uploads large files in concurrent multipart parts and streams downloads
(``bench/checkpoint_store.py`` measured it beside boto3).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from fulmen.schemas.errors import ConfigurationError, RetryableError

__all__ = [
    "MANIFEST",
    "CheckpointUnavailableError",
    "ObjectUri",
    "delete_checkpoint",
    "download_dir",
    "file_sha256",
    "is_object_uri",
    "join_uri",
    "list_checkpoints",
    "read_manifest",
    "upload_dir",
]

log = logging.getLogger(__name__)

MANIFEST = "fulmen-manifest.json"
SCHEMES = ("s3://",)
_CHUNK = 8 * 1024 * 1024
_VERSION = re.compile(r"v(\d+)")


class CheckpointUnavailableError(RetryableError):
    """The object store has no complete checkpoint at this URI (yet): no manifest, or a file that does not match
    it."""


@dataclass(frozen=True)
class ObjectUri:
    """``s3://bucket/prefix`` split: the bucket's URL and the key prefix (no leading or trailing slash)."""

    bucket_url: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> ObjectUri:
        scheme = next((s for s in SCHEMES if uri.startswith(s)), None)
        bucket, _, prefix = uri[len(scheme) :].partition("/") if scheme else ("", "", "")
        if not bucket or ".." in PurePosixPath(prefix).parts:
            raise ConfigurationError(f"{uri!r} is not an object-store URI: write s3://bucket/prefix")
        return cls(f"{scheme}{bucket}", prefix.strip("/"))

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def __str__(self) -> str:
        return f"{self.bucket_url}/{self.prefix}" if self.prefix else self.bucket_url


def is_object_uri(uri: str) -> bool:
    """Whether ``uri`` names an object store (``s3://``) rather than a local path."""
    return uri.startswith(SCHEMES)


def join_uri(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended, one slash between each (a local path stays a path)."""
    if not is_object_uri(uri):
        return str(Path(uri, *parts))
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


@functools.cache
def _store(bucket_url: str) -> Any:
    from obstore.store import S3Store

    return S3Store.from_url(bucket_url)


def upload_dir(local: Path, uri: str, only: Callable[[str], bool] = lambda relative: True) -> str:
    """Upload every file under ``local`` (whose relative path ``only`` accepts) to ``uri``, the manifest last;
    returns ``uri``. An upload that fails midway leaves no manifest (so no checkpoint) and raises; uploading
    again overwrites."""
    import obstore

    target = ObjectUri.parse(uri)
    store = _store(target.bucket_url)
    started, files = time.monotonic(), {}
    for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
        relative = path.relative_to(local).as_posix()
        if relative == MANIFEST or not only(relative):  # a fetched checkpoint's own manifest is not a file of it
            continue
        files[relative] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
        obstore.put(store, target.key(relative), path)
    manifest = {"files": files, "uploaded_at": time.time()}
    obstore.put(store, target.key(MANIFEST), json.dumps(manifest, indent=1).encode())
    size = sum(f["size"] for f in files.values())
    took = time.monotonic() - started
    log.info("uploaded %s to %s: %d files, %.1f MB in %.1fs", local, uri, len(files), size / 1e6, took)
    return uri


def read_manifest(uri: str) -> dict[str, Any] | None:
    """The checkpoint's manifest at ``uri``; None when there is none (nothing there, or an unfinished upload)."""
    import obstore
    from obstore.exceptions import NotFoundError

    target = ObjectUri.parse(uri)
    try:
        raw = obstore.get(_store(target.bucket_url), target.key(MANIFEST)).bytes()
    except (FileNotFoundError, NotFoundError):
        return None
    manifest = json.loads(bytes(raw))
    for relative in manifest.get("files", {}):
        parts = PurePosixPath(relative).parts
        if PurePosixPath(relative).is_absolute() or ".." in parts or relative == MANIFEST:
            raise CheckpointUnavailableError(f"{uri}: the manifest names {relative!r}, outside the checkpoint")
    return manifest


def download_dir(uri: str, cache: Path) -> Path:
    """The checkpoint at ``uri`` as a local directory under ``cache`` (downloaded and checked the first time,
    then reused). CheckpointUnavailableError when it has no manifest or a file does not match it."""
    import obstore

    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    name = f"{PurePosixPath(ObjectUri.parse(uri).prefix).name or 'root'}-{digest}"
    target = Path(cache) / name
    if (target / MANIFEST).is_file():
        return target
    manifest = read_manifest(uri)
    if manifest is None:
        raise CheckpointUnavailableError(f"no checkpoint at {uri}: no {MANIFEST} (never uploaded, or unfinished)")
    source = ObjectUri.parse(uri)
    store = _store(source.bucket_url)
    partial = Path(cache) / f".tmp-{os.getpid()}-{name}"
    shutil.rmtree(partial, ignore_errors=True)
    started = time.monotonic()
    try:
        for relative, expected in manifest["files"].items():
            path = partial / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            _download(obstore.get(store, source.key(relative)), path, expected, f"{uri}/{relative}")
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            partial.rename(target)
        except OSError:  # another process of this machine fetched it first
            if not (target / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("fetched %s into %s in %.1fs", uri, target, time.monotonic() - started)
    return target


def delete_checkpoint(uri: str) -> None:
    """Remove the checkpoint at ``uri``: its manifest first (from then on it does not exist), then its files."""
    import obstore

    manifest = read_manifest(uri)
    if manifest is None:
        return
    target = ObjectUri.parse(uri)
    store = _store(target.bucket_url)
    obstore.delete(store, target.key(MANIFEST))
    obstore.delete(store, [target.key(relative) for relative in manifest["files"]])


def list_checkpoints(uri: str) -> dict[int, str]:
    """The complete checkpoints directly under ``uri`` named ``v<N>`` (version -> URI), as a resume finds them."""
    import obstore

    base = ObjectUri.parse(uri)
    listed = obstore.list_with_delimiter(_store(base.bucket_url), f"{base.prefix}/" if base.prefix else None)
    found = {}
    for prefix in listed["common_prefixes"]:
        name = PurePosixPath(prefix).name
        if (match := _VERSION.fullmatch(name)) and read_manifest(join_uri(uri, name)) is not None:
            found[int(match.group(1))] = join_uri(uri, name)
    return dict(sorted(found.items()))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _download(result: Any, path: Path, expected: dict[str, Any], shown: str) -> None:
    digest, size = hashlib.sha256(), 0
    with path.open("wb") as out:
        for chunk in result.stream(min_chunk_size=_CHUNK):
            data = memoryview(chunk)
            digest.update(data)
            out.write(data)
            size += len(data)
    if size != expected["size"] or digest.hexdigest() != expected["sha256"]:
        raise CheckpointUnavailableError(
            f"{shown} does not match the checkpoint's manifest ({size} bytes, sha256 {digest.hexdigest()[:12]}; "
            f"expected {expected['size']}, {expected['sha256'][:12]}): it changed after the manifest was written"
        )
