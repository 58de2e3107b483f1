"""Routing shared by the difference-informed modifiers.

``DifferencePruningBase`` adds to llmcompressor's ``SparsityModifierBase``:

* ``difference_targets`` -- which of the targeted Linear modules get the difference
  statistic (default: the MLP gate and up projections, paper Section 3); every other
  targeted module is pruned by the parent's standard method inside the same modifier;
* seeded pairwise differences formed within each calibration sequence (the
  ``SequencePairs`` mixin of ``sequence_pairs.py``; for an MoE expert, within each
  sequence's tokens routed to it: ``RoutedPairs``, ``moe_routing``);
* the causal mask llmcompressor's sequential pipeline loses for some families
  (``causal_mask``);
* ``gamma`` and its per-module choice ``gamma: auto`` (the ``GammaAuto`` mixin of
  ``gamma_auto.py``);
* input validation before any calibration work;
* module names without llmcompressor 0.14's trailing dot, so that ``ignore: ["lm_head"]``
  and ``$``-anchored regexes match what users expect.
"""

from __future__ import annotations

from typing import Literal

import torch
from compressed_tensors.utils import match_named_modules, match_targets
from llmcompressor.core import Event, State
from llmcompressor.modifiers.pruning.sparsegpt.sgpt_base import (
    PRUNABLE_LAYER_TYPES,
    SparsityModifierBase,
)
from loguru import logger
from pydantic import Field, PrivateAttr, model_validator

from whisper_modifiers.modifiers.causal_mask import watch_causal_masks
from whisper_modifiers.modifiers.compressed_save import CompressedSave
from whisper_modifiers.modifiers.distributed import sequence_offset
from whisper_modifiers.modifiers.gamma_auto import GammaAuto
from whisper_modifiers.modifiers.moe_routing import MoERouting
from whisper_modifiers.modifiers.routed_pairs import RoutedPairs
from whisper_modifiers.modifiers.sequence_pairs import SequencePairs
from whisper_modifiers.modifiers.sequence_sums import SequenceSumCalibration
from whisper_modifiers.modifiers.validation import (
    SparsityValidation,
    check_finite_activations,
    check_mask_kept,
    check_structure_divides,
    parse_mask_structure,
)

__all__ = ["DEFAULT_DIFFERENCE_TARGETS", "DEFAULT_IGNORE", "DifferencePruningBase"]

# the gate and up inputs of every gated MLP in transformers' families: separate (Llama,
# Qwen, Mistral, Gemma, ...) or fused into one Linear (Phi-3's gate_up_proj, Granite's
# shared input_linear: the same inputs, so the same statistic), LFM2's w1 / w3, MoE experts
# as llmcompressor runs them (experts.N.gate_proj) and shared experts; never a router
DEFAULT_DIFFERENCE_TARGETS = [
    r"re:.*((mlp|feed_forward|experts\.\d+|shared_experts?)\.(gate_proj|up_proj|gate_up_proj|w1|w3)"
    r"|shared_mlp\.input_linear)$"
]
# MoE routers and shared-expert gates stay dense by default where they are Linears
# (Qwen2-MoE's shared_expert_gate; mlp.gate and router.layer in earlier transformers)
DEFAULT_IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*router(\.layer)?$", r"re:.*_expert_gate$"]


