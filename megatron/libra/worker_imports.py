"""Imported by the launcher's fork server before it forks any worker (`launch.WORKER_IMPORTS`):
the modules every worker needs, so that each worker starts with them instead of importing them
itself. megatron-core's notices are quieted first, as in a worker (`notices`). Importing has no
side effect a worker could inherit beyond the loaded modules and those warning filters: no
thread, no process group, no tensor."""

import gc

from megatron.libra.notices import quiet_megatron_notices

quiet_megatron_notices()

import megatron.libra.train  # noqa: E402,F401  (after the notices are quiet)

# what is loaded now lives as long as the fork server, and each worker's copy as long as it:
# the collector need not visit it again (nor at exit, which keeps the server's end quick once
# its launcher has gone), and forked workers do not touch pages they share with the server
gc.freeze()
