"""The CPU engine's shape: one factory of a layer's served form (``cpu.served_layer``), the
op taking one thresholds struct, plans read robustly from their cache, and the modules
that load a layer importing only those below them."""

import ast
import json
import logging

import pytest
import torch

from conftest import REPO
from whisper_sparse.cpu import plans as cpu_plans
from whisper_sparse.cpu.op import NO_TILES, PATHS, PathThresholds

CPU_DIR = REPO / "serving-plugin" / "src" / "whisper_sparse" / "cpu"
# the CPU engine's modules, lowest first: each imports only modules before it
CPU_ORDER = [
    "cpu_info",
    "huge_pages",
    "build",
    "op",
    "grouped_layout",
    "row_spread",
    "served_layer",
    "plan_timing",
    "plans",
    "linear",
]


def test_the_cpu_engine_imports_only_downwards():
    for position, name in enumerate(CPU_ORDER):
        tree = ast.parse((CPU_DIR / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "whisper_sparse.cpu."
            ):
                imported = node.module.split(".")[2]
                assert imported in CPU_ORDER[:position], f"{name} imports {imported}"


def test_thresholds_take_each_path_and_refuse_an_unknown_one():
    for path in PATHS:
        thresholds = PathThresholds.only(path)
        assert {thresholds.path(tokens) for tokens in (1, 16, 4096)} == {path}
    assert PathThresholds().path(10**9) == "rows"
    with pytest.raises(ValueError, match="path must be one of rows, gemm, lanes, tiles, brgemm"):
        PathThresholds.only("fast")
    with pytest.raises(TypeError):
        PathThresholds(16, 256)  # named fields only: no order to get wrong


def test_a_plan_is_the_ops_thresholds():
    plan = cpu_plans.CpuPlan(gemm_from=16, tiled_from=256, faster_at_decode=True)
    assert isinstance(plan, PathThresholds)
    assert [plan.path(tokens) for tokens in (1, 16, 256)] == ["rows", "gemm", "tiles"]
    assert plan.lanes_until == 0 and plan.brgemm_until == 0


@pytest.mark.parametrize(
    "content",
    [b'{"9|abc": {"plan": ', b"\xff\xfe not json", b"[1, 2, 3]", b"", b'{"KEY": {"plan": 3}}'],
    ids=["truncated", "not-utf8", "a-list", "empty", "a-bad-entry"],
)
def test_a_corrupt_plan_cache_is_measured_anew_with_one_line(
    tmp_path, monkeypatch, caplog, content
):
    """A truncated, garbled or foreign cache file (or entry) is no crash: the plan is measured
    again, one warning says why, and the file is written whole again."""
    cpu_plans.cpu_isa()  # the op loaded from the real cache, not built anew in tmp_path
    monkeypatch.setenv("WHISPER_MODIFIERS_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_plans, "_known", {})
    measured = []
    plan = cpu_plans.CpuPlan(tiled_from=NO_TILES, faster_at_decode=True, speedups=((1, 1.5),))

    def measure(out_features, in_features, dtype, density=None):
        measured.append((out_features, in_features))
        return plan, [{"tokens": 1}]

    monkeypatch.setattr(cpu_plans, "measure_cpu_plan", measure)
    cache = cpu_plans.plan_cache_file()
    cache.parent.mkdir(parents=True, exist_ok=True)
    if content.startswith(b'{"KEY"'):  # an entry under the very key this plan has
        key = cpu_plans.plan_key(8, 32, torch.float32, None)
        content = json.dumps({key: {"plan": 3}}).encode()
    cache.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=cpu_plans.__name__):
        assert cpu_plans.cpu_plan(8, 32, torch.float32) == plan
    assert measured == [(8, 32)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("measuring anew" in r.getMessage() for r in warnings)
    stored = json.loads(cache.read_text())
    (entry,) = [value for value in stored.values() if value.get("plan") != 3]
    assert entry["plan"]["faster_at_decode"] is True
    monkeypatch.setattr(cpu_plans, "_known", {})  # a new process reads the file written whole
    assert cpu_plans.cpu_plan(8, 32, torch.float32) == plan and len(measured) == 1


def test_the_factory_builds_the_form_this_cpu_serves(monkeypatch):
    """2:4 as stored; unstructured grouped where ``grouped_layout_runs``, else its rows
    (spread); as stored where asked; every form gives the same product, exactly on integer
    values."""
    from whisper_sparse.cpu import served_layer as factory
    from whisper_sparse.cpu.op import cpu_kernels_unavailable, grouped_layout_runs
    from whisper_sparse.format.bitmask import compress_bitmask
    from whisper_sparse.format.two_four import compress_24

    if cpu_kernels_unavailable():
        pytest.skip(cpu_kernels_unavailable())
    generator = torch.Generator().manual_seed(0)
    two_four = factory.random_two_four(24, 128, torch.bfloat16).round()
    layer = factory.served_layer(*compress_24(two_four), 128)
    assert type(layer) is factory.TwoFourLayer and layer.density() is None
    weight = torch.randint(-3, 4, (24, 128), generator=generator).to(torch.bfloat16)
    weight *= torch.rand(24, 128, generator=generator) < 0.4
    stored = compress_bitmask(weight)
    served = factory.served_layer(stored[0], stored[1], 128, stored[2])
    expected = factory.GroupedLayer if grouped_layout_runs(torch.bfloat16) else factory.RowsLayer
    assert type(served) is expected
    as_stored = factory.served_layer(stored[0], stored[1], 128, stored[2], as_stored=True)
    assert type(as_stored) is factory.RowsLayer and as_stored.compressed is stored[0]
    x = torch.randint(-3, 4, (5, 128), generator=generator).to(torch.bfloat16)
    exact = (x.double() @ weight.double().t()).to(torch.bfloat16)
    other = factory.served_layer(
        *stored[:2], 128, stored[2], grouped=not isinstance(served, factory.GroupedLayer)
    )
    for form in (served, as_stored, other):
        assert form.density() == pytest.approx(stored[0].numel() / (24 * 128))
        for path in ("rows", "tiles"):
            assert torch.equal(form.linear(x, None, PathThresholds.only(path)), exact), path