class DifferencePruningBase(
    GammaAuto,
    SequencePairs,
    RoutedPairs,
    SparsityValidation,
    CompressedSave,
    SequenceSumCalibration,
    SparsityModifierBase,
):
    """Fields and routing common to Wisp, Wisp+ and Whisper (see those classes).

    :param difference_targets: module-name patterns (``re:`` prefix for a regex, as in
        llmcompressor's ``targets``/``ignore``) that get the difference statistic; ``[]``
        turns every module into the standard method.  Each pattern must match at least
        one targeted module. The default reaches the gate and up inputs of the gated MLPs
        of transformers' families, MoE experts and shared experts included
        (docs/families.md).
    :param seed: seed of the pair permutations; the same seed gives the same masks.
    :param num_permutations: independent permutations per calibration sequence (the
        paper's ``N = k s`` pairs, Appendix "Sampling approach details"); 1 suffices.
    :param pairing: ``"random"`` (seeded permutations, the paper's default),
        ``"nearest"`` (each token paired with its nearest other token of the sequence,
        appendix "Sampling approach details") or ``"centered"`` (the deterministic
        second-moment form of random pairing, appendix "Centering": ``||X_c,j||`` for
        Wisp, ``H_c = X_c X_c^T`` for Whisper; not defined for Wisp+).
    :param ignore: as llmcompressor's, but defaults to ``DEFAULT_IGNORE``: the LM head
        (the paper does not prune it, and tied embeddings would be pruned with it) and the
        MoE routers and shared-expert gates that are Linears in some families.
    :param gamma: weight of the standard statistic in the mixture with the difference
        statistic (see each method), or ``"auto"``: chosen per difference module from
        ``gamma_candidates`` by the held-out error of ``selection`` (a gated MLP's gate
        and up projections share one choice); the choices are in ``gamma_selection()``
        and in whisper-prune's ``sparsity_record.json``.
    :param gamma_candidates: the values ``"auto"`` chooses from (default: the method's
        ``GAMMA_CANDIDATES``); only with ``gamma: auto``.
    :param holdout_every: with ``gamma: auto``, the calibration sequences fall in
        ``holdout_every`` folds (global index ``i`` in fold ``i % holdout_every``); a
        measured fold is held out to measure the candidates, then joins the statistics
        for the final solve.
    :param gamma_folds: with ``gamma: auto``, how many folds are measured, the last
        first: 1 holds out every ``holdout_every``-th sequence once; ``holdout_every``
        is k-fold cross-validation, every sequence measured once. The measured tokens
        stay one fold's (every ``gamma_folds``-th token of each held-out sequence,
        ``selection.held_out_tokens``); each more fold costs one more solve per
        candidate, and keeps one more fold of the layer's inputs (on the CPU) and one
        more set of its difference statistics until the layer is solved.
    :param gamma_evidence: with ``gamma: auto``, how many standard errors of the paired
        per-held-out-sequence difference a candidate's mean error must beat the largest
        candidate's (the baseline's, gamma 1) by to be chosen over it; ``0`` picks the
        least error (``selection.choose_gamma``).
    :param gamma_criterion: with ``gamma: auto``, a held-out sequence's error:
        ``"relative"`` (each token's output error against its dense output's squared
        norm, averaged over tokens) or ``"absolute"`` (squared errors summed over tokens);
        ``selection.sequence_error``.
    :param gamma_model_check: with ``gamma: auto``, the layers whose gamma was chosen
        other than the reference (gamma 1) are solved and propagated at the reference, so
        the model after the last layer is the baseline's; the chosen weights are swapped
        in only if they lower the held-out sequences' language-model loss by more than
        ``gamma_evidence`` standard errors (``model_check``). ``False``: each layer keeps
        its choice at once.
    """

    difference_targets: list[str] = Field(default_factory=lambda: list(DEFAULT_DIFFERENCE_TARGETS))
    seed: int = Field(default=0, ge=0)
    num_permutations: int = Field(default=1, ge=1)
    pairing: Literal["random", "nearest", "centered"] = "random"
    ignore: list[str] = Field(default_factory=lambda: list(DEFAULT_IGNORE))

    _difference_modules: set[torch.nn.Module] = PrivateAttr(default_factory=set)
    _sequences_seen: dict[torch.nn.Module, int] = PrivateAttr(default_factory=dict)
    _calibrated: set[torch.nn.Module] = PrivateAttr(default_factory=set)

    @model_validator(mode="after")
    def _validate_pairing(self):
        if self.pairing != "random" and self.num_permutations != 1:
            raise ValueError(
                f"num_permutations applies to pairing 'random' only; pairing "
                f"{self.pairing!r} takes num_permutations: 1"
            )
        return self

    def on_initialize(self, state: State, **kwargs) -> bool:
        check_mask_kept()  # this session's recipe
        self._gamma_record = dict()
        return super().on_initialize(state, **kwargs)

    # -- routing ---------------------------------------------------------------------

    def pruned_modules(self, target_layers: dict[str, torch.nn.Module]) -> list[tuple]:
        """``(name, module, sparsity)`` of every module this modifier prunes inside
        ``target_layers`` (llmcompressor's selection, with clean names)."""
        modules = []
        for index, (layer_name, layer) in enumerate(target_layers.items()):
            sparsity = self.sparsity[index] if isinstance(self.sparsity, list) else self.sparsity
            for name, module in match_named_modules(layer, PRUNABLE_LAYER_TYPES):
                name = f"{layer_name}.{name}" if name else layer_name
                if isinstance(module, torch.nn.Embedding) or match_targets(
                    name, module, self.ignore
                ):
                    continue
                modules.append((name, module, sparsity))
        n, m = parse_mask_structure(self.mask_structure)
        check_structure_divides([(name, module) for name, module, _ in modules], n, m)
        return modules

    def check_difference_targets(self, model: torch.nn.Module) -> list[str]:
        """Resolve ``difference_targets`` against ``model`` (a meta-device model will do:
        only names and types are read) before any calibration; raises the same errors as
        calibration would. Returns the names of the difference modules."""
        modules = self.pruned_modules(dict(match_named_modules(model, self.targets)))
        selected = self._select_difference_modules(modules)
        return [name for name, module, _ in modules if module in selected]

    def on_calibration_start(self, state: State, event: Event, **kwargs):
        """Register the calibration hooks (llmcompressor's loop, with clean names)."""
        modules = self.pruned_modules(self._target_layers)
        self._difference_modules = self._select_difference_modules(modules)
        for name, module, sparsity in modules:
            if name.endswith("lm_head"):
                logger.warning(
                    f"{type(self).__name__} will prune {name}; add it to `ignore` to keep "
                    "the LM head dense (the paper does not prune it)"
                )
            self._module_names[module] = name
            self._module_sparsities[module] = sparsity
            self.register_hook(module, self._calibrate_finite, "forward")
        self.find_gated_mlps(state.model, modules)
        self.watch_routing(state.model, [(n, m) for n, m, _ in modules
                                         if m in self._difference_modules])  # fmt: skip
        watch_causal_masks(state.model, self.register_hook)
        if self.gamma == "auto":
            self.watch_propagation(state.model)  # model_check
        logger.info(
            f"{type(self).__name__}: difference statistic on "
            f"{len(self._difference_modules)} of {len(modules)} modules"
        )

    def _calibrate_finite(self, module, args, output):
        """``calibrate_module``, after refusing NaN or inf inputs (every module, routed
        to the difference statistic or to the standard method). With ``gamma: auto`` the
        held-out sequences of a difference module are also kept (``selection``)."""
        x = args[0]
        check_finite_activations(self._module_names[module], x)
        first = self._sequences_seen.get(module, sequence_offset())  # global index
        if module in self._routing:  # the MoE block's batch, flattened
            count = self._routing.batch_size(module)
        else:
            count = x.shape[0] if x.dim() == 3 else 1
        rows = list(range(first, first + count))
        self._sequences_seen[module] = rows[-1] + 1
        self._calibrated.add(module)
        if self.gamma == "auto" and self.is_difference_module(module):
            self.hold_out(module, x, rows)
        self._rows = rows
        return self.calibrate_module(module, args, output)

    def _select_difference_modules(self, modules) -> set[torch.nn.Module]:
        selected = set()
        for pattern in self.difference_targets:
            matched = [(n, m) for n, m, _ in modules if match_targets(n, m, [pattern])]
            if not matched:
                examples = ", ".join(n for n, _, _ in modules[:8]) or "(none)"
                raise ValueError(
                    f"difference_targets pattern {pattern!r} matches none of the "
                    f"{len(modules)} modules this modifier prunes; some of them: "
                    f"{examples}. Use 're:' for a regex; the default, "
                    f"{DEFAULT_DIFFERENCE_TARGETS[0]!r}, reaches the gate and up "
                    "projections of the gated MLPs (MoE experts included) of transformers' "
                    "families"
                )
            for name, module in matched:
                if not isinstance(module, torch.nn.Linear):
                    raise ValueError(
                        f"difference_targets pattern {pattern!r} matches {name}, a "
                        f"{type(module).__name__}; the difference statistics are defined "
                        "for torch.nn.Linear only"
                    )
                selected.add(module)
        return selected

    def is_difference_module(self, module: torch.nn.Module) -> bool:
        return module in self._difference_modules

    def on_sequential_epoch_end(self, state: State, event: Event, **kwargs):
        self._last_input = self._last_differences = None  # release the layer's last batch
        self.log_routing_skips()
        super().on_sequential_epoch_end(state, event, **kwargs)
        self._calibrated = set()

    def _reset_routing(self):
        self._difference_modules = set()
        self._sequences_seen = dict()
        self._pair_sources = dict()
        self._last_input = None
        self._last_differences = None
        self._centering = dict()
        self._rows = []
        self._calibrated = set()
        self._routing = MoERouting()
        self._reset_gamma_auto()
