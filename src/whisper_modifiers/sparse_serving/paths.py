"""Where the package keeps what it makes once and reuses (torch only)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$WHISPER_MODIFIERS_CACHE``, else ``~/.cache/whisper_modifiers``."""
    default = Path.home() / ".cache" / "whisper_modifiers"
    return Path(os.environ.get("WHISPER_MODIFIERS_CACHE", default))
