"""Calibration sampling, perplexity against hand-computed values, lm-eval offline."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import CALIBRATION_TEXT, SHARED, load_model, two_of_four_by_magnitude
from whisper_modifiers.data import (
    calibration_dataset,
    embedded_text,
    load_corpus,
    sample_sequences,
)
from whisper_modifiers.evaluation import (
    downstream,
    leading_token_ids,
    perplexity,
    wikitext2_test_text,
)
from whisper_modifiers.models import embedded_model_dir


def test_sampled_sequences_are_contiguous_windows_and_seeded():
    corpus = list(range(1000, 1500))
    a = sample_sequences(corpus, 20, 32, seed=1)
    assert a == sample_sequences(corpus, 20, 32, seed=1)
    assert a != sample_sequences(corpus, 20, 32, seed=2)
    for window in a:
        assert len(window) == 32
        start = window[0] - 1000  # a window is one contiguous slice of the corpus
        assert window == corpus[start : start + 32]


def test_sampling_errors():
    with pytest.raises(ValueError, match="seq_len"):
        sample_sequences(list(range(10)), 1, 1)
    with pytest.raises(ValueError, match="fewer than"):
        sample_sequences(list(range(10)), 1, 10)


def test_calibration_dataset_rows_are_unpadded_sequences(tokenizer):
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")[:20_000]
    ds = calibration_dataset(tokenizer, text, 5, 48, seed=0)
    assert len(ds) == 5
    assert all(len(r) == 48 for r in ds["input_ids"])
    assert all(sum(m) == 48 for m in ds["attention_mask"])
    assert ds["input_ids"] == calibration_dataset(tokenizer, text, 5, 48, seed=0)["input_ids"]
    led = calibration_dataset(tokenizer, text, 5, 48, seed=0, bos=True)["input_ids"]
    assert all(len(r) == 48 and r[0] == tokenizer.bos_token_id for r in led)
    assert led == calibration_dataset(tokenizer, text, 5, 48, seed=0, bos=True)["input_ids"]


def test_embedded_text_is_offline_and_split():
    train, test = embedded_text("train"), embedded_text("test")
    assert len(train) > 300_000 and len(test) > 50_000
    assert test[:2000] not in train
    assert load_corpus("embedded", "test") == test
    with pytest.raises(FileNotFoundError, match="neither a readable file"):
        load_corpus("no-such-corpus")


class Bigram(torch.nn.Module):
    """A tiny model with known next-token probabilities."""

    def __init__(self, probabilities):
        super().__init__()
        self.log_probs = torch.nn.Parameter(torch.tensor(probabilities).log())

    def forward(self, ids):
        return type("Out", (), {"logits": self.log_probs[ids]})()


def test_perplexity_by_hand():
    model = Bigram([[0.25, 0.75], [0.5, 0.5]])  # p(1|0) = 0.75, p(0|1) = 0.5
    tokens = [0, 1, 0, 1, 0, 1, 0, 1, 0]  # two windows of 4 (the tail is dropped)
    expected = (0.75 * 0.5 * 0.75) ** (-1 / 3)
    assert perplexity(model, tokens, 4) == pytest.approx(expected, rel=1e-6)
    assert perplexity(model, tokens, 4, max_windows=1) == pytest.approx(expected, rel=1e-6)
    # BOS windows: [bos=1] + 3 tokens: 1->0 (0.5), 0->1 (0.75), 1->0 (0.5)
    assert perplexity(model, tokens, 4, bos_token_id=1) == pytest.approx(
        (0.5 * 0.75 * 0.5) ** (-1 / 3), rel=1e-6
    )
    with pytest.raises(ValueError, match="no window"):
        perplexity(model, tokens[:3], 4)


class RecordingTokenizer:
    """``tokenizer``'s ids, and the length of every text it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, add_special_tokens=False):
        self.lengths.append(len(text))
        return self.tokenizer(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("which", ["smollm2", "stories260K"])
def test_leading_token_ids_are_the_whole_texts_from_a_prefix(which, tokenizer):
    """whisper-prune's evaluation windows: the first ids of the whole WikiText-2 test text
    (SmolLM2's byte-level BPE; stories260K's SentencePiece), got from a prefix of it."""
    from transformers import AutoTokenizer

    if which == "smollm2":
        tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    text = wikitext2_test_text(SHARED / "data" / "wikitext-2-raw-v1" / "test_rows.json")
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    for count in (1, 255, 4096, 16 * 4096):
        recording = RecordingTokenizer(tokenizer)
        assert leading_token_ids(recording, text, count) == whole[:count], count
        assert sum(recording.lengths) < len(text), (count, recording.lengths)
    assert leading_token_ids(tokenizer, text, None) == whole
    assert leading_token_ids(tokenizer, text, len(whole) + 1) == whole  # all it holds


def test_leading_token_ids_take_the_whole_text_where_prefixes_disagree():
    """A tokenizer whose first id depends on the whole text (no real one does): no prefix
    agrees with the next, so the whole text is tokenized."""

    def first_id_is_the_length(text, add_special_tokens=False):
        return {"input_ids": [len(text), *map(ord, text)]}

    text = "\n\n".join(f"row {i} " * 20 for i in range(400))
    got = leading_token_ids(first_id_is_the_length, text, 100)
    assert got == first_id_is_the_length(text)["input_ids"][:100]


def test_wikitext2_rows_file(tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(["a", " = b = ", "c"]))
    assert wikitext2_test_text(rows) == "a\n\n = b = \n\nc"


def test_lm_eval_local_task(tmp_path, tokenizer):
    """A local multiple-choice task: lm_eval's accuracy equals our own argmax of the
    summed continuation log-likelihoods."""
    docs = [
        {"question": "Once upon a time there was a little", "choices": ["girl", "car"], "gold": 0},
        {"question": "The dog said", "choices": ["woof", "table"], "gold": 0},
        {"question": "She was very", "choices": ["happy", "seven"], "gold": 1},
        {"question": "They went to the", "choices": ["park", "blue"], "gold": 0},
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "tiny.yaml").write_text(
        f"""task: tiny_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""
    )
    model = load_model()
    results = downstream(model, tokenizer, tasks={"tiny_local": 0}, include_path=tmp_path)
    expected = 0
    for doc in docs:
        scores = []
        for choice in doc["choices"]:
            context = tokenizer(doc["question"])["input_ids"]
            whole = tokenizer(doc["question"] + " " + choice)["input_ids"]
            with torch.no_grad():
                logp = model(torch.tensor([whole])).logits[0].log_softmax(-1)
            scores.append(
                sum(float(logp[t - 1, whole[t]]) for t in range(len(context), len(whole)))
            )
        expected += int(max(range(2), key=scores.__getitem__) == doc["gold"])
    assert 0 < expected < len(docs)  # a task the model neither aces nor fails
    assert math.isclose(results["tiny_local"]["acc"], expected / len(docs))


def test_sentencepiece_bpe_tokenizer_from_gguf(tmp_path):
    """Gemma 3's GGUF tokenizer: merges follow the piece scores (minus the merge rank),
    user-defined pieces match whole, and the tokenizer survives save/load."""
    from gguf import GGUFWriter
    from transformers import AutoTokenizer

    from whisper_modifiers.models import sentencepiece_bpe_tokenizer

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "c", "▁", "ab", "▁ab", "bc", "\n"]
    scores = [-1000.0] * 4 + [-100.0, -101.0, -102.0, -103.0, -1.0, -2.0, -3.0, -1000.0]
    kinds = [3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 4]
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    for add, index in (
        (writer.add_bos_token_id, 2),
        (writer.add_eos_token_id, 1),
        (writer.add_unk_token_id, 3),
        (writer.add_pad_token_id, 0),
    ):
        add(index)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tokenizer = sentencepiece_bpe_tokenizer(path)
    # "abc ab\nc": (a, b) merges before (b, c), then (▁, ab); "\n" is one piece
    expected = [8, 6, 9, 11, 6]
    assert tokenizer("abc ab\nc", add_special_tokens=False)["input_ids"] == expected
    assert tokenizer.decode(expected) == "abc ab\nc"
    assert tokenizer.bos_token_id == 2 and tokenizer.pad_token_id == 0
    tokenizer.save_pretrained(tmp_path / "saved")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert reloaded("abc ab\nc", add_special_tokens=False)["input_ids"] == expected


def test_lm_eval_reads_a_compressed_checkpoint_through_whisper_lm_eval(tmp_path, tokenizer):
    """lm-eval's own command line cannot load a compressed checkpoint (nothing imports this
    package in its process); ``whisper-lm-eval``, the same command line with the package
    imported first, does, and scores what the checkpoint holds: its accuracy on a local
    task equals ``downstream`` on the model transformers loads from it."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from conftest import MODEL_DIR
    from whisper_sparse.format.layout import write_compressed

    checkpoint = tmp_path / "compressed"
    model = load_model()
    targets = two_of_four_by_magnitude(model)  # every decoder Linear 2:4 by magnitude
    model.save_pretrained(checkpoint)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, checkpoint / name)
    write_compressed(checkpoint, targets)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [
        {"question": q, "choices": c, "gold": g}
        for q, c, g in [
            ("Once upon a time there was a little", ["girl", "car"], 0),
            ("The dog said", ["woof", "table"], 0),
            ("She was very", ["happy", "seven"], 1),
            ("They went to the", ["park", "blue"], 0),
        ]
    ]
    (tasks / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tasks / "tiny.yaml").write_text(
        f"task: tiny_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: gold\n'
        "metric_list:\n  - metric: acc\n"
    )
    args = [
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={checkpoint},dtype=float32",
        "--tasks",
        "tiny_local",
        "--include_path",
        str(tasks),
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    scripts = Path(sys.executable).parent
    stock = subprocess.run(
        [str(scripts / "lm-eval"), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert stock.returncode != 0 and "Unknown quantization type" in stock.stdout + stock.stderr
    ours = subprocess.run(
        [str(scripts / "whisper-lm-eval"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert ours.returncode == 0, (ours.stdout + ours.stderr)[-3000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    accuracy = json.loads(result.read_text())["results"]["tiny_local"]["acc,none"]
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = downstream(loaded, tokenizer, tasks={"tiny_local": 0}, include_path=tasks)
    assert math.isclose(accuracy, expected["tiny_local"]["acc"])
