"""``speed.py --random-layers L``: seconds per layer on a Llama-2-7B-shaped decoder of ``L``
layers with random weights (bfloat16 where CUDA is, else float32; ``--hidden`` and
``--intermediate`` shrink it for a smoke run) on random tokens, for each method x calibration
pipeline x activation-cache device x batch size.

With ``--reference`` the same run first times the reference procedure
(``reference_pruning``: Wanda and SparseGPT as their authors' repositories run them) on the
same model and tokens, and every row carries its ratio to its reference and issue 50's target
(Wanda and Wisp at most 1.2x reference Wanda, Wisp+ 3.0x, SparseGPT and Whisper 1.1x
reference SparseGPT). ``--profile METHOD`` profiles one more run of ``METHOD`` (the first
pipeline, cache device and batch size) and writes its ops by self time, CPU and CUDA,
to ``profile_METHOD.md``. Writes ``speed_random.md`` and ``speed_random.json``.
"""

from __future__ import annotations

import gc
import itertools
import tempfile
import time
from pathlib import Path

from common import PeakMemory, write_json

LAYER_TARGETS = {  # seconds per 7B layer on an H100 (issue #13, from the paper's times)
    "wanda": 1.6,
    "wisp": 1.6,
    "ria": 1.6,
    "ria_wisp": 1.6,
    "wisp_plus": 4.5,
    "sparsegpt": 11.0,
    "whisper": 11.0,
    "alps": 11.0,
    "alps_whisper": 11.0,
}
REFERENCE_TARGETS = {  # method: (its reference, at most this many times its time: issue 50)
    "wanda": ("wanda", 1.2),
    "wisp": ("wanda", 1.2),
    "wisp_plus": ("wanda", 3.0),
    "sparsegpt": ("sparsegpt", 1.1),
    "whisper": ("sparsegpt", 1.1),
}


def random_llama(layers: int, hidden: int, intermediate: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = LlamaForCausalLM(config).to(dtype).eval()
    directory = tempfile.mkdtemp(prefix="random-llama-")  # oneshot re-reads the config
    config.save_pretrained(directory)
    model.config.name_or_path = directory
    return model


def random_tokens(args):
    """The calibration tokens every row of a run uses (seed 0)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 32000, (args.num_sequences, args.seq_len), generator=generator)


def seven_b_shaped(args) -> bool:
    """Whether the per-layer targets apply: 7B layer shapes at the paper's 128 × 4096."""
    return (args.hidden, args.intermediate, args.num_sequences, args.seq_len) == (
        4096,
        11008,
        128,
        4096,
    )


def stand_in_tokenizer():
    """A one-word tokenizer: ``oneshot`` wants a processor, and the tokens are random."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")), unk_token="<unk>"
    )


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prune_random(args, method, offload_device, batch_size, pipeline):
    """One ``oneshot`` run of ``method`` on a fresh random model (seconds, peak bytes)."""
    import torch
    from datasets import Dataset

    from whisper_modifiers.methods import build_recipe, run_oneshot

    model = random_llama(args.random_layers, args.hidden, args.intermediate)
    ids = random_tokens(args)
    dataset = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )
    recipe = build_recipe(method, 0.5, args.structure, 0)
    with PeakMemory() as memory:
        start = time.perf_counter()
        run_oneshot(
            model,
            stand_in_tokenizer(),
            dataset,
            recipe,
            batch_size=batch_size,
            sequential_offload_device=offload_device,
            pipeline=pipeline,
        )
        seconds = time.perf_counter() - start
    del model
    _release()
    return seconds, memory.bytes


def measure_random(args, method, offload_device, batch_size, pipeline) -> dict:
    seconds, peak = prune_random(args, method, offload_device, batch_size, pipeline)
    return {
        "method": method,
        "pipeline": pipeline,
        "offload_device": offload_device,
        "batch_size": batch_size,
        "seconds": seconds,
        "seconds_per_layer": seconds / args.random_layers,
        "layer_target": LAYER_TARGETS.get(method) if seven_b_shaped(args) else None,
        "peak_bytes": peak,
    }


def measure_reference(args, method: str) -> dict:
    """The reference procedure's row (``reference_pruning``) on the same model and tokens,
    the model and the cached inputs on the GPU where there is one."""
    import torch
    from reference_pruning import reference_prune

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_llama(args.random_layers, args.hidden, args.intermediate).to(device)
    prune_n, prune_m = _structure(args.structure)
    with PeakMemory() as memory:
        start = time.perf_counter()
        per_layer = reference_prune(
            model, list(random_tokens(args)), method, 0.5, prune_n, prune_m, device
        )
        seconds = time.perf_counter() - start
    del model
    _release()
    return {
        "method": f"reference {method}",
        "pipeline": "reference",
        "offload_device": device,
        "batch_size": 1,
        "seconds": seconds,
        "seconds_per_layer": seconds / args.random_layers,
        "layer_seconds": per_layer,
        "layer_target": None,
        "peak_bytes": memory.bytes,
    }


def _structure(text: str) -> tuple[int, int]:
    n, _, m = text.partition(":")
    return (int(n), int(m)) if m else (0, 0)


def with_reference_ratios(rows: list[dict]) -> None:
    """Each row's seconds per layer over its reference's (``REFERENCE_TARGETS``), where the
    run has that reference."""
    references = {
        r["method"].removeprefix("reference "): r["seconds_per_layer"]
        for r in rows
        if r["pipeline"] == "reference"
    }
    for row in rows:
        reference, target = REFERENCE_TARGETS.get(row["method"], (None, None))
        base = references.get(reference)
        row["reference"] = None if base is None else f"reference {reference}"
        row["reference_ratio"] = None if base is None else row["seconds_per_layer"] / base
        row["reference_target"] = None if base is None else target


def profile_method(args, method: str) -> Path:
    """One more run of ``method`` under ``torch.profiler``; its ops by self time (CUDA
    time where there is a GPU, CPU time) as a Markdown table in ``--out``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        prune_random(args, method, args.offload_devices[0], args.batch_sizes[0], args.pipelines[0])
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=60)
    path = args.out / f"profile_{method}.md"
    path.write_text(
        f"# Profile: {method}, {args.pipelines[0]}, cache {args.offload_devices[0]}"
        f", batch {args.batch_sizes[0]}\n\n```\n{table}\n```\n"
    )
    return path


