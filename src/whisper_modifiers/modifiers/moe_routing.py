"""Which tokens of each calibration sequence the router sent to an MoE expert: the pairs
of an expert's difference statistic are formed within them (paper Section 3: pairs within
a sequence).

llmcompressor runs an MoE layer's experts as Linears (``LinearExperts2D``): the block
flattens its ``[b, s, h]`` input to ``[b s, h]`` tokens and hands them, with the router's
``top_k_index``, to the experts container; an expert's projections then receive every token
(``moe_calibrate_all_experts``, ``oneshot``'s default) or only its routed tokens, in the
container's order. ``MoERouting`` keeps, for the forward pass under way, the block's batch
shape and the container's tokens and routing (pre-hooks), and ``routed_sequences`` splits
an expert's hook input back into each sequence's routed tokens, whatever the batch size.
A module inside the block that is not an expert (Qwen2-MoE's shared expert) gets the
flattened tokens too: ``as_sequences`` gives them back their ``[b, s, h]`` shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

__all__ = ["MOE_EXPERT", "MoERouting", "RoutedSequence"]

# an MoE expert as llmcompressor exposes it (mlp.experts.N.gate_proj); saved in the
# family's fused experts (``saving.packed_experts``), dense
MOE_EXPERT = re.compile(r".*\.experts\.\d+\.")


@dataclass
class RoutedSequence:
    """One calibration sequence's tokens routed to an expert, in sequence order."""

    row: int  # the sequence's index in the batch
    tokens: torch.Tensor  # [routed tokens, m]


@dataclass
class _Member:
    block: torch.nn.Module  # the MoE block (the experts container's parent)
    container: torch.nn.Module | None  # LinearExperts2D, or None for a shared expert
    index: int | None  # the expert's index in the container


class MoERouting:
    """The routing of every MoE block that holds a difference module, per forward pass."""

    def __init__(self):
        self._members: dict[torch.nn.Module, _Member] = {}
        self._shapes: dict[torch.nn.Module, tuple[int, int] | None] = {}
        self._routes: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.skipped: dict[torch.nn.Module, list[int]] = {}  # [sequences < 2 tokens, all]

    def watch(
        self,
        model: torch.nn.Module,
        modules: list[tuple[str, torch.nn.Module]],
        register_hook: Callable,
    ) -> None:
        """Follow the routing of the MoE blocks that hold any of ``modules`` (``(name,
        module)``); ``register_hook`` is the modifier's (removed with its hooks). Raises
        before calibration if an expert's routing cannot be seen."""
        for name, module in modules:
            expert = MOE_EXPERT.match(name)
            if expert:
                container_name, _, index = expert[0].rstrip(".").rpartition(".")
                container = model.get_submodule(container_name)
                if not isinstance(container, LinearExperts2D):
                    raise ValueError(
                        f"{name} is an MoE expert of a {type(container).__name__}, whose "
                        "routing this version cannot follow (it follows llmcompressor's "
                        "LinearExperts2D); leave the experts out of difference_targets"
                    )
                block = model.get_submodule(container_name.rpartition(".")[0])
                member = _Member(block, container, int(index))
            else:
                block = _enclosing_block(model, name)
                if block is None:
                    continue  # a dense module: its input keeps its sequences
                member = _Member(block, None, None)
            self._members[module] = member
            if block not in self._shapes:
                self._shapes[block] = None
                register_hook(block, self._record_shape, "forward_pre", with_kwargs=True)
            if member.container is not None and member.container not in self._routes:
                self._routes[member.container] = None
                register_hook(member.container, self._record_route, "forward_pre", with_kwargs=True)

    def __contains__(self, module: torch.nn.Module) -> bool:
        return module in self._members

    def is_expert(self, module: torch.nn.Module) -> bool:
        member = self._members.get(module)
        return member is not None and member.container is not None

    def expert_of(self, module: torch.nn.Module) -> tuple | None:
        """``(container, index)`` of an expert's module (its gate and up share it)."""
        member = self._members.get(module)
        return None if member is None else (member.container, member.index)

    def batch_size(self, module: torch.nn.Module) -> int:
        return self._shape(module)[0]

    def as_sequences(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A non-expert module's flattened ``[b s, m]`` input as ``[b, s, m]``."""
        b, s = self._shape(module)
        return x.view(b, s, x.shape[-1]) if x.dim() == 2 and x.shape[0] == b * s else x

    def routed_sequences(self, module: torch.nn.Module, x: torch.Tensor) -> list[RoutedSequence]:
        """Each sequence's tokens routed to ``module``'s expert, from its hook input ``x``
        (every token of the batch, or its routed ones in the container's order); the
        sequences with fewer than 2 are counted in ``skipped`` and left out."""
        member = self._members[module]
        b, s = self._shape(module)
        hidden, top_k_index = self._routes[member.container]
        routed = top_k_index == member.index  # [b s, k]
        if get_calibrate_all_experts_flag():  # x is the container's tokens, all of them
            positions = routed.any(dim=-1).nonzero().squeeze(1)
            faithful = x is hidden or torch.equal(x, hidden)
            received = x.index_select(0, positions) if faithful else None
        else:  # x = hidden[token_indices], token_indices as LinearExperts2D orders them
            _, token_indices = torch.where(routed.t())
            order = token_indices.argsort()
            positions = token_indices[order]
            received = x[order] if x.shape[0] == len(positions) else None
            faithful = received is not None and torch.equal(
                received, hidden.index_select(0, positions)
            )
        if not faithful:
            raise RuntimeError(
                f"the input of an expert of {type(member.container).__name__} is not the "
                "tokens its router sent it; its pairs cannot follow the routing"
            )
        sequence_of = torch.div(positions, s, rounding_mode="floor")
        sequences = [RoutedSequence(row, received[sequence_of == row]) for row in range(b)]
        kept = [sequence for sequence in sequences if sequence.tokens.shape[0] >= 2]
        counts = self.skipped.setdefault(module, [0, 0])
        counts[0] += b - len(kept)
        counts[1] += b
        return kept

    def _shape(self, module: torch.nn.Module) -> tuple[int, int]:
        member = self._members[module]
        shape = self._shapes[member.block]
        if shape is None:
            raise ValueError(
                f"the MoE block {type(member.block).__name__} did not receive its tokens "
                "as [batch, sequence, hidden], so the calibration sequences of a batch "
                "cannot be told apart after routing; calibrate with batch_size: 1"
            )
        return shape

    def _record_shape(self, block, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        shape = tuple(hidden.shape[:2]) if torch.is_tensor(hidden) and hidden.dim() == 3 else None
        self._shapes[block] = shape

    def _record_route(self, container, args, kwargs):
        values = list(args) + [kwargs.get(key) for key in ("hidden_states", "top_k_index")]
        hidden, top_k_index = [value for value in values if value is not None][:2]
        self._routes[container] = (hidden, top_k_index)

    def release(self):
        """Forget the last forward pass's tensors and the skip counts (end of a layer)."""
        self._routes = dict.fromkeys(self._routes)
        self.skipped = dict()


def _enclosing_block(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The innermost ancestor of module ``name`` that holds a ``LinearExperts2D``
    ``experts`` (an MoE block), if any."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        ancestor = model.get_submodule(".".join(parts[:end]))
        if isinstance(getattr(ancestor, "experts", None), LinearExperts2D):
            return ancestor
    return None
