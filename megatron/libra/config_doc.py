"""The training config reference (docs/config_reference.md), generated from the config
dataclasses' field docstrings so that the page and the code cannot drift apart.

    python -m megatron.libra.config_doc > docs/config_reference.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from megatron.libra import config


def field_docs(cls) -> dict[str, str]:
    """Field name -> the string literal that follows its annotation in the body of the class
    that declares it (the class itself or a dataclass it derives from)."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None),
                                                            ast.Constant):
                    if isinstance(nxt.value.value, str):
                        out[stmt.target.id] = " ".join(nxt.value.value.split())
    return out


def _own_fields_first(cls) -> list:
    """A section's fields, those its class declares before those it derives (the system
    section's name and runtime settings before the planner's knobs)."""
    own = set(getattr(cls, "__annotations__", {}))
    return sorted(dataclasses.fields(cls), key=lambda f: f.name not in own)


def _default(f: dataclasses.Field, instance) -> str:
    value = getattr(instance, f.name)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value).replace("'", "")


def render() -> str:
    top = config.TrainConfig()
    lines = [
        "# Training config reference",
        "",
        "Generated from the config dataclasses (`python -m megatron.libra.config_doc`); every "
        "key can be set in the YAML file or as a `section.key=value` override on the `libra "
        "train` command line. Values are checked before any worker starts.",
        "",
    ]
    docs_top = field_docs(config.TrainConfig)
    for f in dataclasses.fields(config.TrainConfig):
        value = getattr(top, f.name)
        if dataclasses.is_dataclass(value):
            cls = type(value)
            docs = field_docs(cls)
            lines += [f"## `{f.name}`", "", "| key | default | meaning |", "|---|---|---|"]
            for sub in _own_fields_first(cls):
                text = docs.get(sub.name, "").replace("|", "\\|")
                lines.append(f"| `{f.name}.{sub.name}` | `{_default(sub, value)}` | {text} |")
            lines.append("")
        else:
            text = docs_top.get(f.name, "").replace("|", "\\|")
            lines += [f"## `{f.name}`", "", f"Default `{_default(f, top)}`. {text}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
