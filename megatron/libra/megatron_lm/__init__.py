"""Libra inside Megatron-LM's own training loop (`pretrain_gpt_libra.py`, megatron-core >= 0.19,
whose wheel ships `megatron.training`).

Megatron-LM keeps its arguments (and `--yaml-cfg`), its iteration log line, timers,
TensorBoard, checkpoints and exit-signal handling; Libra adds:

- `args`: the `--libra-*` arguments (derived from the `system` section's declaration) and the
  Megatron defaults Libra relies on; the `libra train` config they stand for; every refusal
  knowable from the arguments, before any process group, in one line naming the argument;
- `yaml_cfg`: `--yaml-cfg FILE` read as the arguments it stands for;
- `spec`: megatron-core's GPT layer (TE spec on a GPU with TE, local otherwise) with Libra's
  core attention, for `GPTModelConfig.transformer_layer_spec`;
- `iterator`: the training iterator, dataset provider, forward step and loss over the shared
  per-step pipeline (`megatron.libra.steps`);
- `main`: `pretrain_gpt_libra.py`'s entry.

`args` and `yaml_cfg` import without `megatron.training` (megatron-core 0.16 too); the others
need it.
"""
