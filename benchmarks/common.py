"""Shared by the benchmarks: the models, one pruning run, result tables."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WHISPER_MODIFIERS_SHARED", REPO.parent / "shared"))
RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class ModelSpec:
    """A model and its default calibration and evaluation protocol."""

    name: str
    source: str  # local dir, hub id, or "embedded"
    calibration: str  # corpus for whisper_modifiers.data.load_corpus
    evaluation: str  # a text file, WikiText-2 rows JSON, or "wikitext2"
    num_sequences: int
    seq_len: int
    eval_seq_len: int
    eval_windows: int | None
    bos: bool = False  # every calibration and evaluation window starts with BOS (Gemma)


def model_specs() -> dict[str, ModelSpec]:
    wikitext_valid = SHARED / "data" / "wikitext-2" / "valid.txt"
    wikitext_test = SHARED / "data" / "wikitext-2-raw-v1" / "test_rows.json"
    calibration = str(wikitext_valid) if wikitext_valid.exists() else "wikitext2"
    evaluation = str(wikitext_test) if wikitext_test.exists() else "wikitext2"
    return {
        "stories260K": ModelSpec(
            "stories260K",
            str(SHARED / "models" / "stories260K"),
            calibration,
            str(SHARED / "data" / "tinystories" / "sample.txt"),
            64,
            256,
            256,
            None,
        ),
        "smollm2-135m": ModelSpec(
            "smollm2-135m", "embedded", calibration, evaluation, 32, 512, 1024, 16
        ),
        # opt-in, never in CI: bash scripts/install_gemma.sh
        "gemma3-270m": ModelSpec(
            "gemma3-270m", "gemma3", calibration, evaluation, 32, 512, 1024, 16, bos=True
        ),
    }


def load(spec: ModelSpec):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from whisper_modifiers.models import gemma3_model_dir, resolve_model

    if spec.source == "gemma3":
        path = gemma3_model_dir()
    else:
        path = resolve_model(None if spec.source == "embedded" else spec.source)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer


def evaluation_ids(spec: ModelSpec, tokenizer) -> list[int]:
    from whisper_modifiers.evaluation import evaluation_text

    return tokenizer(evaluation_text(spec.evaluation), add_special_tokens=False)["input_ids"]


def calibration_set(spec: ModelSpec, tokenizer, seed: int, num_sequences=None, seq_len=None):
    from whisper_modifiers.data import calibration_dataset, load_corpus

    return calibration_dataset(
        tokenizer,
        load_corpus(spec.calibration, split="train"),
        num_sequences or spec.num_sequences,
        seq_len or spec.seq_len,
        seed=seed,
        bos=spec.bos,
    )


def on_evaluation_device(model):
    """The model whole on the GPU when there is one (llmcompressor's
    ``dispatch_for_generation``, which also ends the onloading that ``oneshot`` leaves
    behind); unchanged on a CPU-only machine."""
    import torch

    if not torch.cuda.is_available():
        return model
    from llmcompressor.utils import dispatch_for_generation

    return dispatch_for_generation(model)


def spec_perplexity(model, spec: ModelSpec, tokenizer, eval_ids, windows) -> float:
    """``evaluation.perplexity`` under ``spec``'s protocol (BOS-led windows for Gemma)."""
    from whisper_modifiers.evaluation import perplexity

    bos = tokenizer.bos_token_id if spec.bos else None
    return perplexity(model, eval_ids, spec.eval_seq_len, windows, bos)


class PeakMemory:
    """Peak resident memory above the level at entry, sampled every 5 ms (CPU), or
    ``torch.cuda.max_memory_allocated`` above the level at entry (CUDA)."""

    def __enter__(self):
        import psutil
        import torch

        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            self.bytes = torch.cuda.max_memory_allocated() - self.start
        else:
            self.running = False
            self.thread.join()
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.bytes = self.peak - self.start


def prune(model, tokenizer, dataset, recipe, **oneshot_kwargs) -> tuple[float, int]:
    """Run ``oneshot`` (``oneshot_kwargs``: ``pipeline``, …); returns (wall seconds, peak
    extra memory in bytes)."""
    from whisper_modifiers.methods import run_oneshot

    with PeakMemory() as memory:
        start = time.perf_counter()
        run_oneshot(model, tokenizer, dataset, recipe, **oneshot_kwargs)
        seconds = time.perf_counter() - start
    return seconds, memory.bytes


