"""2:4 GEMM kernels (``whisper_sparse.gpu.kernels``): the dense fallback, the dispatch, the
layout around cuSPARSELt's call; the CUDA tests run where CUDA (sm80+) exists.

Self-contained (no shared data): the CUDA part also runs with ``--noconftest`` on a GPU
machine without ../shared.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from whisper_sparse import mode
from whisper_sparse.format.two_four import NotTwoFourError
from whisper_sparse.gpu import dispatch_plans, kernels, sparse_op

CUDA_24 = torch.cuda.is_available() and sparse_op.sparse_kernel_available("cuda", torch.bfloat16)
needs_cuda = pytest.mark.skipif(not CUDA_24, reason="needs CUDA sm80+ with cuSPARSELt")

SHAPES = [
    (12288, 4096),
    (4096, 4096),
    (22016, 4096),
    (4096, 11008),  # Llama 7B (vLLM-fused)
    (6144, 4096),
    (28672, 4096),
    (4096, 14336),  # 8B
    (10240, 8192),
    (8192, 8192),
    (57344, 8192),
    (8192, 28672),
]  # 70B
TOKENS = [1, 3, 8, 13, 16, 64, 100, 256, 257, 1024, 2048, 4096, 16384]


def prune_24(weight: torch.Tensor) -> torch.Tensor:
    groups = weight.reshape(-1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.abs().topk(2, dim=1).indices, True)
    return (groups * keep).reshape(weight.shape)


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=96,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.copy_(prune_24(module.weight))
    return model


# ---- CPU: exact fallback, dispatch, layout -----------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_fallback_is_exactly_f_linear(bias):
    weight = prune_24(torch.randn(48, 64))
    b = torch.randn(48) if bias else None
    layer = kernels.Sparse24Linear(weight, b)
    assert layer.compressed is None and layer.dense is weight or torch.equal(layer.dense, weight)
    for shape in [(1, 64), (7, 64), (2, 5, 64)]:
        x = torch.randn(*shape)
        assert torch.equal(layer(x), F.linear(x, weight, b))
    assert torch.equal(layer.linear(x, None), F.linear(x, weight))


def test_accelerate_replaces_two_four_linears_and_keeps_the_model_exact_on_cpu():
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        before = model(ids).logits
    replaced = kernels.accelerate(model)
    assert len(replaced) == 2 * 7  # q, k, v, o, gate, up, down per layer; not lm_head
    assert "lm_head" not in replaced and type(model.lm_head) is torch.nn.Linear
    assert all(isinstance(model.get_submodule(name), kernels.Sparse24Linear) for name in replaced)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_accelerate_leaves_layers_that_are_not_two_four():
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.fill_(1.0)
    replaced = kernels.accelerate(model, include=lambda name: "mlp" in name)
    assert "model.layers.0.mlp.up_proj" not in replaced
    assert len(replaced) == 2 * 3 - 1 and all("mlp" in name for name in replaced)


def test_fused_group_gives_each_layer_its_own_result_whatever_the_call_pattern():
    linears = [torch.nn.Linear(32, n, bias=True) for n in (16, 8, 8)]
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(prune_24(linear.weight))
    fused = kernels.FusedSparse24Linear(linears)
    parts = [kernels.FusedPart(fused, i) for i in range(3)]
    gemms = []
    forward = fused.kernel.forward
    fused.kernel.forward = lambda x: gemms.append(x) or forward(x)
    x, other = torch.randn(5, 32), torch.randn(5, 32)
    expected = [linear(x) for linear in linears]
    got = [part(x) for part in parts]  # one GEMM for the three
    assert len(gemms) == 1 and fused._input is None  # nothing held after the last part
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # interleaved inputs and a part asked twice: each answer is still its own
    assert torch.allclose(parts[0](x), expected[0], atol=1e-6)
    assert torch.allclose(parts[1](other), linears[1](other), atol=1e-6)
    assert torch.allclose(parts[1](other), linears[1](other), atol=1e-6)
    assert torch.allclose(parts[2](x), expected[2], atol=1e-6)
    assert len(gemms) == 5


def test_accelerate_fuses_only_where_the_sparse_kernel_runs():
    model = tiny_llama()
    kernels.accelerate(model)  # CPU: no kernel, so nothing to gain from fusing
    assert type(model.model.layers[0].self_attn.q_proj) is kernels.Sparse24Linear


def test_sparse24_linear_is_a_custom_op_that_compiles_whole():
    weight = prune_24(torch.randn(32, 64))
    layer = kernels.Sparse24Linear(weight)
    x = torch.randn(3, 5, 64)
    torch.library.opcheck(sparse_op.sparse24_linear, (x, None, weight, None, 32, 1 << 62, [1], [0]))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def table(pairs):
    return [
        {"tokens": t, "algorithm": i, "dense_ms": d, "sparse_ms": s}
        for i, (t, d, s) in enumerate(pairs)
    ]


def test_plan_runs_dense_where_the_table_says_dense_is_faster():
    plan = dispatch_plans.plan_from_timings(
        table(
            [
                (1, 1.0, 1.3),
                (16, 1.0, 1.2),
                (256, 1.0, 0.9),
                (512, 1.0, 0.99),  # 0.99 > margin
                (1024, 2.0, 1.4),
                (4096, 8.0, 5.0),
            ]
        )
    )
    assert plan.sparse_from == 1024 and plan.uses_dense()
    assert plan.ladder == (1, 16, 256, 512, 1024, 4096)
    pick = lambda t: sparse_op._dispatch(t, plan.sparse_from, plan.ladder, plan.algorithms)  # noqa: E731
    assert [pick(t) for t in (1, 15, 300, 1023)] == [None] * 4
    assert (pick(1024), pick(4095), pick(4096), pick(10**6)) == (4, 4, 5, 5)


def test_plan_never_sparse_when_the_largest_count_loses_and_always_when_none_loses():
    assert (
        dispatch_plans.plan_from_timings(table([(1, 1.0, 0.5), (4096, 1.0, 1.1)])).sparse_from
        > 1e15
    )
    plan = dispatch_plans.plan_from_timings(table([(1, 1.0, 0.5), (4096, 1.0, 0.6)]))
    assert plan.sparse_from == 1 and not plan.uses_dense()


def test_layout_around_the_sparse_call_matches_a_reference(monkeypatch):
    """Padding to the operand granularity, the transposed view, the row slice, leading
    dimensions and the bias, with cuSPARSELt replaced by its definition on CPU."""
    calls = []

    def reference_matmul(compressed, x2d, algorithm):  # compressed = the dense weight here
        assert x2d.shape[0] % 8 == 0 and x2d.t().stride() == (1, x2d.shape[1])
        calls.append((x2d.shape[0], algorithm))
        return (compressed @ x2d.t()).t().contiguous()

    monkeypatch.setattr(sparse_op, "sparse_matmul", reference_matmul)
    weight, bias = prune_24(torch.randn(24, 32, dtype=torch.float64)), torch.randn(24).double()
    plan = dispatch_plans.plan_from_timings(table([(1, 1.0, 2.0), (8, 1.0, 0.5), (64, 1.0, 0.5)]))
    for shape in [(3, 32), (8, 32), (2, 13, 32), (65, 32)]:
        x = torch.randn(*shape, dtype=torch.float64)
        for b in (None, bias):
            y = sparse_op.sparse24_linear(
                x, weight, weight, b, 24, plan.sparse_from, list(plan.ladder), list(plan.algorithms)
            )
            torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-12, atol=1e-12)
    tokens = [c[0] for c in calls]
    assert set(tokens) == {8, 32, 72}  # 3 tokens ran dense; 26 padded to 32, 65 to 72
    assert {a for t, a in calls if t == 72} == {2}  # 65 tokens: the 64-token algorithm


def test_kernel_mode_is_checked(monkeypatch):
    monkeypatch.delenv(mode.KERNEL_MODE_VARIABLE, raising=False)
    monkeypatch.setenv(mode.KERNEL_MODE_VARIABLE, "fast")
    with pytest.raises(ValueError, match="WHISPER_MODIFIERS_SPARSE='fast' is not one of auto"):
        mode.kernel_mode()
    monkeypatch.setenv(mode.KERNEL_MODE_VARIABLE, "Sparse")
    assert mode.kernel_mode() == "sparse"
    assert kernels.serving_kernel(prune_24(torch.randn(16, 16))) is None  # CPU: vLLM's own path


def test_the_kernel_modes_old_variable_still_works(monkeypatch):
    """``$WHISPER_MODIFIERS_SPARSE24``, the variable's name before unstructured layers: read
    where the new one is unset, checked, and an error where the two disagree."""
    monkeypatch.delenv(mode.KERNEL_MODE_VARIABLE, raising=False)
    monkeypatch.setenv(mode.LEGACY_KERNEL_MODE_VARIABLE, "dense")
    assert mode.kernel_mode() == "dense"
    monkeypatch.setenv(mode.LEGACY_KERNEL_MODE_VARIABLE, "fast")
    with pytest.raises(ValueError, match="WHISPER_MODIFIERS_SPARSE24='fast' is not one of"):
        mode.kernel_mode()
    monkeypatch.setenv(mode.LEGACY_KERNEL_MODE_VARIABLE, "dense")
    monkeypatch.setenv(mode.KERNEL_MODE_VARIABLE, "dense")
    assert mode.kernel_mode() == "dense"
    monkeypatch.setenv(mode.KERNEL_MODE_VARIABLE, "sparse")
    with pytest.raises(ValueError, match="disagree"):
        mode.kernel_mode()


def test_plan_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("WHISPER_MODIFIERS_CACHE", str(tmp_path))
    path = dispatch_plans.plan_cache_file()
    assert path.parent == tmp_path
    dispatch_plans._write_plans(
        path, {"k": {"sparse_from": 256, "ladder": [1, 256], "algorithms": [0, 3]}}
    )
    assert dispatch_plans._read_plans(path)["k"]["algorithms"] == [0, 3]
    path.write_text("{broken")
    assert dispatch_plans._read_plans(path) == {}


def test_sparse_kernel_needs_cuda_and_sixteen_bits():
    assert not sparse_op.sparse_kernel_available("cpu", torch.bfloat16)
    if torch.cuda.is_available():
        assert not sparse_op.sparse_kernel_available("cuda", torch.float32)


# ---- CUDA ----------------------------------------------------------------------------------


def cuda_weight(shape, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return prune_24(torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator))


def assert_bf16_close(actual, expected):
    scale = expected.float().abs().max().clamp_min(1e-6)
    assert ((actual.float() - expected.float()).abs().max() / scale).item() < 2e-2


@needs_cuda
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_sparse_path_matches_dense_for_every_benchmark_shape(shape):
    weight = cuda_weight(shape)
    always = kernels.Sparse24Linear(weight, keep_dense=False)
    assert always.dense is None and not always.plan.uses_dense()
    for tokens in TOKENS:
        x = torch.randn(tokens, shape[1], device="cuda", dtype=torch.bfloat16)
        y = always(x)
        assert y.shape == (tokens, shape[0]) and y.is_contiguous()
        assert_bf16_close(y, F.linear(x, weight))


@needs_cuda
def test_cuda_dispatch_bias_leading_dims_and_graph_capture(tmp_path, monkeypatch):
    monkeypatch.setenv("WHISPER_MODIFIERS_CACHE", str(tmp_path))
    weight, bias = (
        cuda_weight((4096, 4096), 1),
        torch.randn(4096, device="cuda", dtype=torch.bfloat16),
    )
    layer = kernels.Sparse24Linear(weight, bias)  # measures a plan (and caches it)
    assert layer.plan.uses_dense() == (layer.dense is not None)
    assert dispatch_plans.plan_cache_file().is_file()
    for shape in [(1, 4096), (2, 3, 4096), (5, 513, 4096), (4, 1024, 4096)]:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        assert_bf16_close(layer(x), F.linear(x, weight, bias))
    # a graph captured for each side of the dispatch replays the right result
    for tokens in (7, 2053):
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        always = kernels.Sparse24Linear(weight, bias, keep_dense=False, plan=layer.plan)
        for module in (layer, always):
            module(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = module(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert_bf16_close(y, F.linear(x, weight, bias))


@needs_cuda
def test_cuda_accelerated_llama_matches_dense_and_compiles():
    model = tiny_llama().to("cuda", torch.bfloat16)
    # widths of the tiny model are multiples of 16, so every layer takes the kernel
    ids = torch.randint(0, 96, (3, 37), device="cuda")
    with torch.no_grad():
        before = model(ids).logits
        kernels.accelerate(model, keep_dense=False)
        assert isinstance(model.model.layers[0].self_attn.q_proj, kernels.FusedPart)
        assert isinstance(model.model.layers[1].mlp.up_proj, kernels.FusedPart)
        assert all(
            m.compressed is not None
            for m in model.modules()
            if isinstance(m, kernels.Sparse24Linear)
        )
        assert_bf16_close(model(ids).logits, before)
        compiled = torch.compile(model, backend="aot_eager")
        assert_bf16_close(compiled(ids).logits, before)


@needs_cuda
def test_cuda_refuses_a_weight_that_is_not_two_four():
    weight = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotTwoFourError, match="weight is not exactly 2:4"):
        kernels.Sparse24Linear(weight)


def test_compile_key_records_the_mode_and_every_plan():
    from types import SimpleNamespace

    from whisper_sparse.vllm_adapter.compile_key import COMPILE_KEY, note_layer

    config = SimpleNamespace(additional_config={"other": 1})
    note_layer(config, "a", "auto", {"sparse_from": 256, "ladder": [1, 256], "algorithms": [0, 1]})
    note_layer(config, "b", "auto", None)
    assert config.additional_config["other"] == 1
    assert config.additional_config[COMPILE_KEY] == {
        "mode": "auto",
        "layers": {
            "a": {"sparse_from": 256, "ladder": [1, 256], "algorithms": [0, 1]},
            "b": "dense",
        },
    }
    with pytest.raises(TypeError, match="additional_config is not a dict"):
        note_layer(SimpleNamespace(additional_config=None), "a", "auto", None)