def main_random(args) -> int:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    payload = {"config": vars(args) | {"out": str(args.out)}, "device": device, "rows": []}
    for method in args.reference_methods if args.reference else ():
        row = measure_reference(args, method)
        payload["rows"].append(row)
        print(
            f"reference {method:<14}: {row['seconds']:7.2f} s "
            f"({row['seconds_per_layer']:.2f} s/layer)",
            flush=True,
        )
        write_random_tables(args.out, payload, show=False)
    for offload_device in args.offload_devices:
        for batch_size in args.batch_sizes:
            for method, pipeline in itertools.product(args.methods, args.pipelines):
                row = measure_random(args, method, offload_device, batch_size, pipeline)
                payload["rows"].append(row)
                print(
                    f"{method:<14} {pipeline:<17} cache {offload_device:<5} batch {batch_size}: "
                    f"{row['seconds']:7.2f} s ({row['seconds_per_layer']:.2f} s/layer), "
                    f"peak +{row['peak_bytes'] / 2**30:.1f} GiB",
                    flush=True,
                )
                # the rows so far, so that a run stopped at a time limit keeps them
                write_random_tables(args.out, payload, show=False)
    write_random_tables(args.out, payload)
    if args.profile:
        print(f"profile: {profile_method(args, args.profile)}", flush=True)
    return 0


def _target_cell(value, target) -> str:
    if target is None:
        return "-"
    return f"≤ {target} {'✓' if value <= target else '✗'}"


def write_random_tables(out: Path, payload: dict, show: bool = True) -> None:
    """``speed_random.md`` and ``speed_random.json`` from ``main_random``'s payload (and
    the table printed, with ``show``)."""
    config, rows = payload["config"], payload["rows"]
    with_reference_ratios(rows)
    lines = [
        "# Speed: Llama-2-7B-shaped decoder, random weights",
        "",
        f"Generated {time.strftime('%Y-%m-%d')} by `benchmarks/speed.py --random-layers "
        f"{config['random_layers']}` on {payload['device']}: hidden {config['hidden']}, MLP "
        f"{config['intermediate']}, {config['num_sequences']} × {config['seq_len']} calibration "
        f"tokens, mask {config['structure']}, one run each. Peak memory is above the level at "
        "the start (CUDA: allocated). The 32-layer column extrapolates s / layer to a "
        "32-layer 7B (Llama-2-7B's depth): an estimate, not a measurement. The reference "
        "rows are `benchmarks/reference_pruning.py` (the wanda / sparsegpt repositories' "
        "procedure) on the same model and tokens, in the same process.",
        "",
        "| method | pipeline | activation cache | batch | time (s) | s / layer "
        "| target s / layer | / reference | target | 32 layers (min) "
        "| peak extra memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["reference_ratio"] is None else f"**{r['reference_ratio']:.2f}×**"
        lines.append(
            f"| {r['method']} | {r['pipeline']} | {r['offload_device']} | {r['batch_size']} | "
            f"{r['seconds']:.1f} | {r['seconds_per_layer']:.2f} | "
            f"{_target_cell(r['seconds_per_layer'], r['layer_target'])} | {ratio} | "
            f"{_target_cell(r['reference_ratio'], r['reference_target'])} | "
            f"{r['seconds_per_layer'] * 32 / 60:.1f} | {r['peak_bytes'] / 2**30:.1f} |"
        )
    write_json(out / "speed_random.json", payload)
    (out / "speed_random.md").write_text("\n".join(lines) + "\n")
    if show:
        print("\n".join(lines))
