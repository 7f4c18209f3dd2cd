"""`--yaml-cfg FILE` for `pretrain_gpt_libra.py`: a YAML file of Megatron-LM's argument names
(mappings such as `model:` only group them) and a `libra:` section with a `libra train` config's
system keys, read as the command-line arguments it stands for and checked against Megatron-LM's
parser; arguments on the command line win."""

from __future__ import annotations

import argparse
import dataclasses
import difflib

import yaml

from megatron.libra.config import SystemConfig
from megatron.libra.megatron_lm.args import _dest, add_libra_args

LIBRA_SECTION_KEYS = {"name": "libra_system", "system": "libra_system",
                      "pool_size": "libra_pool_size", "data": "libra_data",
                      "workload": "libra_workload", "lengths_file": "libra_lengths_file",
                      "attention_time": "libra_attention_time"}
"""Keys of a --yaml-cfg file's `libra:` section that are not a system field's `--libra-<key>`:
the section takes the keys of a `libra train` config's `system` section (`name`, `block`,
`chunks`, ...), the pool size, where the documents come from (`data: synthetic`, `workload`,
`lengths_file`) and `attention_time`."""


DATA_ARGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
             "--data-args-path", "--per-split-data-args-path")
"""Megatron-LM's arguments that name a dataset: given on the command line, they replace a
--yaml-cfg file's `mock_data: true`."""


def _split_yaml_cfg(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--yaml-cfg's path, the other arguments) of a command line."""
    path, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--yaml-cfg":
            if i + 1 >= len(argv):
                raise ValueError("--yaml-cfg: expected a file path")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--yaml-cfg="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return path, rest


def yaml_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """A --yaml-cfg file as the command-line arguments it stands for, checked against `parser`
    (Megatron-LM's arguments and Libra's).

    Keys are Megatron-LM's argument names with underscores (`num_layers: 2`,
    `context_parallel_size: 2`, `mock_data: true`), as at the top level of Megatron-LM's own
    YAML files; a mapping under a key that is no argument (`model_parallel:`, `training:`, ...)
    only groups such keys. The `libra:` section takes the keys of a `libra train` config's
    `system` section and `pool_size`. Arguments given on the command line as well win (they come
    after these); `null` leaves an argument at its default. An unknown key, a value of the wrong
    kind or one key given twice raises ValueError naming the key."""
    where = f"--yaml-cfg {path}"
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not YAML ({str(e).splitlines()[0]})") from None
    if doc is None:
        return []
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping of argument names to values")
    actions: dict[str, list] = {}
    options: dict[str, argparse.Action] = {}  # option name (no dashes) -> its action
    for a in parser._actions:
        if a.option_strings and a.dest != "help":
            actions.setdefault(a.dest, []).append(a)
            for o in a.option_strings:
                options[o.lstrip("-").replace("-", "_")] = a
    system_fields = {f.name for f in dataclasses.fields(SystemConfig)}
    out: list[str] = []
    seen: dict[str, str] = {}

    def emit(key: str, dest: str, value) -> None:
        if dest in seen:
            raise ValueError(f"{where}: {key} sets --{dest.replace('_', '-')} again "
                             f"(as {seen[dest]} did)")
        seen[dest] = key
        if value is None:
            return
        acts = actions[dest]
        long = lambda a: next((o for o in a.option_strings if o.startswith("--")),  # noqa: E731
                              a.option_strings[0])
        if isinstance(value, bool):
            flags = [a for a in acts if isinstance(a.const, bool) and a.nargs == 0]
            for a in flags:
                if a.const is value:
                    out.append(long(a))
                    return
            if flags:
                if value == flags[0].default:
                    return
                raise ValueError(f"{where}: {key}: {long(flags[0])} cannot be set to {value}")
        a = acts[0]
        if a.nargs == 0:
            raise ValueError(f"{where}: {key}: {long(a)} is a flag: give true or false, "
                             f"not {value!r}")
        many = a.nargs in ("+", "*") or isinstance(a.nargs, int)
        if isinstance(value, list):
            if not many:
                raise ValueError(f"{where}: {key}: {long(a)} takes one value, not a list")
            out.extend([long(a), *map(str, value)])
        elif isinstance(value, dict):
            raise ValueError(f"{where}: {key}: {long(a)} takes a value, not a mapping")
        else:
            out.extend([long(a), str(value)])

    def unknown(key: str, name: str, pool) -> ValueError:
        near = difflib.get_close_matches(name, list(pool), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return ValueError(f"{where}: {key} is not a Megatron-LM or Libra argument{hint}")

    def walk(mapping: dict, prefix: str) -> None:
        for k, v in mapping.items():
            key = f"{prefix}{k}"
            name = str(k).replace("-", "_")
            if prefix == "" and name == "libra" and name not in actions:
                if not isinstance(v, dict):
                    raise ValueError(f"{where}: libra: expected a mapping (the system section)")
                for lk, lv in v.items():
                    lname = str(lk).replace("-", "_")
                    if lname in LIBRA_SECTION_KEYS:
                        emit(f"libra.{lk}", LIBRA_SECTION_KEYS[lname], lv)
                    elif lname in system_fields:
                        emit(f"libra.{lk}", _dest(lname), lv)
                    else:
                        near = difflib.get_close_matches(
                            lname, sorted(system_fields | set(LIBRA_SECTION_KEYS)), n=1)
                        hint = f" (did you mean {near[0]}?)" if near else ""
                        raise ValueError(
                            f"{where}: libra.{lk} is not a key of the system section or one of "
                            f"{', '.join(k for k in LIBRA_SECTION_KEYS if k != 'system')}{hint}")
            elif name == "yaml_cfg":
                raise ValueError(f"{where}: {key}: a --yaml-cfg file cannot name another")
            elif name in actions:
                emit(key, name, v)
            elif name in options and options[name].nargs == 0:
                # a flag by its option's name (disable_bias_linear: true)
                a = options[name]
                if not isinstance(v, bool):
                    raise ValueError(f"{where}: {key}: --{k} is a flag: give true or false, "
                                     f"not {v!r}")
                emit(key, a.dest, a.const if v else None)
            elif name in options:
                emit(key, options[name].dest, v)
            elif isinstance(v, dict):
                walk(v, key + ".")
            else:
                raise unknown(key, name, set(actions) | set(options))

    walk(doc, "")
    return out


def expand_yaml_cfg(argv: list[str]) -> tuple[list[str], str | None]:
    """Megatron-LM's and Libra's arguments with --yaml-cfg replaced by the file's arguments
    (the command line's own after them, so they win; a dataset named there replaces the file's
    mock data), and the file's path. Megatron-LM's own
    --yaml-cfg mode (every argument from the file, the command line ignored) is not used."""
    path, rest = _split_yaml_cfg(argv)
    if path is None:
        return argv, None
    from_file = yaml_argv(path, _megatron_parser())
    if "--mock-data" in from_file and any(a.split("=", 1)[0] in DATA_ARGS for a in rest):
        # a dataset named on the command line wins over the file's mock data (Megatron-LM
        # refuses both at once)
        from_file = [a for a in from_file if a != "--mock-data"]
    return from_file + rest, path


def _megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM's argument parser with Libra's arguments (as parse_args builds it)."""
    # optional: megatron.training ships with megatron-core >= 0.19 only
    from megatron.training.arguments import add_megatron_arguments

    return add_libra_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
