"""pretrain_gpt_libra.py's --yaml-cfg: a YAML file of Megatron-LM's and Libra's arguments, read
as the command-line arguments it stands for (megatron/libra/megatron_lm/yaml_cfg.py: yaml_argv), checked
against the parser. A parser with a few of Megatron-LM's arguments stands in for its own here
(the script's tests read configs/megatron/cpu_tiny.yaml with the real one)."""

from __future__ import annotations

import argparse

import pytest

from megatron.libra.megatron_lm.args import add_libra_args
from megatron.libra.megatron_lm.yaml_cfg import expand_yaml_cfg, yaml_argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt_libra.py", allow_abbrev=False)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--data-path", nargs="*", default=None)
    p.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    p.add_argument("--mock-data", action="store_true")
    p.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--dataloader-type", default=None, choices=["single", "cyclic", "external"])
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--eval-iters", type=int, default=100)
    p.add_argument("--yaml-cfg", default=None)
    return add_libra_args(p)


def _write(tmp_path, text: str) -> str:
    f = tmp_path / "x.yaml"
    f.write_text(text)
    return str(f)


def test_keys_sections_flags_lists_and_the_libra_section_become_arguments(tmp_path):
    path = _write(tmp_path, """
model:
  num_layers: 2
  disable_bias_linear: true     # a flag by its option's name
  seq-length: 128               # dashes work too
data:
  data_path: [a, b]
mock_data: false                 # a flag at its default: nothing to pass
libra:
  name: wlb
  pool_size: 2
  chunks: 3
  tap: false                    # --no-libra-tap
  wlb_max_delay: 2
  block: null                   # null: the default
""")
    argv = yaml_argv(path, _parser())
    assert argv == ["--num-layers", "2", "--disable-bias-linear", "--seq-length", "128",
                    "--data-path", "a", "b", "--libra-system", "wlb",
                    "--libra-pool-size", "2", "--libra-chunks", "3", "--no-libra-tap",
                    "--libra-wlb-max-delay", "2"]
    args = _parser().parse_args(argv)
    assert (args.num_layers, args.add_bias_linear, args.libra_system, args.libra_pool_size,
            args.libra_tap, args.libra_chunks, args.data_path) == (2, False, "wlb", 2, False, 3,
                                                                  ["a", "b"])


def test_the_command_line_wins_over_the_file(tmp_path, monkeypatch):
    path = _write(tmp_path, "num_layers: 2\nlibra:\n  name: wlb\n  chunks: 3\n")
    import megatron.libra.megatron_lm.yaml_cfg as mlm

    monkeypatch.setattr(mlm, "_megatron_parser", _parser)
    argv, got = expand_yaml_cfg(["--libra-system", "libra", "--yaml-cfg", path,
                                 "--num-layers", "4"])
    assert got == path
    args = _parser().parse_args(argv)
    assert (args.libra_system, args.num_layers, args.libra_chunks) == ("libra", 4, 3)
    assert args.yaml_cfg is None  # Megatron-LM's own YAML mode stays off
    argv, got = expand_yaml_cfg([f"--yaml-cfg={path}"])
    assert got == path and _parser().parse_args(argv).num_layers == 2
    assert expand_yaml_cfg(["--num-layers", "1"]) == (["--num-layers", "1"], None)


def test_a_dataset_on_the_command_line_replaces_the_files_mock_data(tmp_path, monkeypatch):
    # the README's "a dataset of your own": the tiny YAML with --data-path on the command line
    path = _write(tmp_path, "num_layers: 2\nmock_data: true\n")
    import megatron.libra.megatron_lm.yaml_cfg as mlm

    monkeypatch.setattr(mlm, "_megatron_parser", _parser)
    argv, _ = expand_yaml_cfg(["--yaml-cfg", path, "--data-path", "corpus/x_text_document"])
    args = _parser().parse_args(argv)
    assert not args.mock_data and args.data_path == ["corpus/x_text_document"]
    argv, _ = expand_yaml_cfg(["--yaml-cfg", path, "--data-path=corpus/y"])
    assert "--mock-data" not in argv
    argv, _ = expand_yaml_cfg(["--yaml-cfg", path])  # without one, the file's mock data
    assert _parser().parse_args(argv).mock_data