def check_serving_sparsities(parser, values: list[str]) -> None:
    """The serving benchmarks' ``--sparsity``: ``2:4`` or a fraction in (0, 1) (the CPU op
    and the plugin's two layouts); anything else is a usage error naming it."""
    for value in values:
        try:
            valid = value == "2:4" or 0 < float(value) < 1
        except ValueError:
            valid = False
        if not valid:
            parser.error(f"--sparsity takes 2:4 or a fraction between 0 and 1, not {value!r}")


def balanced_orders(labels: list) -> list[list]:
    """Orders of ``labels`` for rounds of alternated timing (a Williams design): over one
    cycle of these orders every label takes every place in the round equally often and
    follows every other label equally often, so that neither its place nor the side timed
    just before it favours a side (on this machine, five sides in one fixed mirrored order
    read the same weights 3-13 % apart by their place). ``len(labels)`` orders where that
    is even, twice as many where it is odd."""
    count = len(labels)
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    rows = [[(place + shift) % count for place in first] for shift in range(count)]
    if count % 2:
        rows += [row[::-1] for row in rows]
    return [[labels[place] for place in row] for row in rows]


def alternated_rounds(sides: dict, rounds: int) -> dict[str, list[float]]:
    """Per side (a label and a callable), its seconds in each of ``rounds`` rounds; every
    round runs each side once, in that round's order of ``balanced_orders``."""
    seconds = {label: [] for label in sides}
    orders = balanced_orders(list(sides))
    for round_ in range(rounds):
        for label in orders[round_ % len(orders)]:
            start = time.perf_counter()
            sides[label]()
            seconds[label].append(time.perf_counter() - start)
    return seconds


def ratio_spread(ratios: list[float]) -> dict:
    """Per-round ratios as ``ratio`` (their median), ``lowest`` and ``highest``."""
    return {"ratio": statistics.median(ratios), "lowest": min(ratios), "highest": max(ratios)}


def run_stamp() -> dict:
    """When and from which commit a result was measured, for the journal and the summary."""
    import subprocess

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": commit or "unknown"}


def write_json(path: Path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def quiet_logs() -> None:
    """Keep llmcompressor's per-module INFO/METRIC lines out of benchmark output."""
    from loguru import logger

    logger.disable("llmcompressor")


def wikitext_setup(model: str | None):
    """The source model, its tokenizer, WikiText-2 calibration and evaluation sources
    (``../shared``'s files, else the hub's) and the evaluation token ids: what the serving
    benchmarks share."""
    from transformers import AutoTokenizer

    from whisper_modifiers.evaluation import evaluation_text
    from whisper_modifiers.models import resolve_model

    source = Path(resolve_model(model))
    calibration = SHARED / "data" / "wikitext-2" / "valid.txt"
    evaluation = SHARED / "data" / "wikitext-2-raw-v1" / "test_rows.json"
    calibration = str(calibration) if calibration.exists() else "wikitext2"
    evaluation = str(evaluation) if evaluation.exists() else "wikitext2"
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer(evaluation_text(evaluation), add_special_tokens=False)["input_ids"]
    return source, tokenizer, calibration, evaluation, ids


def whisper_prune_to(
    out: Path,
    recipe: str,
    model: str | None,
    calibration: str,
    evaluation: str,
    num_sequences: int,
    seq_len: int,
    *extra: str,
) -> Path:
    """``whisper-prune`` of ``recipe`` into ``out`` (one evaluation window, no dense one)."""
    from whisper_modifiers.cli import main as whisper_prune

    argv = [
        "--recipe",
        recipe,
        "--output-dir",
        str(out),
        "--calibration",
        calibration,
        "--num-sequences",
        str(num_sequences),
        "--seq-len",
        str(seq_len),
        "--eval-text",
        evaluation,
        "--eval-windows",
        "1",
        "--skip-dense-eval",
        *extra,
    ] + (["--model", model] if model else [])
    assert whisper_prune(argv) == 0, recipe
    return out


def add_checkpoint_arguments(parser, recipes: list[str]) -> None:
    """The flags of the serving benchmarks that prune their checkpoints: ``--model``,
    ``--recipes``, the calibration size and ``--out``."""
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--recipes", nargs="+", default=recipes)
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS)
