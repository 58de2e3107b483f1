"""Shared fixtures: the real stories260K model and WikiText-2 text from ../shared."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WHISPER_MODIFIERS_SHARED", REPO.parent / "shared"))
MODEL_DIR = SHARED / "models" / "stories260K"
CALIBRATION_TEXT = SHARED / "data" / "wikitext-2" / "valid.txt"
HELDOUT_TEXT = SHARED / "data" / "tinystories" / "sample.txt"
RECIPES = REPO / "recipes"

NUM_SEQUENCES = 8
SEQ_LEN = 64


def require_serving_environment() -> None:
    """Skip the calling test module where the serving environment (scripts/setup_serving.sh)
    is missing, except in CI (``CI`` set), where that is a failure: CI builds it."""
    from whisper_sparse.driver import serving_python

    try:
        serving_python()
    except FileNotFoundError as missing:
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must build the serving environment: {missing}") from missing
        pytest.skip(str(missing), allow_module_level=True)


def pytest_configure(config):
    if not MODEL_DIR.exists():
        raise pytest.UsageError(
            f"test data not found at {SHARED}; set WHISPER_MODIFIERS_SHARED to the "
            "shared/ folder (models/stories260K, data/...)"
        )
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:  # an xdist worker: the CPUs shared out, for torch and the processes it starts
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# The modules whose tests share a module-scoped fixture (a pruned checkpoint, a resident
# vLLM process, the torchrun runs), heaviest first. Under xdist (README's test command:
# two workers) each runs whole on one worker, so that its fixture is built once, and they
# start first; every other test goes wherever a worker is free. (xdist's own
# ``--dist loadgroup`` renames node ids, which pytest 9.2 ignores.)
GROUPED_MODULES = (
    "test_serving.py",
    "test_distributed.py",
    "test_families.py",
    "test_recipes.py",
    "test_safety.py",
    "test_moe_pairs.py",
    "test_unstructured.py",
)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).name in GROUPED_MODULES else nodeid

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """``GROUPED_MODULES`` first, in their order (the same in every xdist worker); a module
    with a module-scoped fixture missing from them is named, not silently built twice."""
    for item in items:
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        shared = any(defs and defs[-1].scope == "module" for defs in definitions.values())
        if shared and item.path.name not in GROUPED_MODULES:
            raise pytest.UsageError(
                f"{item.path.name} has a module-scoped fixture: add it "
                "to GROUPED_MODULES in tests/conftest.py"
            )
    rank = {name: index for index, name in enumerate(GROUPED_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionstart(session):
    """One line before any test, whatever the verbosity: this CPU's relevant flags and
    which of vLLM's CPU ops the serving environment has, so that a red run on either kind
    of CPU can be read from the log alone (by the controller, not by each xdist worker)."""
    if hasattr(session.config, "workerinput"):
        return
    from whisper_sparse.driver import capabilities_line

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(capabilities_line())


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="session")
def calibration(tokenizer):
    from whisper_modifiers.data import calibration_dataset

    text = CALIBRATION_TEXT.read_text(encoding="utf-8")[:100_000]
    return calibration_dataset(tokenizer, text, NUM_SEQUENCES, SEQ_LEN, seed=0)


def load_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)


@pytest.fixture
def run_oneshot(tokenizer, calibration):
    """Prune a fresh stories260K with a recipe; returns the pruned model."""
    from whisper_modifiers.methods import run_oneshot

    def run(recipe, dataset=None, model=None, **kwargs):
        model = load_model() if model is None else model
        run_oneshot(model, tokenizer, calibration if dataset is None else dataset, recipe, **kwargs)
        return model

    return run


def linear_weights(model) -> dict[str, torch.Tensor]:
    return {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def two_of_four_by_magnitude(model) -> list[str]:
    """Every Linear of ``model`` but ``lm_head`` made 2:4 in place, keeping the largest two
    of every four inputs (as compressed-tensors' 2:4 compressor did); their names."""
    targets = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                groups = module.weight.reshape(module.weight.shape[0], -1, 4)
                keep = torch.zeros_like(groups, dtype=torch.bool)
                keep.scatter_(-1, groups.abs().topk(2, dim=-1).indices, True)
                module.weight.copy_((groups * keep).reshape(module.weight.shape))
                targets.append(name)
    return targets


def legacy_sparse_checkpoint(directory: Path, quantized: bool = False) -> Path:
    """stories260K as compressed-tensors < 0.15 wrote 2:4 models: its Linear weights made
    2:4 (largest two of four, as its compressor did), stored as ``.compressed`` /
    ``.bitmask`` / ``.shape`` and declared as the legacy ``sparse-24-bitmask`` format;
    ``quantized`` adds a quantization scheme (a combination nothing reads today)."""
    from transformers import AutoModelForCausalLM

    from whisper_sparse.format.layout import write_compressed

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    targets = two_of_four_by_magnitude(model)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, directory / name)
    write_compressed(directory, targets)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "sparsity_config": {
            "format": "sparse-24-bitmask",
            "sparsity_structure": "2:4",
            "targets": ["Linear"],
            "ignore": ["lm_head"],
        },
    }
    if quantized:
        config["quantization_config"]["config_groups"] = {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}
        }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def tiny_model(directory: Path, tokenizer, model_class, config) -> Path:
    """A random-weight ``model_class(config)`` (seed 0) and ``tokenizer`` saved in
    ``directory``."""
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def group_32_recipe(directory: Path, stem: str) -> Path:
    """The W4A16 recipe ``stem`` with groups of 32 inputs, so that stories260K's 64-input
    layers really are quantized (W4A16's groups of 128 divide none of them, which
    whisper-prune refuses); its 172-input down_proj stays in 16-bit."""
    recipe = directory / f"{stem}_g32.yaml"
    text = (RECIPES / f"{stem}.yaml").read_text()
    ignore = (
        "ignore: [\"lm_head\", 're:.*mlp\\.gate$', 're:.*router(\\.layer)?$', 're:.*_expert_gate$']"
    )
    old = f"      scheme: W4A16\n      {ignore}"
    assert old in text, stem
    recipe.write_text(
        text.replace(
            old,
            (
                '      ignore: ["lm_head", "re:.*down_proj$"]\n'
                "      config_groups:\n"
                "        group_0:\n"
                '          targets: ["Linear"]\n'
                "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group,"
                " group_size: 32}"
            ),
        )
    )
    return recipe


