"""Routing shared by the difference-informed modifiers.

``DifferencePruningBase`` adds to llmcompressor's ``SparsityModifierBase``:

* ``difference_targets`` -- which of the targeted Linear modules get the difference
  statistic (default: the MLP gate and up projections, paper Section 3); every other
  targeted module is pruned by the parent's standard method inside the same modifier;
* seeded pairwise differences formed within each calibration sequence (for an MoE
  expert, within each sequence's tokens routed to it: ``moe_routing``);
* the causal mask llmcompressor's sequential pipeline loses for some families
  (``causal_mask``);
* ``gamma`` and its per-module choice ``gamma: auto`` (the ``GammaAuto`` mixin of
  ``gamma_auto.py``);
* input validation before any calibration work;
* module names without llmcompressor 0.14's trailing dot, so that ``ignore: ["lm_head"]``
  and ``$``-anchored regexes match what users expect.
"""

from __future__ import annotations

import weakref
import zlib
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
from whisper_modifiers.modifiers.sequence_sums import SequenceSumCalibration
from whisper_modifiers.modifiers.validation import (
    SparsityValidation,
    check_finite_activations,
    check_mask_kept,
    check_structure_divides,
    parse_mask_structure,
)
from whisper_modifiers.statistics import (
    nearest_neighbour_differences,
    pair_permutations,
    pairwise_differences,
    scaled_sequence_means,
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
    _pair_sources: dict[torch.nn.Module, torch.nn.Module] = PrivateAttr(default_factory=dict)
    _last_input: tuple | None = PrivateAttr(default=None)
    _last_differences: torch.Tensor | None = PrivateAttr(default=None)
    _centering: dict[torch.nn.Module, tuple[torch.Tensor, int]] = PrivateAttr(default_factory=dict)
    _rows: list[int] = PrivateAttr(default_factory=list)
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

    def sequence_differences(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Pairwise differences of every sequence (batch row) of a hook's input; for an
        MoE expert, of each sequence's tokens routed to it (``moe_routing``).

        Each row gets its own permutations, seeded by ``(seed, module name, global index
        of the sequence)``, so pairs do not depend on batch size, module order or the
        number of ranks (``distributed.sequence_offset``).  Modules that
        receive the very same input tensor in one forward pass (a gate and an up
        projection) share the pairs of the first of them: the differences are computed
        once, and ``pair_source`` tells which module they were drawn for.

        :return: ``[b, num_permutations * seq_len, m]`` float32; for an expert, a list
            of ``[num_permutations * routed tokens, m]``, one per sequence with at least 2.
        """
        if self.input_source(module, x) is module:
            self._last_differences = self._draw_differences(module, x)
        return self._last_differences

    def input_source(self, module: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
        """The first module that received this very input tensor in this forward pass
        (``module`` itself unless its input is shared, as gate and up share theirs); the
        statistics of the input are computed once, for that module. Recorded as
        ``pair_source``."""
        cached, expert = self._last_input, self._routing.expert_of(module)
        if cached is not None and cached[0]() is x and cached[1:3] == (x._version, expert):
            source = cached[3]
        else:  # every expert may get the same tokens: an expert's pairs are its own
            source = module
            self._last_input = (weakref.ref(x), x._version, expert, module)
        if self._pair_sources.setdefault(module, source) is not source:
            raise RuntimeError(
                f"{self._module_names[module]} shared its input with "
                f"{self._module_names[source]} in one batch but not in another"
            )
        return source

    def pair_source(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module whose input statistics ``module`` uses (itself unless its input is
        shared)."""
        return self._pair_sources[module]

    def check_input(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A hook's input as ``[b, seq_len, m]``, after the checks every pairing needs
        (finiteness is checked for every module by the hook, ``_calibrate_finite``)."""
        name = self._module_names[module]
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.shape[1] < 2:
            raise ValueError(
                f"{name} received a calibration sequence of {x.shape[1]} token(s); "
                f"{type(self).__name__} forms pairs within each sequence and needs at "
                "least 2 tokens per sequence (raise max_seq_length or drop short samples)"
            )
        return x

    def _draw_differences(self, module: torch.nn.Module, x: torch.Tensor):
        if self._routing.is_expert(module):  # sequences whose pairs all vanish add nothing
            pairs = [self._pairs(module, routed.tokens, self._rows[routed.row])
                     for routed in self._routing.routed_sequences(module, x)]  # fmt: skip
            return [differences for differences in pairs if differences.any()]
        if module in self._routing:
            x = self._routing.as_sequences(module, x)
        x = self.check_input(module, x)
        if self.pairing == "centered":
            raise RuntimeError(f"pairing {self.pairing!r} forms no explicit pairs")
        rows = zip(self._rows, x, strict=True)
        return torch.stack([self._pairs(module, sequence, row) for row, sequence in rows])

    def _pairs(self, module: torch.nn.Module, sequence: torch.Tensor, row: int) -> torch.Tensor:
        """The differences of one sequence's tokens ``[tokens, m]``, with global index
        ``row``: seeded by ``(seed, module name, row)``, or nearest neighbours."""
        if self.pairing == "nearest":
            return nearest_neighbour_differences(sequence)
        module_id = zlib.crc32(self._module_names[module].encode())
        permutations = pair_permutations(
            sequence.shape[0], self.num_permutations, (self.seed, module_id, row)
        )
        return pairwise_differences(sequence, permutations)

    def add_centering(self, module: torch.nn.Module, x: torch.Tensor, add):
        """Add ``s x_bar x_bar^T`` (or its diagonal) of each sequence with ``add``
        (``add_sequence_grams`` or ``add_sequence_channel_norms``): with the uncentered
        statistic the parent keeps, it gives the centered one by subtraction. Costs one
        mean per sequence."""
        means = scaled_sequence_means(self.check_input(module, x))
        total, count = self._centering.get(module, (None, 0))
        self._centering[module] = (add(total, means), count + means.shape[0])

    def centered(self, module: torch.nn.Module, uncentered: torch.Tensor) -> torch.Tensor:
        """``uncentered - s x_bar x_bar^T`` (diagonal entries clamped at 0)."""
        correction, _ = self._centering[module]
        centered = uncentered - correction.to(uncentered.device)
        if centered.dim() == 1:
            return centered.clamp_min(0)
        centered.diagonal().clamp_(min=0)
        return centered

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
