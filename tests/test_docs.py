"""docs/fields.md against the modifiers' pydantic fields: every field a modifier adds to
its llmcompressor base (or whose default it changes) has a row naming that modifier, with
its default; no row names a field or a modifier that does not have it."""

import re
import runpy

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


# -- README's results table, and every link and path of README.md and docs/ ---------------

PATH_ROOTS = (
    "",
    "src",
    "src/whisper_modifiers",
    "serving-plugin/src",
    "serving-plugin/src/whisper_sparse",
    "serving-plugin/src/whisper_sparse/cpu",
    "serving-plugin/src/whisper_sparse/cpu/kernels",
    "benchmarks/results",
    "tests",
)
PATH_SUFFIXES = (".py", ".md", ".cpp", ".h", ".sh", ".yaml", ".json", ".toml", ".png")
PLACEHOLDERS = re.compile(r"[*{}<>$~…]|^NAME|^DIR")


def front_door_and_docs():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def unresolved(doc, text: str) -> list[str]:
    """The links and code-span paths of ``text`` (the file ``doc``) that name no file."""
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            missing.append(f"link {target}")
    for span in re.findall(r"`([^`\s]+)`", text):
        if "/" not in span or not span.endswith(PATH_SUFFIXES) or PLACEHOLDERS.search(span):
            continue
        roots = [doc.parent, *(REPO / root for root in PATH_ROOTS)]
        if not any((root / span).exists() for root in roots):
            missing.append(f"path {span}")
    return missing


def test_every_link_and_path_in_the_readme_and_docs_resolves():
    missing = {
        doc.relative_to(REPO).as_posix(): unresolved(doc, doc.read_text())
        for doc in front_door_and_docs()
    }
    assert {doc: found for doc, found in missing.items() if found} == {}


def test_a_broken_link_or_path_is_found():
    doc = REPO / "docs" / "serving.md"
    text = "[x](gpu.md) [y](no-such.md) `cpu/plans.py` `cpu/no_such.py` `$CACHE/a.json`"
    assert unresolved(doc, text) == ["link no-such.md", "path cpu/no_such.py"]


def test_the_readme_results_table_is_the_summary_scripts():
    summary = runpy.run_path(str(REPO / "benchmarks" / "summary.py"))
    readme = (REPO / "README.md").read_text()
    assert summary["with_table"](readme, summary["table"]()) == readme, (
        "run python benchmarks/summary.py --write README.md"
    )
    assert summary["main"](["--check", str(REPO / "README.md")]) == 0


def test_a_stale_results_table_is_found(tmp_path):
    summary = runpy.run_path(str(REPO / "benchmarks" / "summary.py"))
    stale = tmp_path / "README.md"
    stale.write_text((REPO / "README.md").read_text().replace("×", "x", 1))
    assert summary["main"](["--check", str(stale)]) == 1
    assert len((REPO / "README.md").read_text().split()) <= 1200
