"""vLLM plugin: serve compressed sparse checkpoints (``format``'s layouts).

Installed as the ``vllm.general_plugins`` entry point ``whisper_modifiers_sparse``; vLLM
calls ``register`` in every process. It registers ``vllm_adapter.config.SparseConfig``
(which says what each compressed layer runs) under ``QUANT_METHOD``, and under the name
before unstructured layers (``LegacySparseConfig``), folds vLLM's warning per weight
cast while loading (a float32 checkpoint served in bfloat16: one per tensor) into one
line, and asks Linux for the AMX tile state on CPUs with AMX (``request_amx``).
"""

from __future__ import annotations

import logging

from whisper_sparse.mode import kernel_mode

__all__ = ["CastNote", "register", "request_amx"]

_registered = False
CAST_LOGGER = "vllm.model_executor.models.utils"  # AutoWeightsLoader's dtype warning


class CastNote(logging.Filter):
    """vLLM's ``Attempted to load weight %s with dtype %s into parameter with dtype %s``,
    logged once per tensor, becomes one line the first time and nothing afterwards."""

    def __init__(self):
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not (
            isinstance(record.msg, str)
            and record.msg.startswith("Attempted to load weight")
            and len(record.args or ()) == 3
        ):
            return True
        if self.said:
            return False
        self.said = True
        _, stored, served = record.args
        record.msg = (
            "the checkpoint's %s weights are cast to %s as they load (vLLM's --dtype);"
            " this is said once for all of them"
        )
        record.args = (str(stored).removeprefix("torch."), str(served).removeprefix("torch."))
        return True


def request_amx() -> bool | None:
    """Ask the OS for the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, through
    ``torch.cpu._init_amx``) on a CPU with AMX; None elsewhere. A process must do so before
    its first tile instruction: oneDNN asks when it dispatches to AMX, but with its ISA
    capped (``ONEDNN_MAX_CPU_ISA=AVX2``) it never does while vLLM's own AMX kernels still
    run, and they die with SIGILL. False where the OS, a VM or a container refuses: the
    serving probe then refuses the dtype, naming the cause (``serving.probe``)."""
    import torch

    if not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return None
    return bool(torch.cpu._init_amx())


def register() -> None:
    """The entry point: register the quantization config with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    kernel_mode()  # a bad $WHISPER_MODIFIERS_SPARSE stops vLLM before any weight loads
    from vllm.model_executor.layers.quantization import register_quantization_config

    from whisper_sparse.vllm_adapter.config import (
        LegacySparseConfig,
        SparseConfig,
    )

    for config in (SparseConfig, LegacySparseConfig):
        register_quantization_config(config.get_name())(config)
    logging.getLogger(CAST_LOGGER).addFilter(CastNote())
    request_amx()
    _registered = True
