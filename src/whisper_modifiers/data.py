"""Calibration data: N sequences of L tokens sampled with a seed from a corpus.

The paper's protocol (Section 3.4) is 128 sequences of 4096 tokens from the WikiText-2
training split.  Sequences are fed one per batch row, without padding, so pairs are
never formed with pad tokens.  ``load_corpus`` reads the Hugging Face dataset or a local
text file; ``sample_sequences`` draws random windows (as SparseGPT and Wanda do).
"""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset

__all__ = [
    "CORPORA",
    "calibration_dataset",
    "embedded_text",
    "load_corpus",
    "sample_sequences",
    "sequence_dataset",
]

CORPORA = ("embedded", "wikitext2", "c4")
_C4_SHARDS = {  # the shards SparseGPT and Wanda use
    "train": "en/c4-train.00000-of-01024.json.gz",
    "validation": "en/c4-validation.00000-of-00008.json.gz",
}


def embedded_text(part: str) -> str:
    """Real English text that ships with every CPython: the Python Language Reference
    topics of the standard library's ``pydoc_data`` (about 465 KB, PSF license).

    ``part="train"`` is four topics out of five (by sorted name), ``"test"`` the fifth,
    so calibration and evaluation text never overlap.
    """
    from pydoc_data.topics import topics

    if part not in ("train", "test"):
        raise ValueError(f"part must be 'train' or 'test', got {part!r}")
    keys = sorted(topics)
    chosen = [k for i, k in enumerate(keys) if (i % 5 == 0) == (part == "test")]
    return "\n\n".join(topics[k] for k in chosen)


def load_corpus(source: str | Path, split: str = "train") -> str:
    """Text of a corpus.

    :param source: a local text file; ``"embedded"`` (``embedded_text``, works offline);
        ``"wikitext2"`` (``wikitext-2-raw-v1`` from the Hugging Face hub, rows joined by
        blank lines as Wanda/SparseGPT do); or ``"c4"`` (the first ``allenai/c4`` shard
        of the split, first 20,000 documents).
    :param split: ``"train"``, ``"test"`` or ``"validation"`` for the named corpora.
    """
    source = str(source)
    if source == "embedded":
        return embedded_text("test" if split == "test" else "train")
    if source == "wikitext2":
        from datasets import load_dataset

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
        return "\n\n".join(rows)
    if source == "c4":
        from datasets import load_dataset

        shard = _C4_SHARDS["train" if split == "train" else "validation"]
        rows = load_dataset("allenai/c4", data_files={"x": shard}, split="x")["text"]
        return "\n\n".join(rows[:20_000])
    path = Path(source).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise FileNotFoundError(
        f"corpus {source!r} is neither a readable file nor one of {', '.join(CORPORA)}"
    )


def sample_sequences(
    token_ids: torch.Tensor | list[int], num_sequences: int, seq_len: int, seed: int = 0
) -> list[list[int]]:
    """``num_sequences`` windows of ``seq_len`` consecutive tokens at seeded random
    offsets (each window lies inside the corpus; windows may overlap, as in SparseGPT).
    """
    token_ids = torch.as_tensor(token_ids)
    if seq_len < 2 or num_sequences < 1:
        raise ValueError(
            f"need num_sequences >= 1 and seq_len >= 2, got {num_sequences} x {seq_len}"
        )
    if token_ids.numel() < seq_len + 1:
        raise ValueError(
            f"corpus has {token_ids.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1} "
            f"(a window of {seq_len} tokens needs at least {seq_len + 1})"
        )
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, token_ids.numel() - seq_len, (num_sequences,), generator=generator)
    return [token_ids[s : s + seq_len].tolist() for s in starts.tolist()]


def calibration_dataset(
    tokenizer, text: str, num_sequences: int, seq_len: int, seed: int = 0, bos: bool = False
) -> Dataset:
    """A ``datasets.Dataset`` of ``input_ids``/``attention_mask`` rows for ``oneshot``.

    Pass it with ``shuffle_calibration_samples=False`` (and ``batch_size=1``) so the
    order, and hence every seeded pair permutation, is reproducible.  With ``bos`` each
    row is the tokenizer's BOS followed by ``seq_len - 1`` corpus tokens (Gemma needs it,
    as ``evaluation.evaluation_windows`` does for evaluation).
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not bos:
        return sequence_dataset(sample_sequences(ids, num_sequences, seq_len, seed))
    sequences = sample_sequences(ids, num_sequences, seq_len - 1, seed)
    return sequence_dataset([[tokenizer.bos_token_id, *s] for s in sequences])


def sequence_dataset(sequences: list[list[int]]) -> Dataset:
    """``sequences`` (from ``sample_sequences``) as ``calibration_dataset``'s rows."""
    return Dataset.from_dict(
        {"input_ids": sequences, "attention_mask": [[1] * len(s) for s in sequences]}
    )