def dense_state_dict(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every layer that a plain ``from_pretrained`` kept
    compressed for the CPU op (``CpuSparse24Linear``, ``CpuBitmaskLinear``) as its dense
    ``weight``, decompressed by the format: the weights to compare, whichever way the layer
    loaded."""
    from whisper_sparse.cpu.linear import CpuBitmaskLinear, CpuSparse24Linear
    from whisper_sparse.format.bitmask import decompress_bitmask
    from whisper_sparse.format.two_four import decompress_24

    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, (CpuSparse24Linear, CpuBitmaskLinear)):
            continue
        shape = (module.out_features, module.in_features)
        parts = [module.compressed, module.bitmask]
        if isinstance(module, CpuBitmaskLinear):
            parts.append(module.row_offsets)
            del state[f"{name}.row_offsets"]
        for part in ("compressed", "bitmask", "shape"):
            del state[f"{name}.{part}"]
        decompress = decompress_bitmask if len(parts) == 3 else decompress_24
        state[f"{name}.weight"] = decompress(*parts, shape, name)
    return state


def run_emulated_kernel_check(
    tmp_path: Path, sources: list[Path], emulated: bool = True, defines: tuple[str, ...] = ()
) -> None:
    """Build a tests/native checker with its kernel sources against avx512_emulation.h (the
    AVX-512 intrinsics in plain C++, lane by lane; ``emulated`` False: the CPU's own, for
    kernels this CPU runs) under AddressSanitizer, run it, and assert that it printed OK
    (each failure is a line of its output). ``defines``: ``-D`` arguments."""
    import subprocess

    from whisper_sparse.cpu import build as cpu_build
    from whisper_sparse.cpu.build import SOURCE_DIR

    compiler = cpu_build._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    native = Path(__file__).with_name("native")
    command = [
        compiler,
        "-O1",
        "-fsanitize=address",
        "-std=c++17",
        "-ffp-contract=off",
        "-I",
        str(SOURCE_DIR),
        "-I",
        str(native),
        *(['-DWS_EMULATE_INTRINSICS="avx512_emulation.h"'] if emulated else []),
        *(f"-D{define}" for define in defines),
        *map(str, sources),
        "-o",
        str(tmp_path / "check"),
    ]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    done = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "OK", (done.stdout + done.stderr)[-3000:]
