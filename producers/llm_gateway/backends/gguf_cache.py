"""GGUF files of the checkpoints the llamacpp backend serves, converted once and kept while they are served.

A file is named by the checkpoint's identity: the directory's path, each weight file's size and modification time,
the tensor type and, for a LoRA version, the same of the adapter. The same checkpoint is converted once (also when
two replicas ask at once); a checkpoint rewritten in place is a new file. Files are counted in use
(:meth:`GgufCache.acquire` / :meth:`GgufCache.release`); one no longer used by any server of this process is
deleted (a running server keeps its memory-mapped copy until it exits).

A LoRA version (a PEFT adapter directory) is merged into its base with peft and written as full weights:
llama-server loads LoRA adapters only at start-up, so a new adapter needs a new server either way, and a merged
model runs at the speed of the base.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from pathlib import Path

from fulmen.producers.llm_gateway.backends.gguf_export import export_gguf
from fulmen.producers.llm_gateway.backends.tokenizing import no_progress_bars
from fulmen.schemas.errors import ConfigurationError

__all__ = ["GgufCache"]

log = logging.getLogger(__name__)

_LOADING = threading.Lock()  # one model loaded at a time by this module


class GgufCache:
    """Converted checkpoints under ``root`` (see the module docstring). Thread-safe: conversions run on threads."""

    def __init__(self, root: Path, tensor_type: str) -> None:
        self.root = root
        self.tensor_type = tensor_type
        self._lock = threading.Lock()
        self._converting: dict[Path, threading.Lock] = {}
        self._users: Counter[Path] = Counter()

    def path_for(self, checkpoint: Path, adapter: Path | None = None) -> Path:
        """Where the GGUF of ``checkpoint`` (with ``adapter`` merged in) is kept."""
        digest = hashlib.sha256(self.tensor_type.encode())
        for directory in (checkpoint, adapter):
            if directory is not None:
                digest.update(_identity(directory).encode())
        name = (adapter or checkpoint).name or "model"
        return self.root / f"{name}-{digest.hexdigest()[:16]}-{self.tensor_type}.gguf"

    def acquire(self, checkpoint: Path, adapter: Path | None = None) -> Path:
        """The GGUF of ``checkpoint`` (+ ``adapter``), converted if needed, counted in use until :meth:`release`.
        :class:`ConfigurationError` when it cannot be converted. Blocking: call it on a thread."""
        for directory in (checkpoint, adapter):
            if directory is not None and not directory.is_dir():
                raise ConfigurationError(
                    f"model directory {directory} does not exist (FULMEN_LLM_MODEL or a ModelVersion uri)"
                )
        target = self.path_for(checkpoint, adapter)
        with self._lock:
            self._users[target] += 1
            converting = self._converting.setdefault(target, threading.Lock())
        try:
            with converting:
                if not target.is_file():
                    self._convert(checkpoint, adapter, target)
        except BaseException:
            self.release(target)
            raise
        return target

    def release(self, path: Path) -> None:
        """One user fewer; the file is deleted when none is left."""
        with self._lock:
            self._users[path] -= 1
            if self._users[path] > 0:
                return
            del self._users[path]
            self._converting.pop(path, None)
        path.unlink(missing_ok=True)
        log.debug("deleted %s (no server of this process serves it any more)", path)

    def _convert(self, checkpoint: Path, adapter: Path | None, target: Path) -> None:
        if adapter is None:
            export_gguf(checkpoint, target, self.tensor_type)
            return
        export_gguf(checkpoint, target, self.tensor_type, weights=_merged(checkpoint, adapter))


def _identity(directory: Path) -> str:
    """The directory's resolved path and each weight file's name, size and modification time."""
    parts = [str(directory.resolve())]
    for path in sorted(directory.glob("*.safetensors")):
        stat = path.stat()
        parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\n".join(parts)


def _merged(base: Path, adapter: Path) -> dict:
    """The state dict of ``base`` with the PEFT adapter merged in (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with _LOADING, no_progress_bars():  # from_pretrained is not thread-safe (see transformers_backend._LOADING)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return merged.state_dict()
