"""The modifier layer's shape (docs/design.md, "The modifier layer"), and its statistics
object against direct sums."""

import ast

import torch

from conftest import REPO
from whisper_modifiers.modifiers import MODIFIERS
from whisper_modifiers.modifiers.baselines import SparseGPTBaselineModifier, WandaBaselineModifier
from whisper_modifiers.modifiers.calibration_statistics import CalibrationStatistics
from whisper_modifiers.statistics import mean_over_sequences

MODIFIERS_DIR = REPO / "src" / "whisper_modifiers" / "modifiers"
# what the modifiers must not import: saving, output directories, checkpoints, CLIs, serving
ABOVE_THE_MODIFIERS = (
    "saving",
    "output_dir",
    "checkpoint",
    "cli",
    "diagnose_cli",
    "recipes",
    "preflight",
    "methods",
)


def test_no_modifier_chain_holds_more_than_four_classes_of_ours():
    for cls in (*MODIFIERS, WandaBaselineModifier, SparseGPTBaselineModifier):
        ours = [c.__name__ for c in cls.__mro__ if c.__module__.startswith("whisper_modifiers")]
        assert len(ours) <= 4, (cls.__name__, ours)


def test_the_modifiers_import_no_saving_or_serving_code():
    for path in sorted(MODIFIERS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "whisper_modifiers" and len(parts) > 1:
                    assert parts[1] not in ABOVE_THE_MODIFIERS, f"{path.name} imports {name}"
                assert parts[0] != "whisper_sparse", f"{path.name} imports {name} (serving)"


def _sequences(generator, count, tokens=5, width=4):
    return [torch.randn(1, tokens, width, generator=generator) for _ in range(count)]


def test_statistics_copy_subtract_reduce_and_drop_are_direct_sums():
    """A fold's complement (``without``) is the sum over the other sequences, and
    ``reduce`` gives ``mean_over_sequences`` of it: 2 X X^T / N for a Gram, ||X_j||^2 / N
    for channel norms; a copy shares no tensor; ``drop`` and ``keep_only`` forget
    modules."""
    generator = torch.Generator().manual_seed(0)
    gate, up = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    sequences = _sequences(generator, 6)
    everything, fold = CalibrationStatistics(), CalibrationStatistics()
    for index, x in enumerate(sequences):
        for statistics in (everything, fold) if index % 3 == 0 else (everything,):
            statistics.add_hessian(gate, x)
            statistics.add_channel_norms(up, x)
    copied = everything.copy([gate, up])
    others = [x[0].double() for i, x in enumerate(sequences) if i % 3]
    remaining = everything.without(fold)
    assert remaining[gate].hessian.count == len(others) == 4
    gram = sum(x.t() @ x for x in others)
    torch.testing.assert_close(remaining[gate].hessian.total, gram, rtol=1e-6, atol=1e-6)
    remaining.reduce([gate, up])
    assert torch.equal(
        remaining[gate].hessian.total,
        mean_over_sequences(everything[gate].hessian.total - fold[gate].hessian.total, 4, 2.0),
    )
    norms = sum(x.square().sum(dim=0) for x in others) / 4
    torch.testing.assert_close(remaining[up].channel_norms.total, norms.float())
    assert torch.equal(copied[gate].hessian.total, everything[gate].hessian.total)
    copied[gate].hessian.total.zero_()
    assert everything[gate].hessian.total.abs().sum() > 0  # the copy shares no tensor
    everything.drop(gate)
    assert list(everything) == [up]
    everything.keep_only([])
    assert len(everything) == 0


def test_whisper_keeps_its_grams_offloaded_with_offload_hessians():
    from whisper_modifiers.modifiers import WhisperModifier, WispModifier

    assert WhisperModifier(sparsity=0.5, offload_hessians=True).new_statistics().offload_grams
    assert not WhisperModifier(sparsity=0.5).new_statistics().offload_grams
    assert not WispModifier(sparsity=0.5).new_statistics().offload_grams
