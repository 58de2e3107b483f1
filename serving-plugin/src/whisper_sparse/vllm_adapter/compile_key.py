"""The plugin's part of vLLM's compile-cache key.

vLLM keys its compiled graphs (``torch_compile_cache/<hash>``, and the AOT artifacts it
loads without tracing again) by ``VllmConfig.compute_hash()``, which hashes the
checkpoint's config but not this plugin's choices. Yet they change the graph: the kernel
mode (``$WHISPER_MODIFIERS_SPARSE``) decides whether a 2:4 layer calls the sparse op at
all, and a layer's ``DispatchPlan`` numbers are arguments of that op, so constants of the
compiled graph. A graph compiled in one mode and loaded in another crashed inside vLLM's
compiled forward (``KeyError: 'sparse_kernel'``). ``note_layer`` therefore records the
mode and every layer's plan in ``vllm_config.additional_config``, which ``compute_hash``
includes: another mode or other plans give another key, the same ones the same key.
``compilation_mode`` names the mode an engine compiles in (``NONE``: eager), as the
serving worker and the speed benchmark report it.

Standard library only.
"""

from __future__ import annotations

__all__ = ["COMPILE_KEY", "compilation_mode", "note_layer", "noted_layers"]

# the entry of vLLM's ``additional_config`` that holds this plugin's factors
COMPILE_KEY = "whisper_modifiers_sparse24"


def note_layer(vllm_config, layer: str, mode: str, plan: dict | None) -> None:
    """Record that the 2:4 ``layer`` runs in kernel ``mode`` with the dispatch ``plan``
    (a ``DispatchPlan`` as a dict; None where it runs vLLM's dense path) in the compile-cache
    key of ``vllm_config``: ``additional_config[COMPILE_KEY]`` holds the mode and every
    layer's plan (a few KB for a 7B model, hashed with the rest of the config)."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise TypeError(
            "vLLM's additional_config is not a dict here, so the 2:4 plugin cannot add its "
            f"kernel mode and plans to the compile-cache key; got {type(extra).__name__}"
        )
    entry = extra.setdefault(COMPILE_KEY, {"mode": mode, "layers": {}})
    entry["mode"] = mode
    entry["layers"][layer] = "dense" if plan is None else plan


def noted_layers(worker) -> dict:
    """Each layer's kernel as ``note_layer`` recorded it in a vLLM ``worker``'s config (layer
    -> ``"dense"`` or its plan): what ``LLM.collective_rpc`` asks of each rank, whose layers
    load in its own process."""
    extra = worker.vllm_config.additional_config
    return extra.get(COMPILE_KEY, {}).get("layers", {}) if isinstance(extra, dict) else {}


def compilation_mode(vllm_config) -> str:
    """The name of the compilation mode ``vllm_config`` runs in (``NONE``: eager; vLLM's
    default on a CPU compiles with torch.compile)."""
    mode = vllm_config.compilation_config.mode
    return getattr(mode, "name", str(mode))
