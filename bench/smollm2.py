"""SmolLM2-135M-Instruct as a plain Hugging Face directory: :mod:`fulmen.pretrained` makes it (``--model smollm2``);
the benchmarks import it from here, and ``python bench/smollm2.py`` makes it and prints its path."""

from __future__ import annotations

import sys

from fulmen.pretrained import SMOLLM2_DIR, convert_gguf, ensure_smollm2, main

__all__ = ["SMOLLM2_DIR", "convert_gguf", "ensure_smollm2"]

if __name__ == "__main__":
    sys.exit(main())
