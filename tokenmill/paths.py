"""Where tokenmill keeps what it builds once: converted models and compiled CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Model cache directory: $TOKENMILL_CACHE, else $HF_HOME/tokenmill, else ~/.cache/tokenmill."""
    if os.environ.get("TOKENMILL_CACHE"):
        return Path(os.environ["TOKENMILL_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "tokenmill"
    return Path.home() / ".cache" / "tokenmill"
