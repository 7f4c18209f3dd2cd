"""`libra` command line: training, A/B runs, planner, simulator, verification, benchmarks.

Every bad input ends with exit code 2 and a one-line message naming the field or line.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import sys
from typing import Sequence

from megatron.libra.cli import bench, memory, plan, sim, train, verify
from megatron.libra.notices import quiet_megatron_notices


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows every option's default (unless its text already says it, or there is
    none to show); choices appear as argparse lists them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text.lower()
            or action.default in (None, False, argparse.SUPPRESS)
            or isinstance(action, argparse._StoreFalseAction)  # a --no-X flag turns X off
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="libra", description="Libra for Megatron-Core")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan.add_plan_parser(sub)
    bench.add_bench_parser(sub)
    sim.add_simulate_parser(sub)
    sim.add_recommend_parser(sub)
    sim.add_calibrate_parser(sub)
    verify.add_verify_parser(sub)
    train.add_train_parser(sub)
    train.add_ab_parser(sub)
    memory.add_memory_parser(sub)
    return parser


_OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*=")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # `libra ab --trainer megatron ... -- <pretrain_gpt_libra.py arguments>`
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "trainer", None) == "megatron":
        if args.overrides or extra:
            parser.error("libra ab --trainer megatron: key=value overrides are libra train's; "
                         "give pretrain_gpt_libra.py's arguments after `--`")
        args.overrides = passthrough
    elif passthrough:
        parser.error("arguments after `--` are pretrain_gpt_libra.py's (libra ab --trainer "
                     "megatron)")
    # key.sub=value overrides may stand anywhere, also after an option (`--nproc 4 a.b=1`)
    if extra and hasattr(args, "overrides") and all(_OVERRIDE.match(x) for x in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        parser.error(
            f"argument --log-level: {args.log_level!r} is not one of DEBUG, INFO, WARNING, "
            "ERROR, CRITICAL"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ["LIBRA_LOG_LEVEL"] = args.log_level.upper()  # spawned training workers read it

    quiet_megatron_notices()  # e.g. megatron-core imported to read a checkpoint
    try:
        result = args.func(args)
    except ValueError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"libra {args.command}: error: {msg}", file=sys.stderr)
        return 2
    if result is not None and getattr(args, "json", False):
        print(json.dumps(result, sort_keys=False))
    if isinstance(result, dict) and result.get("ok") is False:
        return 1
    return 0


def entry() -> int:
    """The `libra` command: main(), then the process ends without Python's final garbage
    collection (seconds over torch's and megatron-core's objects, as `launch.end_quickly`)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    return code

