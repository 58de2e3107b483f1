"""docs/fields.md against the modifiers' pydantic fields: every field a modifier adds to
its llmcompressor base (or whose default it changes) has a row naming that modifier, with
its default; no row names a field or a modifier that does not have it."""

import re

import yaml
from pydantic_core import PydanticUndefined

from conftest import REPO
from whisper_modifiers.modifiers import REGISTRY, DifferencePruningBase, targets

EVERY_DIFFERENCE_MODIFIER = "every difference modifier"


def documented_rows() -> list[tuple[str, list[str], str]]:
    """``(field, modifier class names, default text)`` of each row of docs/fields.md."""
    rows = []
    for line in (REPO / "docs" / "fields.md").read_text().splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        field, names, default = cells[0].strip("`"), cells[1], cells[2]
        if names == EVERY_DIFFERENCE_MODIFIER:
            classes = [
                c.__name__ for c in REGISTRY.values() if issubclass(c, DifferencePruningBase)
            ]
        else:
            classes = re.findall(r"`(\w+)`", names)
        rows.append((field, classes, default))
    return rows


def parsed_default(text: str):
    """A row's default: ``required``, a constant of ``modifiers.targets`` by name, or YAML
    (as a recipe would write it)."""
    if text == "required":
        return PydanticUndefined
    value = text.strip("`")
    return getattr(targets, value) if hasattr(targets, value) else yaml.safe_load(value)


def added_fields(cls) -> dict:
    """``{field: default}`` of the fields ``cls`` adds to its llmcompressor base, or whose
    default it changes."""
    stock = next(base for base in cls.__mro__ if base.__module__.startswith("llmcompressor"))
    added = {}
    for name, info in cls.model_fields.items():
        default = info.get_default(call_default_factory=True)
        stock_info = stock.model_fields.get(name)
        if stock_info is None or stock_info.get_default(call_default_factory=True) != default:
            added[name] = default
    return added


def mismatches(rows: list[tuple[str, list[str], str]]) -> list[str]:
    """What ``rows`` get wrong about the modifiers' fields (empty: nothing)."""
    documented, problems = {}, []
    for field, classes, default in rows:
        if not classes:
            problems.append(f"the row of {field} names no modifier")
        for name in classes:
            if (name, field) in documented:
                problems.append(f"{name}.{field} has two rows")
            documented[(name, field)] = parsed_default(default)
    expected = {}
    for cls in REGISTRY.values():
        expected.update(
            {(cls.__name__, field): default for field, default in added_fields(cls).items()}
        )
    problems += [f"{key} is not documented" for key in sorted(set(expected) - set(documented))]
    problems += [f"{key} does not exist" for key in sorted(set(documented) - set(expected))]
    for key in sorted(set(expected) & set(documented)):
        if documented[key] != expected[key]:
            problems.append(f"{key}: documented {documented[key]!r}, is {expected[key]!r}")
    return problems


def test_docs_fields_table_is_the_modifiers_fields():
    assert mismatches(documented_rows()) == []


def test_a_wrong_or_missing_row_is_found():
    rows = documented_rows()
    gamma = next(i for i, row in enumerate(rows) if row[0] == "gamma" and row[2] == "`0.01`")
    wrong = [*rows[:gamma], ("gamma", rows[gamma][1], "`0.1`"), *rows[gamma + 1 :]]
    assert any("documented 0.1, is 0.01" in problem for problem in mismatches(wrong))
    missing = [row for row in rows if row[0] != "ria_exponent"]
    assert "('RIAModifier', 'ria_exponent') is not documented" in mismatches(missing)
    extra = [*rows, ("seed", ["OneShotMagnitudeModifier"], "`0`")]
    assert "('OneShotMagnitudeModifier', 'seed') does not exist" in mismatches(extra)
