"""Shared by the benchmarks: the models, one pruning run, result tables."""

from __future__ import annotations

import json
import math
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


def parse_variant(text: str) -> tuple[str, dict]:
    """``"whisper"`` or ``"whisper:gamma=0.1;pairing=centered"`` -> (method, options).
    Option values are read as YAML (numbers, strings, ``[lists]``)."""
    import yaml

    from whisper_modifiers.methods import METHODS

    method, _, rest = text.partition(":")
    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r} in {text!r}; known: {', '.join(METHODS)}")
    options = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        options[key.strip()] = yaml.safe_load(value)
    return method, options


def run_key(spec: ModelSpec, windows, recipe, seed: int) -> str:
    """What decides a run's result: the protocol, every field of the recipe's modifiers
    (defaults included, so ``whisper`` and ``whisper:num_permutations=1`` are one run),
    and the seed."""
    modifiers = [[type(m).__name__, m.model_dump(mode="json")] for m in recipe]
    return json.dumps([vars(spec), windows, modifiers, seed], sort_keys=True, default=str)


def run_variants(spec, tokenizer, eval_ids, windows, variants, sparsity_labels, seeds,
                 num_sequences=None, seq_len=None, table=None, on_cell=None,
                 cache=None, cached_only=False) -> dict:  # fmt: skip
    """Prune and evaluate every (sparsity, variant, seed) into ``table``
    (``{sparsity label: {variant: cell}}``, a cell holding the runs and mean +- s.e.m.);
    ``on_cell()`` is called after each cell and each new run. ``cache`` (a dict,
    ``run_key`` -> run) holds runs already done: a variant that builds the same recipe as
    one run before is not run again. With ``cached_only`` nothing is run: a cell whose
    runs are not all in ``cache`` is left out (tables from an interrupted benchmark)."""
    import torch

    from whisper_modifiers.methods import build_recipe
    from whisper_modifiers.saving import gamma_selection

    table = {} if table is None else table
    cache = {} if cache is None else cache
    for label in sparsity_labels:
        sparsity, structure = parse_sparsity(label)
        for variant in variants:
            method, options = parse_variant(variant)
            runs = []
            for seed in range(seeds):
                recipe = build_recipe(method, sparsity, structure, seed, **options)
                key = run_key(spec, windows, recipe, seed)
                if key not in cache and cached_only:
                    break
                if key not in cache:
                    model, _ = load(spec)
                    dataset = calibration_set(spec, tokenizer, seed, num_sequences, seq_len)
                    seconds, memory = prune(model, tokenizer, dataset, recipe)
                    model = on_evaluation_device(model)
                    ppl = spec_perplexity(model, spec, tokenizer, eval_ids, windows)
                    selection = gamma_selection(recipe)  # gamma: auto's record, if any
                    gammas = {name: choice["gamma"] for name, choice in selection.items()}
                    cache[key] = {"seed": seed, "perplexity": ppl, "seconds": seconds,
                                  "peak_bytes": memory, "gamma": gammas,
                                  "selection": selection,
                                  "threads": torch.get_num_threads()}  # fmt: skip
                    if on_cell is not None:
                        on_cell()  # the cache keeps each finished run
                runs.append(cache[key])
                print(f"[{spec.name}] {label:>5} {variant} seed {seed}: ppl "
                      f"{runs[-1]['perplexity']:.3f}  {runs[-1]['seconds']:.1f} s",
                      flush=True)  # fmt: skip
            if len(runs) < seeds:  # cached_only, and some seed was not run
                continue
            ppl_mean, ppl_sem = mean_sem([r["perplexity"] for r in runs])
            time_mean, time_sem = mean_sem([r["seconds"] for r in runs])
            table.setdefault(label, {})[variant] = {
                "runs": runs,
                "perplexity": ppl_mean,
                "perplexity_sem": ppl_sem,
                "seconds": time_mean,
                "seconds_sem": time_sem,
            }
            if on_cell is not None:
                on_cell()
    return table


def parse_sparsity(label: str) -> tuple[float, str]:
    """``"2:4"`` -> (0.5, "2:4"); ``"0.65"`` -> (0.65, "0:0")."""
    if ":" in label:
        n, m = (int(x) for x in label.split(":"))
        return n / m, label
    return float(label), "0:0"


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


def mean_sem(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    sem = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return mean, sem


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
    out: Path, recipe: str, model: str | None, calibration: str, evaluation: str,
    num_sequences: int, seq_len: int, *extra: str,
) -> Path:  # fmt: skip
    """``whisper-prune`` of ``recipe`` into ``out`` (one evaluation window, no dense one)."""
    from whisper_modifiers.cli import main as whisper_prune

    argv = [
        "--recipe", recipe, "--output-dir", str(out), "--calibration", calibration,
        "--num-sequences", str(num_sequences), "--seq-len", str(seq_len),
        "--eval-text", evaluation, "--eval-windows", "1", "--skip-dense-eval", *extra,
    ] + (["--model", model] if model else [])  # fmt: skip
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
