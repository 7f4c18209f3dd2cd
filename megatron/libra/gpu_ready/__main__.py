"""python -m megatron.libra.gpu_ready [--json] [--systems ...] [--standins ...] [--layouts ...]

Builds the fake-CUDA library (once), then runs the gate in a process started with it preloaded
and prints the report (`--json`: one JSON object) and what fails; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from megatron.libra.gpu_ready import library


def _args(argv):
    from libra_ext.planner import SYSTEMS
    from megatron.libra.gpu_ready.gate import LAYOUTS

    # deferred: the scenarios are imported in the gate's own process (fake CUDA preloaded)
    from megatron.libra.gpu_ready.standins import BACKEND_STANDINS

    p = argparse.ArgumentParser(prog="python -m megatron.libra.gpu_ready", description=__doc__)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--standins", default=",".join(BACKEND_STANDINS),
                   help="kernel entry points to stand in for")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--tokens", type=int, default=262_144)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--no-trainer", action="store_true",
                   help="leave out the training-step scenario (megatron-core's GPTModel)")
    p.add_argument("--trainer-scenarios", default="",
                   help="which training steps to run (comma-separated, of: one-rank, "
                        "cp2, dp2-ep2-moe; default: all)")
    p.add_argument("--mutate", default="", help=argparse.SUPPRESS)  # tests: a planted defect
    # one rank of a multi-rank training scenario (SCENARIO,RANK,PORT), started by the gate
    p.add_argument("--rank-of", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not os.environ.get(library.PRELOAD_ENV):  # (this process imports no torch)
        lib = library.build_library()
        cmd = [sys.executable, "-m", "megatron.libra.gpu_ready", *argv]
        return subprocess.run(cmd, env=library.preload_env(lib)).returncode
    args = _args(argv)
    # deferred: the scenarios are imported in the gate's own process (fake CUDA preloaded)
    from megatron.libra.gpu_ready import gate

    mutate = args.mutate or os.environ.get("LIBRA_GATE_MUTATION", "")
    if mutate:  # (the ranks of multi-rank scenarios inherit it)
        # deferred: the scenarios are imported in the gate's own process (fake CUDA preloaded)
        from megatron.libra.gpu_ready import mutations

        os.environ["LIBRA_GATE_MUTATION"] = mutate
        mutations.apply(mutate)
    if args.rank_of:
        scenario, rank, port = args.rank_of.split(",")
        print(json.dumps(gate.trainer_rank(scenario, int(rank), int(port), args.standins),
                         default=str))
        return 0
    # with --json the report is the only thing on stdout: what the scenarios print (megatron-
    # core's notices, log lines) goes to stderr, at the descriptor level
    stdout = os.dup(1) if args.json else None
    if stdout is not None:
        sys.stdout.flush()
        os.dup2(2, 1)
    try:
        report = gate.run(
            systems=tuple(s for s in args.systems.split(",") if s),
            standin_names=tuple(s for s in args.standins.split(",") if s),
            layouts=tuple(s for s in args.layouts.split(",") if s),
            shape=gate.Shape(tokens=args.tokens, kv_heads=args.kv_heads),
            trainer=not args.no_trainer,
            trainer_scenarios=tuple(x for x in args.trainer_scenarios.split(",") if x)
            or gate.TRAINER_SCENARIOS,
        )
    finally:
        if stdout is not None:
            sys.stdout.flush()
            os.dup2(stdout, 1)
            os.close(stdout)
    failures = gate.check(report)
    report["failures"] = failures
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(gate.summary(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
