"""Builds llama.cpp's ``llama-server`` for this CPU, once, into ``~/.cache/fulmen/llama.cpp`` (``make install``).

No binary of llama.cpp can be downloaded here (the package registries are reachable, nothing else), so the server
is built from the llama.cpp sources vendored in the PyPI sdist of llama-cpp-python (:data:`VERSION`):
``pip download --no-binary :all:``, unpack, patch (:data:`PATCHES`), ``cmake`` (Release, ``GGML_NATIVE``: the
instructions of this CPU; static; no tests, examples, web UI, curl or OpenSSL), build the ``llama-server`` target
(about 6 minutes on 2 cores). Everything happens in a temporary folder beside the cache, and the finished folder is
renamed into place, so a reader never sees half a build and a second run finds it and does nothing.

The folder is named ``<VERSION>-<hash>``: the hash covers the CPU's flags (a ``GGML_NATIVE`` build may use
instructions another CPU lacks) and the patches (a changed patch is a different binary).

The patches make llama.cpp report a probability for every token it samples, which the gateway records beside the
token ids: llama-server leaves out the token whose text ends inside a multi-byte UTF-8 character, and for a stop
string drops as many trailing probabilities as the stop string has tokens, so its ``completion_probabilities``
would no longer line up with its ``tokens``.

    python -m fulmen.producers.llm_gateway.backends.llamacpp_build          # build if needed, print the path

Without cmake or a C++ compiler it prints a note and exits with :data:`EXIT_SKIPPED` (``make install`` goes on);
the llamacpp backend then refuses to start, saying how to build it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fulmen.schemas.errors import ConfigurationError

__all__ = ["EXIT_SKIPPED", "PATCHES", "VERSION", "BuildError", "build", "cached_server", "find_server"]

VERSION = "0.3.36"  # llama-cpp-python's sdist: llama.cpp of October 2026 (ggml 0.25.3)
CACHE = Path.home() / ".cache" / "fulmen" / "llama.cpp"
EXIT_SKIPPED = 3  # no toolchain, or the build failed: nothing was installed
log = logging.getLogger(__name__)

_SOURCES = f"llama_cpp_python-{VERSION}/vendor/llama.cpp"
_CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)


class BuildError(ConfigurationError):
    """llama-server could not be built (no toolchain, no sdist, a failed compile): what happened and what to do."""


@dataclass(frozen=True)
class SourcePatch:
    """Replace ``old`` (which must occur exactly once in ``path``) by ``new``."""

    path: str  # relative to the llama.cpp sources
    old: str
    new: str
    why: str


_SERVER = "tools/server/server-context.cpp"
PATCHES = (
    SourcePatch(
        _SERVER,
        "            slot.add_token(result);\n            if (slot.task->params.stream) {",
        "            if (slot.task->params.stream) {",
        "(moved below) a token whose text ends inside a UTF-8 character was left out of the probabilities",
    ),
    SourcePatch(
        _SERVER,
        "        if (incomplete) {\n            slot.has_next_token = true;\n        }",
        "        slot.add_token(result);  // fulmen: every sampled token's probabilities, in order\n\n"
        "        if (incomplete) {\n            slot.has_next_token = true;\n        }",
        "every sampled token gets its probabilities, also one that ends inside a UTF-8 character",
    ),
    SourcePatch(
        _SERVER,
        "if (!slot.task->params.stream && slot.stop == STOP_TYPE_WORD) {",
        "if (false && slot.stop == STOP_TYPE_WORD) {  // fulmen: keep the stop string's tokens' probabilities",
        "the tokens of a stop string are reported (they were sampled): their probabilities too",
    ),
)


def build_id() -> str:
    """``<VERSION>-<hash of the CPU's flags and the patches>``: the cache folder of this machine's build."""
    digest = hashlib.sha256(_cpu_flags().encode())
    for patch in PATCHES:
        digest.update(f"\0{patch.path}\0{patch.old}\0{patch.new}".encode())
    return f"{VERSION}-{digest.hexdigest()[:12]}"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo), else what the platform says of the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cached_server(cache: Path = CACHE) -> Path:
    """Where this machine's ``llama-server`` is (or would be) built."""
    return cache / build_id() / "llama-server"


