"""``gamma: auto``'s model check: the baseline's model against the same model with the
chosen gammas, by the language-model loss on the held-out sequences (why: docs/gamma.md,
"One seed at a time").

* A module whose gamma was chosen other than the reference (the largest candidate, gamma
  1: the baseline) is solved and propagated at the reference; its solve at the chosen
  gamma (same statistics) is kept on the CPU (``defer_choice``).
* After the last layer the model is the baseline's, bit for bit. The held-out sequences
  go through it, then through it with the chosen weights swapped in, and each
  sequence's mean next-token loss is taken (``sequence_losses``).
* The chosen weights stay only if they lower the mean loss per sequence by more than
  ``gamma_evidence`` standard errors of the paired difference (``selection``'s rule,
  pooled over ranks); otherwise the model stays the baseline's.

Neither pass starts from the embeddings where it need not: plain forward hooks on the
decoder layers keep the held-out hidden states that the pipeline's propagation pass
computes entering the last layer and the first deferred one (``watch_propagation``);
where that pass was not watched (``layerwise_pipeline.chain_fault``), a pass starts from
the embeddings. Its cost: docs/gamma.md, "What the model check costs".
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from compressed_tensors.utils import (
    align_module_device,
    get_execution_device,
    update_offload_parameter,
)
from llmcompressor.modifiers.utils.hooks import HooksMixin
from loguru import logger

from whisper_modifiers.modifiers.distributed import (
    all_reduce_sum,
    sequence_offset,
    wait_for_every_rank,
)
from whisper_modifiers.modifiers.layerwise_pipeline import chain_fault, recording_layers
from whisper_modifiers.selection import select_gamma

__all__ = ["ModelCheck", "held_out_sequences", "sequence_losses"]

LOSS_CHUNK = 512
"""Tokens per chunk of the LM head's logits (a large vocabulary's logits stay small)."""


class ModelCheck:
    """``gamma: auto``'s model check (module docstring), a part of ``selection`` (the
    ``GammaAuto`` that holds it: its host's ``candidate_weights``, ``fold_of``,
    ``gamma_evidence``, ``chosen`` gammas, ``record`` and ``module_names``)."""

    def __init__(self, selection):
        self.selection = selection
        self._chosen_weights: dict[torch.nn.Module, torch.Tensor] = {}
        self._layers: list[torch.nn.Module] = []
        self._layer_of: dict[torch.nn.Module, int] = {}
        self._watch_handles: list = []
        self._watched: int | None = None
        self._watched_row = 0
        self._entering: dict[int, list[torch.Tensor]] = {}
        self._first_deferred: int | None = None

    def watch_propagation(self, model: torch.nn.Module) -> None:
        """With the check on: a plain forward hook on each decoder layer but the last (the
        pipelines run the propagation pass with llmcompressor's hooks off) that keeps the
        held-out sequences' outputs of a layer's propagation pass: the hidden states
        entering the next layer (module docstring)."""
        layers = getattr(model.get_decoder(), "layers", None)
        self._layers = list(layers) if isinstance(layers, torch.nn.ModuleList) else []
        for index, layer in enumerate(self._layers):
            self._layer_of.update(dict.fromkeys(layer.modules(), index))
            if index + 1 < len(self._layers):
                hook = partial(self._keep_entering, index + 1)
                self._watch_handles.append(layer.register_forward_hook(hook))

    def watch_layer_propagation(self, solved: Iterable[torch.nn.Module]) -> None:
        """After a layer's solve (``solved``: its modules), watch its propagation pass
        while what it feeds can still be needed (no layer deferred yet, or the last layer
        next); keep what entered the first deferred layer and what enters the last."""
        indices = [self._layer_of[module] for module in solved if module in self._layer_of]
        if not indices:
            return
        solved_layer, last = max(indices), len(self._layers) - 1
        needed = self._first_deferred is None or solved_layer + 1 == last
        self._watched, self._watched_row = (solved_layer if needed else None), sequence_offset()
        keep = {self._first_deferred, last} - {solved_layer + 1}
        self._entering = {index: rows for index, rows in self._entering.items() if index in keep}

    def _keep_entering(self, index: int, layer, args, output) -> None:
        if self._watched != index - 1:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        for sequence in hidden if hidden.dim() == 3 else hidden.unsqueeze(0):
            if self.selection.fold_of(self._watched_row) is not None:
                rows = self._entering.setdefault(index, [])
                rows.append(sequence.detach().to("cpu", copy=True))
            self._watched_row += 1

    def stop_watching(self) -> None:
        for handle in self._watch_handles:
            handle.remove()
        self._watch_handles, self._watched = [], None

    def _entries(self, model: torch.nn.Module, sequences: list, entering: dict) -> tuple:
        """``sequence_losses``' start of the baseline's pass (the last layer) and of the
        chosen weights' pass (the first deferred layer): ``(layers skipped, hidden states
        entering the next)``, or ``()`` (from the embeddings) where the propagation pass
        (``entering``) did not give exactly the held-out sequences' hidden states there."""
        if not entering or not sequences:
            return (), ()
        device = get_execution_device(model.get_input_embeddings())
        ids, mask = sequences[0]
        batch = {"input_ids": ids.unsqueeze(0).to(device)}
        if mask is not None:
            batch["attention_mask"] = mask.unsqueeze(0).to(device)
        if chain_fault(model, self._layers, batch):
            return (), ()

        def entry(index: int | None) -> tuple:
            rows = entering.get(index)
            if not index or rows is None or len(rows) != len(sequences):
                return ()
            return self._layers[:index], rows

        return entry(len(self._layers) - 1), entry(self._first_deferred)

    def defer_choice(self, group: list[torch.nn.Module], chosen: float, reference: float):
        """Solve ``group`` at its ``chosen`` gamma with the statistics held now and keep
        the weights (on the CPU) for the check, and have the layer solved, propagated and
        recorded at the ``reference`` until the check."""
        first = min(self._layer_of.get(module, 0) for module in group)
        if self._first_deferred is None or first < self._first_deferred:
            self._first_deferred = first
        selection = self.selection
        for module, weight in selection.host.candidate_weights(group, [chosen])[0].items():
            self._chosen_weights[module] = weight.detach().to("cpu", copy=True)
            selection.chosen[module] = reference
            selection.record[selection.module_names[module]]["gamma"] = reference

    def check_model(self, model: torch.nn.Module, dataloader: Iterable | None) -> None:
        """Keep the baseline's model, or swap in the chosen weights (module docstring).
        Every rank holds the same deferred modules, so every rank takes part in the same
        collectives."""
        chosen, self._chosen_weights = self._chosen_weights, dict()
        entering, self._entering = self._entering, dict()
        self.stop_watching()
        if not chosen:
            return
        if dataloader is None:
            raise ValueError("gamma_model_check needs the calibration dataloader (oneshot's)")
        start = time.perf_counter()
        selection = self.selection
        sequences = held_out_sequences(dataloader, sequence_offset(), selection.fold_of)
        last, first = self._entries(model, sequences, entering)
        reference = {module: module.weight.detach().to("cpu", copy=True) for module in chosen}
        reference_losses = sequence_losses(model, sequences, *last)
        wait_for_every_rank()  # the ranks may share the weights (``distributed``)
        _write(chosen)
        chosen_losses = sequence_losses(model, sequences, *first)
        verdict, means, standard_errors, _ = select_gamma(
            [0.0, 1.0],
            [torch.stack([chosen_losses, reference_losses])],
            selection.gamma_evidence,
            all_reduce_sum,
        )
        if verdict != 0.0:
            _write(reference)
        record = {
            "held_out_loss": {"chosen": means[0.0], "reference": means[1.0]},
            "difference_se": standard_errors[0.0],
            "kept": "chosen" if verdict == 0.0 else "reference",
        }
        for module in chosen:
            entry = selection.record[selection.module_names[module]]
            if verdict == 0.0:
                selection.chosen[module] = entry["chosen_gamma"]
            entry["gamma"], entry["model_check"] = selection.chosen[module], record
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
def sequence_losses(
    model: torch.nn.Module,
    sequences: list[tuple],
    skipped: list[torch.nn.Module] = (),
    entering: list[torch.Tensor] = (),
) -> torch.Tensor:
    """Each sequence's mean next-token negative log-likelihood under ``model`` (float64,
    ``[sequences]``), with the calibration hooks off. The logits are computed here from
    the decoder's last hidden state and the LM head's weight, chunk by chunk, so that
    this works inside llmcompressor's calibration context (which disables the LM head's
    forward) and with a large vocabulary. With ``skipped`` (the first decoder layers),
    those layers are not run: the decoder goes on from ``entering`` (each sequence's
    hidden state after them, ``[tokens, d]``)."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    device = get_execution_device(model.get_input_embeddings())
    losses = []
    with HooksMixin.disable_hooks(), align_module_device(head):
        for index, (ids, mask) in enumerate(sequences):
            batch_mask = None if mask is None else mask.unsqueeze(0).to(device)
            after = entering[index].unsqueeze(0).to(device) if skipped else None

            def replay(layer_index, hidden, after=after):
                return after if layer_index == len(skipped) - 1 else hidden

            with recording_layers(list(skipped), [], replay):
                hidden = decoder(input_ids=ids.unsqueeze(0).to(device), attention_mask=batch_mask)
            hidden = hidden.last_hidden_state[0, :-1]
            targets = ids[1:].to(hidden.device)
            valid = torch.ones_like(targets, dtype=torch.bool)
            if mask is not None:
                valid = (mask[1:] * mask[:-1]).bool().to(hidden.device)
            total = torch.zeros((), dtype=torch.float64)
            for start in range(0, targets.shape[0], LOSS_CHUNK):
                part = slice(start, start + LOSS_CHUNK)
                logits = F.linear(
                    hidden[part].float(),
                    head.weight.float(),
                    None if head.bias is None else head.bias.float(),
                )
                if cap:
                    logits = torch.tanh(logits / cap) * cap
                nll = F.cross_entropy(logits, targets[part], reduction="none")
                total += nll[valid[part]].sum(dtype=torch.float64).cpu()
            losses.append(total / valid.sum().clamp_min(1).cpu())
    return torch.stack(losses) if losses else torch.zeros(0, dtype=torch.float64)
