"""``gamma: auto``'s model check: the baseline's model against the same model with the
chosen gammas, by the language-model loss on the held-out sequences.

Each layer's gamma is chosen by its gated MLP block's output error (``selection``), a
proxy of what the model loses, and a per-seed perplexity reacts to much more than that
proxy sees: at 2:4 on SmolLM2-135M, Wanda's perplexity moves by 4 % when one of its 32
calibration sequences is dropped (docs/gamma.md). A layer that leaves gamma 1 changes the
activations every later layer is calibrated on, so it moves the whole model by about that
much, whichever way, even where its block error fell. So, with ``gamma_model_check``:

* a module whose gamma was chosen other than the reference (the largest candidate, gamma
  1: the baseline) is solved at the reference, and the pipeline propagates those
  weights, so every later layer is calibrated on the baseline's activations; its solve
  at the chosen gamma (same statistics: every calibration sequence) is kept on the CPU
  (``defer_choice``);
* after the last layer the model is the baseline's, bit for bit; the held-out sequences
  (the measured folds) go through it, then through it with the chosen weights swapped
  in, and each sequence's mean next-token loss is taken (``sequence_losses``);
* the chosen weights stay only if they lower the mean loss per sequence by more than
  ``gamma_evidence`` standard errors of the paired difference (``selection``'s rule,
  pooled over ranks); otherwise the model stays the baseline's.

Both models saw the held-out sequences in their final statistics, so the check compares
two models fitted alike on data both saw; it decides between the two, nothing more. It
costs one more solve per module that left the reference and two forward passes of the
model over the held-out sequences; nothing when no module left it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from compressed_tensors.utils import (
    align_module_device,
    get_execution_device,
    update_offload_parameter,
)
from llmcompressor.modifiers.utils.hooks import HooksMixin
from loguru import logger
from pydantic import BaseModel, PrivateAttr

from whisper_modifiers.modifiers.distributed import all_reduce_sum, sequence_offset
from whisper_modifiers.selection import select_gamma

__all__ = ["ModelCheck", "held_out_sequences", "sequence_losses"]

LOSS_CHUNK = 512
"""Tokens per chunk of the LM head's logits (a large vocabulary's logits stay small)."""


class ModelCheck(BaseModel):
    """The ``gamma_model_check`` field of ``gamma: auto`` and its glue (module docstring);
    relies on the host's ``candidate_weights``, ``_fold_of``, ``gamma_evidence``,
    ``_chosen_gammas`` (the gamma each module is solved with), ``_gamma_record`` and
    ``_module_names``."""

    gamma_model_check: bool = True

    _chosen_weights: dict[torch.nn.Module, torch.Tensor] = PrivateAttr(default_factory=dict)

    def defer_choice(self, group: list[torch.nn.Module], chosen: float, reference: float):
        """With the model check on: solve ``group`` at its ``chosen`` gamma with the
        statistics held now and keep the weights (on the CPU) for the check, and have the
        layer solved, propagated and recorded at the ``reference`` until the check."""
        if not self.gamma_model_check:
            return
        for module, weight in self.candidate_weights(group, [chosen])[0].items():
            self._chosen_weights[module] = weight.detach().to("cpu", copy=True)
            self._chosen_gammas[module] = reference
            self._gamma_record[self._module_names[module]]["gamma"] = reference

    def check_model(self, model: torch.nn.Module, dataloader: Iterable | None) -> None:
        """Keep the baseline's model, or swap in the chosen weights (module docstring).
        Every rank holds the same deferred modules, so every rank takes part in the same
        collectives."""
        chosen, self._chosen_weights = self._chosen_weights, dict()
        if not chosen:
            return
        if dataloader is None:
            raise ValueError("gamma_model_check needs the calibration dataloader (oneshot's)")
        start = time.perf_counter()
        sequences = held_out_sequences(dataloader, sequence_offset(), self._fold_of)
        reference = {module: module.weight.detach().to("cpu", copy=True) for module in chosen}
        reference_losses = sequence_losses(model, sequences)
        _write(chosen)
        chosen_losses = sequence_losses(model, sequences)
        verdict, means, standard_errors, _ = select_gamma(
            [0.0, 1.0], [torch.stack([chosen_losses, reference_losses])], self.gamma_evidence,
            all_reduce_sum,
        )  # fmt: skip
        if verdict != 0.0:
            _write(reference)
        record = {
            "held_out_loss": {"chosen": means[0.0], "reference": means[1.0]},
            "difference_se": standard_errors[0.0],
            "kept": "chosen" if verdict == 0.0 else "reference",
        }
        for module in chosen:
            entry = self._gamma_record[self._module_names[module]]
            if verdict == 0.0:
                self._chosen_gammas[module] = entry["chosen_gamma"]
            entry["gamma"], entry["model_check"] = self._chosen_gammas[module], record
        logger.info(
            f"gamma: auto's model check over {len(chosen)} modules: held-out loss "
            f"{means[1.0]:.5f} with the reference gamma, {means[0.0]:.5f} with the chosen "
            f"gammas (standard error of the difference {standard_errors[0.0]:.2g}); kept "
            f"the {record['kept']} weights ({time.perf_counter() - start:.1f} s)"
        )


def _write(weights: dict[torch.nn.Module, torch.Tensor]) -> None:
    for module, weight in weights.items():
        update_offload_parameter(module, "weight", weight)


def held_out_sequences(dataloader: Iterable, offset: int, fold_of) -> list[tuple]:
    """``[(input_ids, attention_mask or None)]`` of the calibration sequences in a measured
    fold (``fold_of(global index)`` not None), this rank's sequences numbered from
    ``offset`` in the dataloader's order (the pipelines' order)."""
    sequences, row = [], offset
    for batch in dataloader:
        ids = batch["input_ids"]
        ids = ids if ids.dim() == 2 else ids.unsqueeze(0)
        masks = batch.get("attention_mask")
        for index in range(ids.shape[0]):
            if fold_of(row) is not None:
                mask = None if masks is None else masks.reshape(ids.shape)[index].cpu()
                sequences.append((ids[index].cpu(), mask))
            row += 1
    return sequences


@torch.no_grad()
def sequence_losses(model: torch.nn.Module, sequences: list[tuple]) -> torch.Tensor:
    """Each sequence's mean next-token negative log-likelihood under ``model`` (float64,
    ``[sequences]``), with the calibration hooks off. The logits are computed here from
    the decoder's last hidden state and the LM head's weight, chunk by chunk, so that
    this works inside llmcompressor's calibration context (which disables the LM head's
    forward) and with a large vocabulary."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    device = get_execution_device(model.get_input_embeddings())
    losses = []
    with HooksMixin.disable_hooks(), align_module_device(head):
        for ids, mask in sequences:
            batch_mask = None if mask is None else mask.unsqueeze(0).to(device)
            hidden = decoder(input_ids=ids.unsqueeze(0).to(device), attention_mask=batch_mask)
            hidden = hidden.last_hidden_state[0, :-1]
            targets = ids[1:].to(hidden.device)
            valid = torch.ones_like(targets, dtype=torch.bool)
            if mask is not None:
                valid = (mask[1:] * mask[:-1]).bool().to(hidden.device)
            total = torch.zeros((), dtype=torch.float64)
            for start in range(0, targets.shape[0], LOSS_CHUNK):
                part = slice(start, start + LOSS_CHUNK)
                logits = F.linear(hidden[part].float(), head.weight.float(),
                                  None if head.bias is None else head.bias.float())  # fmt: skip
                if cap:
                    logits = torch.tanh(logits / cap) * cap
                nll = F.cross_entropy(logits, targets[part], reduction="none")
                total += nll[valid[part]].sum(dtype=torch.float64).cpu()
            losses.append(total / valid.sum().clamp_min(1).cpu())
    return torch.stack(losses) if losses else torch.zeros(0, dtype=torch.float64)
