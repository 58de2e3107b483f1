"""Random-weight Llama decoders pruned by magnitude, for the speed benchmarks.

``pruned_llama`` builds a Llama shaped as one of ``LLAMA_SIZES`` with every decoder Linear
pruned 2:4 (``prune_24``); ``prune_unstructured`` prunes a weight to any sparsity.
``sparse_kernels.py`` (GPU) and ``vllm_speed.py`` (the vLLM engines) time them, and the
serving tests build their tiny stand-in from them.
"""

from __future__ import annotations


def prune_24(weight):
    """Magnitude 2:4 along the inputs."""
    import torch

    groups = weight.reshape(-1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.abs().topk(2, dim=1).indices, True)
    return (groups * keep).reshape(weight.shape)


def prune_unstructured(weight, sparsity: float):
    """Magnitude pruning of the whole layer: its ``sparsity`` smallest values set to zero."""
    magnitude = weight.abs().float()
    count = round(sparsity * weight.numel())
    if count == 0:
        return weight.clone()
    threshold = magnitude.flatten().kthvalue(count).values
    return weight * (magnitude > threshold)


LLAMA_SIZES = {  # hidden, intermediate, heads, vocabulary
    "7b": (4096, 11008, 32, 32000),  # Llama-2-7B
    "1b": (2048, 5632, 16, 32000),  # TinyLlama-1.1B's layers: CPU runs (12 layers: 1.2 GB bf16)
    "tiny": (128, 256, 2, 512),  # a stand-in for CPU smoke runs
}


def decoder_linear_names(model) -> list[str]:
    """The decoder layers' Linear modules (attention and MLP projections), by name."""
    import torch

    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in name
    ]


def pruned_llama(layers: int, dtype, size: str = "7b", device: str = "cuda"):
    """A Llama decoder of ``layers`` layers shaped as ``LLAMA_SIZES[size]``, random weights,
    every decoder Linear pruned 2:4 by magnitude (``prune_24``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, heads, vocab = LLAMA_SIZES[size]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        dtype=dtype,
    )
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name in decoder_linear_names(model):
            weight = model.get_submodule(name).weight
            weight.copy_(prune_24(weight))
    return model
