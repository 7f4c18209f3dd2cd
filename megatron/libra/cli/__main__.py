"""`python -m megatron.libra.cli`: the `libra` command."""

import sys

from megatron.libra.cli import entry

sys.exit(entry())
