"""Ablation benchmark: the paper's appendix tables for our models.

    python benchmarks/ablation.py                                  # stories260K, 3 seeds
    python benchmarks/ablation.py --models smollm2-135m --tables gamma pairing

Each table is a set of method variants (``method:option=value;...``) run through
``quality.py`` at 2:4 (``--sparsities`` to change), each with ``--seeds`` seeds; the
results land in ``<out>/<table>/quality.{json,md}`` and are merged into
``<out>/ablation.md`` and ``ablation.json``. Finished runs are kept in ``<out>/runs.json``:
a variant that is the same run as one in another table (``whisper`` and
``whisper:num_permutations=1``) is not repeated, and an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # noqa: E402
from common import RESULTS, write_json  # noqa: E402

GATE, UP = r"re:.*mlp\.gate_proj$", r"re:.*mlp\.up_proj$"
DOWN, ATTENTION = r"re:.*mlp\.down_proj$", r"re:.*self_attn\..*_proj$"
TABLES = {
    "pairing": (
        "centered and nearest-neighbour vs random pairs (appendix 'Centering', "
        "'Sampling approach details')",
        [
            "wanda",
            "wisp",
            "wisp:pairing=centered",
            "wisp:pairing=nearest",
            "sparsegpt",
            "whisper",
            "whisper:pairing=centered",
            "whisper:pairing=nearest",
        ],
    ),
    "permutations": (
        "pairs per sequence: 1, 2, 4 permutations",
        [f"{m}:num_permutations={k}" for m in ("wisp", "wisp_plus", "whisper") for k in (1, 2, 4)],
    ),
    "pair_fraction": (
        "Wisp+'s K / s",
        [f"wisp_plus:pair_fraction={f}" for f in (0.001, 0.005, 0.02, 0.1, 1.0)],
    ),
    "specialization": (
        "fraction of neurons given the neuronwise statistic, most difficult "
        "first (appendix 'From Wisp to Wisp+')",
        [f"wisp_plus:specialized_fraction={f}" for f in (0.0, 0.25, 0.5, 1.0)],
    ),
    "gamma": (
        "Whisper's gamma (1.0 is SparseGPT)",
        [f"whisper:gamma={g}" for g in (0.0, 0.001, 0.01, 0.1, 0.3, 1.0)],
    ),
    "component": (
        "which projections get the difference criterion (table 'component-wise')",
        [
            f"{m}:difference_targets=[{t}]"
            for m in ("wisp", "whisper")
            for t in (GATE, UP, f"{GATE}, {UP}", DOWN, ATTENTION)
        ],
    ),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["stories260K"])
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES))
    parser.add_argument("--sparsities", nargs="+", default=["2:4"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-sequences", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--eval-windows", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "ablation")
    args = parser.parse_args(argv)

    stamp = time.strftime("%Y-%m-%d")
    merged = {}
    lines = [
        "# Ablations",
        "",
        f"Generated {stamp} by `benchmarks/ablation.py` ({args.seeds} seeds, mean ± s.e.m.).",
    ]
    for table in args.tables:
        title, variants = TABLES[table]
        argv = [
            "--models",
            *args.models,
            "--methods",
            *variants,
            "--sparsities",
            *args.sparsities,
            "--seeds",
            str(args.seeds),
            "--out",
            str(args.out / table),
            "--cache",
            str(args.out / "runs.json"),
        ]
        for flag in ("num_sequences", "seq_len", "eval_windows"):
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        quality.main(argv)
        merged[table] = json.loads((args.out / table / "quality.json").read_text())
        body = (args.out / table / "quality.md").read_text().split("\n", 3)[3]
        lines += ["", f"# {table}: {title}", body.replace("\n## ", "\n### ")]
    write_json(args.out / "ablation.json", merged)
    (args.out / "ablation.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
