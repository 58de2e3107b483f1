"""What the CPU benchmarks share: the Llama projections they time (``SHAPES``), this CPU's
line (``cpu_line``), vLLM's dense CPU GEMM as its unquantized layers run it
(``vllm_dense_linear``) and its dense W8A8 layer (``vllm_w8a8_linear``), and random layers
in each layout as the vLLM plugin holds them (``op_layers``). ``cpu_sparse_op.py`` times them
shape by shape, ``cpu_token_pass.py`` layer after layer; the vLLM benchmarks label their CPU
by ``cpu_line``. Imports neither loguru nor llmcompressor (a GPU machine's image has neither).
"""

from __future__ import annotations

SHAPES = {  # (out, in) of each projection as vLLM runs it
    "7B": {
        "qkv": (12288, 4096),
        "o": (4096, 4096),
        "gate_up": (22016, 4096),
        "down": (4096, 11008),
    },
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}

# cpu_sparse_op.py's --isa below this CPU's kernels caps dense alike, as torch and oneDNN run
# on such a CPU: each reads its cap once, when first used, so the process starts with these
# set (``cpu_sparse24.main`` runs itself again where they are not). Without AVX512_BF16,
# torch's bfloat16 F.linear is ATen's own GEMM on AVX2 and oneDNN's emulation on AVX-512.
DENSE_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ATEN_CPU_CAPABILITY": "avx512"},
}


def cpu_line(capped_from: str | None = None) -> str:
    """This CPU, its threads and the op's kernels; where ``--isa`` capped them below this
    CPU's own (``capped_from``), how dense was capped alike."""
    import torch

    from whisper_sparse.cpu.cpu_info import CPU_FLAGS, cpu_flag_set, cpu_model
    from whisper_sparse.cpu.op import cpu_isa

    flags = cpu_flag_set()
    shown = " ".join(flag for flag in (*CPU_FLAGS, "avx512_vbmi2") if flag in flags)
    line = f"{cpu_model()} ({shown}; {torch.get_num_threads()} threads; op kernels {cpu_isa()}"
    if capped_from is None:
        return line + ")"
    caps = " ".join(f"{name}={value}" for name, value in DENSE_CAPS[cpu_isa()].items())
    return (
        f"{line}, capped from {capped_from}; dense capped alike: {caps}, torch's CPU "
        f"capability {torch.backends.cpu.get_cpu_capability()}: an {cpu_isa()} CPU "
        "emulated, on this CPU's memory)"
    )


def vllm_dense_linear():
    """vLLM's dense CPU GEMM for a weight, as its unquantized layers run it (a oneDNN
    handle made once per weight, then ``onednn_mm``; where oneDNN makes no bfloat16 matmul,
    as on AVX2, torch's linear, vLLM's fallback), or None without vLLM's CPU ops."""
    try:
        import vllm._custom_ops as ops
    except Exception:  # no vLLM here (the pruning environment)
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    import torch

    def linear_for(weight):
        try:
            handle = ops.create_onednn_mm(weight.t(), 32)
        except RuntimeError:  # vLLM's dispatch_cpu_unquantized_gemm falls back alike
            return lambda x: torch.nn.functional.linear(x, weight)
        return lambda x: ops.onednn_mm(handle, x, None)

    return linear_for


def vllm_w8a8_linear():
    """``(weight_int8 [out, in], scales [out, 1]) -> (x -> y)`` as vLLM's CPU W8A8 layers run
    it (``vllm_adapter.w8a8.dense_w8a8_linear``; the function's ``path`` names vLLM's kernel
    for that shape), or None without vLLM's CPU int8 ops."""
    try:
        from whisper_sparse.vllm_adapter.w8a8 import dense_w8a8_linear
    except Exception:  # no vLLM here
        return None
    return dense_w8a8_linear


def run_all(calls) -> None:
    """One pass through ``calls`` (one per weight copy)."""
    for call in calls:
        call()


def op_layers(
    rows: int, columns: int, dtype, sparsity: str, copies: int, grouped: bool | None = None
):
    """``copies`` random weights of the layout (``2:4``, or unstructured at ``sparsity``),
    their compressed bytes, and ``run(x, thresholds)`` of the op on each (a
    ``PathThresholds``), each in the served form (``cpu.served_layer``): an unstructured
    layer grouped where the vLLM plugin groups it (``grouped`` None), else as ``grouped``
    says (False: its rows spread wherever). Its bytes are the checkpoint's."""
    from whisper_sparse.cpu.served_layer import (
        random_two_four,
        random_unstructured,
        served_layer,
    )
    from whisper_sparse.format.bitmask import compress_bitmask
    from whisper_sparse.format.two_four import compress_24

    if sparsity == "2:4":
        dense = [random_two_four(rows, columns, dtype, seed=i) for i in range(copies)]
        served = [served_layer(*compress_24(weight), columns) for weight in dense]
        runs = [
            lambda x, thresholds, layer=layer: layer.linear(x, None, thresholds) for layer in served
        ]
        return dense, rows * (columns // 2 * dtype.itemsize + -(-columns // 8)), runs
    density = 1 - float(sparsity)
    dense = [random_unstructured(rows, columns, dtype, density, seed=i) for i in range(copies)]
    stored = [compress_bitmask(weight) for weight in dense]
    served = [served_layer(v, b, columns, o, grouped=grouped) for v, b, o in stored]
    runs = [
        lambda x, thresholds, layer=layer: layer.linear(x, None, thresholds) for layer in served
    ]
    values, bitmask, offsets = stored[0]
    size = sum(tensor.numel() * tensor.element_size() for tensor in (values, bitmask, offsets))
    return dense, size, runs
