"""What each strategy does, in words and formulas, kept next to its code (module-level `ABOUT`, a
`StrategyDoc` record).

docs/algorithms.md sections 1-14 and `fedmqtt algorithms NAME` are both rendered from these records
(`render_section`), so the reference and the command line say the same thing. Parameters are never
restated by hand: their defaults, valid ranges and meanings are read from the rule's pydantic `Params`.
"""

from __future__ import annotations

import sys
import textwrap
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo

from fedmqtt.strategies.registry import STRATEGIES
from fedmqtt.strategies.strategy_doc import StrategyDoc


@dataclass(frozen=True)
class ParamDoc:
    """One hyper-parameter as the `Params` model defines it."""

    name: str
    default: str
    valid: str
    meaning: str


# -- parameters, read from the pydantic models ---------------------------------------------------------
def _fmt(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _bounds(info: FieldInfo) -> str:
    """`> 0`, `[0, 1)`, `(0, 1]`, `>= 1` ... from the Field's ge/gt/le/lt constraints."""
    # (bracket, bound): the bound's type depends on the constraint (SupportsGe, SupportsGt ...), any of them prints
    lo: tuple[str, object] | None = None
    hi: tuple[str, object] | None = None
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            lo = ("[", item.ge)
        elif isinstance(item, annotated_types.Gt):
            lo = ("(", item.gt)
        elif isinstance(item, annotated_types.Le):
            hi = ("]", item.le)
        elif isinstance(item, annotated_types.Lt):
            hi = (")", item.lt)
    if lo and hi:
        return f"{lo[0]}{_fmt(lo[1])}, {_fmt(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {_fmt(lo[1])}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {_fmt(hi[1])}"
    return ""


def _valid(annotation: Any, info: FieldInfo) -> str:
    """The values a field accepts, in words."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return f"{_valid(inner, info)}, or unset"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is tuple:
        choices = typing.get_args(args[0]) if typing.get_origin(args[0]) is Literal else ()
        return "a list of " + (", ".join(choices) + ' (or "all")' if choices else "values")
    if annotation is bool:
        return "true or false"
    kind = "integer" if annotation is int else "number"
    bounds = _bounds(info)
    return f"{kind} {bounds}" if bounds else kind


def param_docs(model: type[BaseModel]) -> list[ParamDoc]:
    """Every field of a `Params` model: name (with accepted aliases), default, valid values, meaning."""
    rows = []
    for name, info in model.model_fields.items():
        label = name
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            others = [str(a) for a in alias.choices if a != name]
            label = name + (f" (or {', '.join(others)})" if others else "")
        valid = _valid(info.annotation, info)
        rows.append(ParamDoc(label, _fmt(info.default), valid, info.description or ""))
    return rows


# -- lookup and rendering ----------------------------------------------------------------------------
def about_of(name: str) -> StrategyDoc:
    """The `ABOUT` record of the registered strategy `name` (KeyError for an unknown name)."""
    module = sys.modules[STRATEGIES[name].__module__]
    doc: StrategyDoc = module.ABOUT
    return doc


def all_docs() -> list[StrategyDoc]:
    """One record per section, in section order, covering every registered strategy."""
    seen: dict[str, StrategyDoc] = {}
    for name in STRATEGIES:
        doc = about_of(name)
        seen.setdefault(doc.section, doc)
    return sorted(seen.values(), key=lambda d: int(d.section))


def _param_table(names: Iterable[str]) -> list[str]:
    names = list(names)
    rows: dict[tuple[str, str, str, str], list[str]] = {}
    for name in names:
        for p in param_docs(STRATEGIES[name].Params):
            rows.setdefault((p.name, p.default, p.valid, p.meaning), []).append(name)
    if not rows:
        return ["None: this rule has no hyper-parameters of its own."]
    several = len(names) > 1
    head = "| parameter | default | valid values | meaning |" + (" rules |" if several else "")
    lines = [head, "| --- | --- | --- | --- |" + (" --- |" if several else "")]
    for (pname, default, valid, meaning), users in rows.items():
        cell = meaning.replace("|", "\\|")
        line = f"| `{pname}` | `{default}` | {valid} | {cell} |"
        if several:
            line += " " + ("all" if len(users) == len(names) else ", ".join(f"`{u}`" for u in users)) + " |"
        lines.append(line)
    return lines


def _block(text: str) -> list[str]:
    """Plain-text formulas as an indented code block (reads the same in a terminal and in markdown)."""
    return ["    " + line if line.strip() else "" for line in text.strip("\n").splitlines()]


def _wrap(text: str, first: str = "", rest: str = "") -> list[str]:
    """Prose wrapped at 110 columns, so it reads well in a terminal and in the markdown source."""
    return textwrap.wrap(" ".join(text.split()), width=110, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def secure_aggregation_line(name: str) -> str:
    """Whether the rule `name` runs under secure aggregation, and how or why not (one sentence)."""
    cls = STRATEGIES[name]
    return f"{'yes' if cls.needs_only_sums else 'no'}: {cls.sums_note}."


def _secure_aggregation(names: Iterable[str]) -> list[str]:
    """The section's paragraph on secure aggregation (docs/secure-aggregation.md), one line per distinct answer."""
    answers: dict[str, list[str]] = {}
    for name in names:
        answers.setdefault(secure_aggregation_line(name), []).append(name)
    if len(answers) == 1:
        return _wrap(next(iter(answers)), "**Under secure aggregation** (docs/secure-aggregation.md): ")
    out = ["**Under secure aggregation** (docs/secure-aggregation.md):", ""]
    for line, users in answers.items():
        out += _wrap(f"{', '.join(f'`{u}`' for u in users)}: {line}", "- ", "  ")
    return out


def render_section(doc: StrategyDoc) -> str:
    """The markdown of one section (heading "## <section> <title>"), as docs/algorithms.md carries it."""
    names = ", ".join(f"`{n}`" for n in doc.names)
    plural = "s" if len(doc.names) > 1 else ""
    out = [f"## {doc.section} {doc.title}", "", f"Registry name{plural}: {names}.", ""]
    out += _wrap(doc.summary) + ["", "**Server rule.**", ""] + _block(doc.server)
    out += ["", "**Client rule.**", ""] + _block(doc.client)
    how = "(`--hyper name=value` on the command line, or the `hyper` table of a config)"
    out += ["", f"**Parameters** {how}.", ""]
    out += _param_table(doc.names)
    out += [""] + _wrap(doc.state, "**State kept across rounds.** ")
    out += [""] + _secure_aggregation(doc.names) + ["", "**Papers.**", ""]
    out += [line for p in doc.papers for line in _wrap(p, "- ", "  ")]
    out += ["", "**Where this project deliberately differs from well-known implementations.**", ""]
    out += [line for d in doc.differences for line in _wrap(d, "- ", "  ")]
    if doc.example:
        out += ["", "**Worked example** (checked by the unit tests).", "", doc.example.strip()]
    for sub in doc.subsections:
        out += ["", f"### {sub.number} {sub.title}", "", sub.text.strip()]
    return "\n".join(out).rstrip() + "\n"
