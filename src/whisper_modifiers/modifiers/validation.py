"""Validation shared by our modifiers: errors name the field and the allowed values."""

from __future__ import annotations

import re

from pydantic import BaseModel, field_validator, model_validator

__all__ = [
    "SparsityValidation",
    "check_sparsity",
    "check_sparsity_matches_structure",
    "parse_mask_structure",
]

_MASK_STRUCTURE = re.compile(r"^(\d+):(\d+)$")


def check_sparsity(value):
    """``sparsity`` is a number in [0, 1), or a list of them."""
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0 <= item < 1:
            raise ValueError(
                f"sparsity must be a number in [0, 1) (or a list of them), got {value!r}"
            )
    return value


def parse_mask_structure(value) -> tuple[int, int]:
    """``mask_structure`` is ``'N:M'`` with ``0 < N < M``, or ``'0:0'`` (unstructured)."""
    match = _MASK_STRUCTURE.match(str(value).strip())
    n, m = (int(match[1]), int(match[2])) if match else (-1, -1)
    if (n, m) != (0, 0) and not 0 < n < m:
        raise ValueError(
            f"mask_structure must be 'N:M' with integers 0 < N < M (e.g. '2:4'), or '0:0' "
            f"for unstructured sparsity; got {value!r}"
        )
    return n, m


def check_sparsity_matches_structure(sparsity, n: int, m: int) -> None:
    if n and isinstance(sparsity, float) and abs(sparsity - n / m) > 1e-9:
        raise ValueError(
            f"sparsity {sparsity} contradicts mask_structure '{n}:{m}', which prunes "
            f"exactly {n / m}; set sparsity: {n / m}"
        )


class SparsityValidation(BaseModel):
    """Mixin for a modifier with ``sparsity`` and ``mask_structure`` fields: validates
    both, and their agreement, when the modifier is built."""

    @field_validator("sparsity", mode="after", check_fields=False)
    @classmethod
    def _validate_sparsity(cls, value):
        return check_sparsity(value)

    @field_validator("mask_structure", mode="before", check_fields=False)
    @classmethod
    def _validate_mask_structure(cls, value):
        n, m = parse_mask_structure(value)
        return f"{n}:{m}"

    @model_validator(mode="after")
    def _validate_sparsity_matches_structure(self):
        structure = parse_mask_structure(self.mask_structure)
        check_sparsity_matches_structure(self.sparsity, *structure)
        return self