BAD = [
    ("num_layer: 2\n", "num_layer is not a Megatron-LM or Libra argument (did you mean "
                       "num_layers?)"),
    ("training:\n  eval_itrs: 0\n", "training.eval_itrs is not a Megatron-LM or Libra argument "
                                    "(did you mean eval_iters?)"),
    ("libra:\n  chunk: 2\n", "libra.chunk is not a key of the system section or one of name, "
                             "pool_size, data, workload, lengths_file, attention_time (did you "
                             "mean chunks?)"),
    ("libra: wlb\n", "libra: expected a mapping (the system section)"),
    ("num_layers: [1, 2]\n", "num_layers: --num-layers takes one value, not a list"),
    ("mock_data: 3\n", "mock_data: --mock-data is a flag: give true or false, not 3"),
    ("disable_bias_linear: yes please\n", "disable_bias_linear: --disable_bias_linear is a "
                                          "flag: give true or false, not 'yes please'"),
    ("num_layers: 2\nmodel:\n  num_layers: 3\n",
     "model.num_layers sets --num-layers again (as num_layers did)"),
    ("libra:\n  name: wlb\n  system: libra\n",
     "libra.system sets --libra-system again (as libra.name did)"),
    ("calculate_per_token_loss: false\n",  # Libra's default, and no flag turns it off
     "calculate_per_token_loss: --calculate-per-token-loss cannot be set to False"),
    ("yaml_cfg: other.yaml\n", "yaml_cfg: a --yaml-cfg file cannot name another"),
    ("- 1\n- 2\n", "expected a mapping of argument names to values"),
    ("a: [1\n", "not YAML"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[b[1][:30] for b in BAD])
def test_a_bad_file_is_refused_naming_the_key(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        yaml_argv(path, _parser())
    assert str(e.value).startswith(f"--yaml-cfg {path}: ") and message in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_a_bad_value_is_refused_by_the_parser_naming_the_argument(tmp_path, capsys):
    argv = yaml_argv(_write(tmp_path, "libra:\n  name: bogus\n"), _parser())
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    assert "argument --libra-system: invalid choice: 'bogus'" in capsys.readouterr().err


def test_a_missing_file_and_an_empty_one(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        yaml_argv(str(tmp_path / "none.yaml"), _parser())
    assert yaml_argv(_write(tmp_path, "# nothing\n"), _parser()) == []
    with pytest.raises(ValueError, match="--yaml-cfg: expected a file path"):
        expand_yaml_cfg(["--yaml-cfg"])


def test_a_resume_names_each_changed_setting_and_reads_older_checkpoints():
    from megatron.libra.megatron_lm.args import changed_settings

    now = {"--libra-system": "wlb", "--libra-chunks": 2, "--libra-data": "megatron"}
    assert changed_settings(dict(now), now) == []
    assert changed_settings({**now, "--libra-chunks": 3}, now) == [
        "--libra-chunks = 3 there, 2 here"]
    # saved before --libra-data existed: Megatron's own dataset, the same stream
    old = {k: v for k, v in now.items() if k != "--libra-data"}
    assert changed_settings(old, now) == []
    assert changed_settings(old, {**now, "--libra-data": "synthetic"}) == [
        "--libra-data = 'megatron' there, 'synthetic' here"]


def test_a_resume_may_change_what_attention_keeps_for_backward():
    from megatron.libra.megatron_lm.args import libra_settings

    p = _parser()
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    keep = libra_settings(p.parse_args([]))
    assert "--libra-attention-memory" not in keep and "--libra-chunks" in keep
    assert libra_settings(p.parse_args(["--libra-attention-memory", "rebuild"])) == keep
