"""``whisper-lm-eval``: lm-evaluation-harness's own command line (``lm-eval``, the same
arguments and output), with this package imported first.

lm-eval cannot read a compressed checkpoint of this package by itself: nothing in its
process imports ``whisper_modifiers``, so transformers does not know the checkpoint's
quantization method (``HFLM(pretrained=DIR)`` raises "Unknown quantization type, got
whisper-modifiers-sparse24"), and lm-eval has no hook that imports a module
(``--include_path`` adds task files only). Importing the package registers the format in
transformers' quantizer registry (``whisper_sparse.transformers_adapter.quantizer``), after which
``--model hf --model_args pretrained=DIR`` loads it as ``from_pretrained`` does: on an x86
CPU the 2:4 layers stay compressed and run through the CPU op, elsewhere they are
decompressed as they load.

    whisper-lm-eval --model hf --model_args pretrained=outputs/smollm2-whisper-2of4 \\
        --tasks arc_easy --batch_size 8
"""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import whisper_modifiers  # noqa: F401  (registers the checkpoint format with transformers)

    cli_evaluate()


if __name__ == "__main__":
    main()