def find_server(override: str = "", cache: Path = CACHE) -> Path:
    """The ``llama-server`` to run: ``override`` (``FULMEN_LLM_LLAMACPP_SERVER``) or the cached build.
    Raises :class:`~fulmen.schemas.errors.ConfigurationError` saying how to get one when there is none."""
    if override:
        path = Path(override).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigurationError(f"FULMEN_LLM_LLAMACPP_SERVER={override!r} is not an executable file")
        return path
    path = cached_server(cache)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ConfigurationError(
            f"the llamacpp backend needs llama-server, which is not built for this CPU (no {path}): run `make "
            "install` or `python -m fulmen.producers.llm_gateway.backends.llamacpp_build` (needs cmake and a C++ "
            "compiler; about 6 minutes on 2 cores), or set FULMEN_LLM_LLAMACPP_SERVER to a llama-server built "
            "with that module's patches"
        )
    return path


def build(cache: Path = CACHE, say: Callable[[str], None] = log.info) -> Path:
    """The cached ``llama-server``, built first if missing (see the module docstring); :class:`BuildError` when it
    cannot be built. ``say`` prints progress."""
    target = cached_server(cache)
    if target.is_file():
        say(f"llama-server is built: {target}")
        return target
    missing = [tool for tool in ("cmake", "c++", "cc") if shutil.which(tool) is None]
    if missing:
        raise BuildError(
            f"cannot build llama-server: {', '.join(missing)} not found (Debian: apt-get install cmake "
            "g++); the llamacpp backend is unavailable until it is built"
        )
    cache.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    try:
        sources = _fetch_sources(staging, say)
        for patch in PATCHES:
            _apply(sources, patch)
        binary = _compile(sources, staging / "build", say)
        installed = staging / "install"
        installed.mkdir()
        shutil.copy2(binary, installed / "llama-server")
        _check_runs(installed / "llama-server")
        try:
            os.rename(installed, target.parent)
        except OSError:  # another build finished first: use it
            if not target.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"built llama-server in {time.perf_counter() - started:.0f} s: {target}")
    return target


def _fetch_sources(staging: Path, say: Callable[[str], None]) -> Path:
    say(f"downloading the llama-cpp-python {VERSION} sdist (llama.cpp's sources) from PyPI...")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"llama-cpp-python=={VERSION}",
        "-d",
        str(staging),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    archives = sorted(staging.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if done.returncode != 0 or not archives:
        raise BuildError(
            f"pip download llama-cpp-python=={VERSION} failed (exit {done.returncode}): {done.stderr.strip()[-800:]}"
        )
    with tarfile.open(archives[0]) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(_SOURCES + "/")]
        archive.extractall(staging, members=members, filter="data")
    sources = staging / _SOURCES
    if not (sources / "CMakeLists.txt").is_file():
        raise BuildError(f"the llama-cpp-python {VERSION} sdist holds no {_SOURCES}/CMakeLists.txt")
    return sources


def _apply(sources: Path, patch: SourcePatch) -> None:
    path = sources / patch.path
    text = path.read_text(encoding="utf-8")
    count = text.count(patch.old)
    if count != 1:
        raise BuildError(
            f"the patch to {patch.path} ({patch.why}) expects its text once and found it {count} "
            f"times: the sources are not llama-cpp-python {VERSION}'s"
        )
    path.write_text(text.replace(patch.old, patch.new), encoding="utf-8")


def _compile(sources: Path, build_dir: Path, say: Callable[[str], None]) -> Path:
    jobs = str(os.cpu_count() or 2)
    log_path = build_dir.parent / "build.log"
    steps = [
        ["cmake", "-S", str(sources), "-B", str(build_dir), *_CMAKE_OPTIONS],
        ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs],
    ]
    say(f"building llama-server with cmake on {jobs} cores (about 12 core-minutes)...")
    with log_path.open("w") as log:
        for command in steps:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=7200)
            if done.returncode != 0:
                tail = log_path.read_text(errors="replace").splitlines()[-30:]
                raise BuildError(f"{' '.join(command[:2])} failed (exit {done.returncode}):\n" + "\n".join(tail))
    binary = build_dir / "bin" / "llama-server"
    if not binary.is_file():
        raise BuildError(f"the build finished without {binary}")
    return binary


def _check_runs(binary: Path) -> None:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise BuildError(f"the built {binary.name} does not run (exit {done.returncode}): {done.stderr[-500:]}")


def main() -> int:
    """Build if needed; exit 0 with the binary there, :data:`EXIT_SKIPPED` with a note when it cannot be built."""
    try:
        build(CACHE, say=lambda line: print(line, file=sys.stderr, flush=True))
    except BuildError as exc:
        print(f"note: {exc.message}", file=sys.stderr)
        return EXIT_SKIPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
