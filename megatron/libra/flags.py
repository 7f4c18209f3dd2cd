"""Command-line arguments derived from a settings dataclass: one argument per field, with the
field's type, default and docstring (its help), so that a setting is declared once - in
`libra_ext.planner.PlannerKnobs` for the planner's knobs, in `config.SystemConfig` for the
runtime's - and `libra plan`'s flags and `pretrain_gpt_libra.py`'s `--libra-*` arguments follow
it. Torch-free."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from megatron.libra.config_doc import field_docs


def _kind(field: dataclasses.Field, default) -> type:
    """The argument type of a field: its default's, or the annotation's for an optional one."""
    if isinstance(default, bool):
        return bool
    if default is not None:
        return type(default)
    annotation = str(field.type)
    for name, kind in (("int", int), ("float", float), ("str", str)):
        if annotation.startswith(name):
            return kind
    raise TypeError(f"no argument type for field {field.name} ({annotation})")


def add_fields(
    group,
    cls,
    option: Callable[[str], str],
    dest: Callable[[str], str] | None = None,
    choices: dict | None = None,
    skip: tuple = (),
    help_text: dict | None = None,
) -> list[str]:
    """Add one argument per field of dataclass `cls` to `group` (a parser or an argument
    group): `option(field)` its option name (e.g. "--head-group"), `dest(field)` its attribute
    (default: the field's name), `choices` per field, `help_text` per field to use instead of
    the docstring. A boolean field that defaults to true becomes a `--no-...` flag that sets
    it false (Megatron-LM's convention), one that defaults to false a flag that sets it.
    Returns the fields added."""
    docs = field_docs(cls)
    default = cls()
    added = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = getattr(default, f.name)
        name = option(f.name)
        target = dest(f.name) if dest else f.name
        text = (help_text or {}).get(f.name, docs.get(f.name, ""))
        if _kind(f, value) is bool:
            flag = name if not value else "--no-" + name[2:]
            group.add_argument(flag, dest=target, default=value,
                               action="store_false" if value else "store_true", help=text)
        else:
            group.add_argument(name, dest=target, type=_kind(f, value), default=value,
                               choices=(choices or {}).get(f.name), help=text)
        added.append(f.name)
    return added


def dashed(prefix: str = "") -> Callable[[str], str]:
    """The option name of a field: `--<prefix><field with dashes>`."""
    return lambda field: "--" + prefix + field.replace("_", "-")


def values(args: argparse.Namespace, cls, dest: Callable[[str], str] | None = None) -> dict:
    """{field: value} of `cls`'s fields as `add_fields` stored them on `args`."""
    return {f.name: getattr(args, dest(f.name) if dest else f.name)
            for f in dataclasses.fields(cls)}
