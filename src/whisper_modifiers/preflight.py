"""Checks the command-line tools run before loading any weights.

Everything a user can get wrong on the command line is found here, in seconds, and
reported as ``UsageError`` naming the flag: numbers below their minimum, texts that are
missing, binary, empty or too short (measured with the tokenizer, which loads before the
weights), a model whose ``config.json`` does not parse, sequence lengths past the model's
positions, and recipe patterns that match no module (resolved on a meta-device model
built from the config: names and types, no weights).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from whisper_sparse.format.checkpoint import read_config

__all__ = [
    "MINIMUMS",
    "UsageError",
    "calibration_sequences",
    "check_batch_size",
    "check_minimum",
    "check_offload_device",
    "check_positions",
    "linear_names",
    "meta_model",
    "model_config",
    "read_text",
    "same_file",
    "summarize_names",
]


class UsageError(Exception):
    """Bad command-line input, reported before any work is done (exit code 2)."""


def check_minimum(flag: str, value: int | float, minimum: int | float, meaning: str = "") -> None:
    """``value`` of ``flag`` is at least ``minimum``."""
    if value < minimum:
        why = f" ({meaning})" if meaning else ""
        raise UsageError(f"{flag} must be at least {minimum}{why}; got {value}")


def model_config(model_id: str):
    """The model's ``PretrainedConfig``: a local ``config.json`` that does not parse is
    named; a hub id is looked up (the config only, not the weights)."""
    from transformers import AutoConfig

    path = Path(model_id)
    if path.is_dir():
        try:
            read_config(path)
        except (FileNotFoundError, ValueError) as error:
            raise UsageError(f"--model {model_id}: {error}") from error
    try:
        return AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--model {model_id}: its config cannot be read: {error}") from error


def check_prunable(model_id: str, config) -> bool:
    """Whether ``--model`` is a compressed 2:4 checkpoint of this package without
    quantization: whisper-prune then loads it through its dense layout (a temporary copy,
    since llmcompressor refuses a model whose config.json names another quantization
    method). A quantized checkpoint is refused: its weights are not full precision."""
    from whisper_sparse.format.declaration import is_compressed_checkpoint

    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return False
    quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
    if is_compressed_checkpoint({"quantization_config": quantization}) and not quantization.get(
        "quantization_config"
    ):
        return True
    method = quantization.get("quant_method")
    raise UsageError(
        f"--model {model_id} holds quantized weights ({method}); whisper-prune prunes "
        "full-precision models: give it the model this checkpoint was made from"
    )


def check_positions(config, **lengths: int) -> None:
    """Every ``flag=length`` fits the model's ``max_position_embeddings``.

    An error, not a warning: positions the model was never trained on give activations
    it never produces in use (calibration statistics of the wrong distribution) and
    meaningless perplexity, and models with learned position embeddings fail outright.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if not limit:
        return
    for flag, length in lengths.items():
        if length > limit:
            raise UsageError(
                f"{flag} {length} exceeds the model's max_position_embeddings ({limit}): "
                f"positions past it are outside what the model was trained on; use at "
                f"most {limit}"
            )


def read_text(flag: str, source: str, reader) -> str:
    """``reader(source)`` (``data.load_corpus`` or ``evaluation.evaluation_text``), with
    every failure reported as a ``UsageError`` naming ``flag``."""
    try:
        text = reader(source)
    except UnicodeDecodeError as error:
        raise UsageError(
            f"{flag} {source}: not UTF-8 text (a binary file?): {error.reason} at byte "
            f"{error.start}"
        ) from error
    except FileNotFoundError as error:
        raise UsageError(f"{flag}: {error}") from error
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise UsageError(f"{flag} {source!r} cannot be read: {error}") from error
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"{flag} {source!r} holds no text")
    return text


def calibration_sequences(
    tokenizer, text: str, source: str, num_sequences: int, seq_len: int, seed: int
) -> list[list[int]]:
    """``data.sample_sequences`` of the tokenized ``--calibration`` text (tokenized once,
    before the weights load); a text too short for one window names the flag."""
    from whisper_modifiers.data import sample_sequences

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        return sample_sequences(ids, num_sequences, seq_len, seed)
    except ValueError as error:
        raise UsageError(f"--calibration {source!r} (--seq-len {seq_len}): {error}") from error


def meta_model(config) -> torch.nn.Module:
    """The model of ``config`` on the meta device: its modules, names and shapes, with no
    weights loaded or allocated; MoE experts as ``oneshot`` exposes them, one Linear per
    expert projection (llmcompressor's ``LinearExperts2D``)."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        for name, experts in get_non_linearized_moes(model):  # shapes only: no copy
            linear = LinearExperts2D.get_linear_experts_cls(type(experts))
            model.set_submodule(name, linear(getattr(experts, "config", model.config)))
    return model


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def summarize_names(names: list[str]) -> str:
    """Module names with layer indices folded: ``model.layers.{i}.mlp.up_proj (i = 0..29)``."""
    folded, indices = [], set()
    for name in names:
        indices.update(int(i) for i in re.findall(r"\.(\d+)\.", name))
        pattern = re.sub(r"\.\d+\.", ".{i}.", name)
        if pattern not in folded:
            folded.append(pattern)
    text = ", ".join(folded)
    if indices:
        text += f" (i = {min(indices)}..{max(indices)})"
    return text


# whisper-prune's flag -> (minimum, what it is)
MINIMUMS = {
    "num_sequences": (1, "calibration sequences"),
    "seq_len": (2, "pairs are formed within a sequence"),
    "eval_seq_len": (2, "a window predicts its tokens after the first"),
    "eval_windows": (0, "0 evaluates every window"),
    "seed": (0, "a torch generator seed"),
}


def check_batch_size(value: str) -> int | str:
    """``--batch-size``: ``auto`` or a whole number of at least 1."""
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(
            f"--batch-size must be 'auto' or a whole number of at least 1; got {value!r}"
        )
    return number


def check_offload_device(value: str) -> str:
    """``--offload-device``: ``auto``, ``cpu`` or a CUDA device that exists here."""
    if value in ("auto", "cpu"):
        return value
    try:
        device = torch.device(value)
    except RuntimeError:
        device = None
    if device is None or device.type != "cuda":
        raise UsageError(f"--offload-device must be 'auto', 'cpu' or a CUDA device; got {value!r}")
    if not torch.cuda.is_available():
        raise UsageError(f"--offload-device {value}: no CUDA device here (use 'cpu' or 'auto')")
    return value


def same_file(first: str, second: str) -> bool:
    """Whether two data arguments name one file on disk (hub names never do)."""
    first_path, second_path = Path(first).expanduser(), Path(second).expanduser()
    return first_path.is_file() and second_path.is_file() and first_path.samefile(second_path)
