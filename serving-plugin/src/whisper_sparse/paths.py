"""Where the package keeps what it makes once and reuses (torch only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["cache_dir", "write_json_atomically"]


def cache_dir() -> Path:
    """``$WHISPER_MODIFIERS_CACHE``, else ``~/.cache/whisper_modifiers``."""
    default = Path.home() / ".cache" / "whisper_modifiers"
    return Path(os.environ.get("WHISPER_MODIFIERS_CACHE", default))


def write_json_atomically(path: Path, value) -> None:
    """``value`` as JSON at ``path``, written beside it and renamed into place (processes
    that read the cache meanwhile see the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(value, indent=1))
    os.replace(partial, path)
