"""Tools that measure and check the attention operator (`libra_ext.attention`) without being
part of it: `verify` (multi-process exactness against a reference), `bench` (the operator
against one plain kernel call), `replay` (every rank's kernel calls under a step plan),
`calibrate` (the kernel's rate over attended lengths, as a hardware profile) and `selfcheck`
(the device checks of `scripts/gpu_check.sh`)."""
