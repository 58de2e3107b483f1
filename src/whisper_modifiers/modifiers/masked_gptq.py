"""GPTQ after pruning, in the same recipe, without refilling the pruned weights.

``MaskedGPTQModifier`` is llmcompressor's ``GPTQModifier`` (same fields, calibration,
batching, distributed path and checkpoint format) whose solver is
``masked_quantize_weight``: the OBS update is restricted to the weights the pruning
modifier kept. ``validation.check_mask_kept`` refuses a recipe in which the stock
``GPTQModifier`` follows a pruning modifier: stock GPTQ moves pruned weights off zero
(measured on stories260K: Whisper 2:4 then GPTQ W8A8 left 0.5 % of the groups of four
with more than two nonzeros), so the checkpoint would claim a pattern it does not have.
An error, not a warning: the result is silently wrong for every 2:4 kernel, and the fix
is one word in the recipe.
"""

from __future__ import annotations

from unittest import mock

from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.gptq import base as gptq_base

from whisper_modifiers.modifiers.masked_gptq_quantize import masked_quantize_weight

__all__ = ["MaskedGPTQModifier"]


class MaskedGPTQModifier(GPTQModifier):
    """GPTQ that keeps every zero the preceding pruning modifier left: SparseGPT's joint
    sparsify-and-quantize with the mask fixed (``masked_quantize_weight``). All fields are
    ``GPTQModifier``'s.

    Sample yaml (one stage: prune, then quantize the kept weights):

    ```yaml
    sparsity_stage:
      sparsity_modifiers:
        WhisperModifier:
          sparsity: 0.5
          mask_structure: "2:4"
        MaskedGPTQModifier:
          targets: ["Linear"]
          scheme: W4A16
          ignore: ["lm_head"]
    ```
    """

    def compress_module_list(self, module_list):
        # llmcompressor's loop (batches, observers, qparams) with our solver in it
        with mock.patch.object(gptq_base, "quantize_weight", masked_quantize_weight):
            super().compress_module_list(module_list)
