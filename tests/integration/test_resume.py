"""Resume as Megatron-LM users expect: changed settings that break an exact continuation are
refused (naming old and new values) unless overridden, a finished run has nothing to do, and a
damaged checkpoint is named in one line with the newest intact iteration."""

import pytest

from megatron.libra.cli import main
from megatron.libra.config import TrainConfig
from megatron.libra.launch import launch

pytestmark = pytest.mark.slow  # spawns training or multi-rank processes

CPU_TINY = "configs/train/cpu_tiny.yaml"
BASE = ["schedule.train_steps=2", "schedule.warmup_steps=0", "parallel.cp=1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished 2-step run on 2 ranks with checkpoints at steps 1 and 2."""
    ck = tmp_path_factory.mktemp("resume") / "ck"
    over = BASE + [f"checkpoint.dir={ck}", "checkpoint.save_interval=1"]
    hist = launch(TrainConfig.load(CPU_TINY, over), 2, 2)
    return ck, over, hist


def _train(over, capsys):
    try:
        rc = main(["train", "--config", CPU_TINY, "--nproc", "2", *over])
    except SystemExit as e:  # a failed worker: reported in one line, exit 1
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_resuming_a_finished_run_has_nothing_to_do(saved, capsys):
    ck, over, _ = saved
    rc, out, _ = _train(over, capsys)
    assert rc == 0 and "nothing to do" in out and "iter_0000002" in out


@pytest.mark.parametrize(
    "change, message",
    [
        ("optimizer.lr=0.01", "optimizer.lr = 0.003 there, 0.01 here"),
        ("schedule.train_steps=4", "schedule.decay_steps = 2 there, 4 here"),
        ("schedule.decay_style=linear", "schedule.decay_style = 'cosine' there, 'linear' here"),
    ],
)
def test_changed_schedule_is_refused_unless_overridden(saved, capsys, change, message):
    ck, over, _ = saved
    rc, _, err = _train(over + [change], capsys)
    assert rc == 2 and message in err and "checkpoint.override_scheduler=true" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ("data.seed=7", "data.seed = 1234 there, 7 here"),
        ("system.name=ulysses", "system.name = 'libra' there, 'ulysses' here"),
        ("data.context=256", "data.context = 128 there, 256 here"),
        ("system.cost_model=online", "system.cost_model = 'pairs' there, 'online' here"),
    ],
)
def test_changed_data_or_system_is_refused_unless_finetuning(saved, capsys, change, message):
    ck, over, _ = saved
    rc, _, err = _train(over + [change], capsys)
    assert rc == 2 and message in err and "checkpoint.finetune=true" in err


def test_override_scheduler_continues_and_finetune_restarts_from_the_weights(saved):
    ck, over, _ = saved
    more = launch(
        TrainConfig.load(CPU_TINY, over + ["schedule.train_steps=3",
                                           "checkpoint.override_scheduler=true"]), 2, 2
    )
    assert [h["step"] for h in more] == [3]  # continued from step 2
    tuned_dir = ck.parent / "tuned"
    tuned = launch(
        TrainConfig.load(CPU_TINY, BASE + [f"checkpoint.load_dir={ck}", "checkpoint.finetune=true",
                                           f"checkpoint.dir={tuned_dir}", "data.seed=7",
                                           "checkpoint.save_interval=0"]), 2, 2
    )
    assert [h["step"] for h in tuned] == [1, 2]  # from step 0, with the loaded weights
    assert (tuned_dir / "iter_0000002").is_dir()  # saved beside its source, which is untouched
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_finetune_and_resume_never_overwrite_a_run(saved, capsys, tmp_path):
    ck, over, _ = saved
    rc, _, err = _train(BASE + [f"checkpoint.dir={ck}", "checkpoint.finetune=true"], capsys)
    assert rc == 2 and "checkpoint.finetune needs checkpoint.load_dir" in err
    rc, _, err = _train(BASE + [f"checkpoint.dir={ck}", f"checkpoint.load_dir={ck}",
                                "checkpoint.finetune=true"], capsys)
    assert rc == 2 and "checkpoint.finetune would write into its source" in err
    rc, _, err = _train(over + ["checkpoint.resume=false"], capsys)
    assert rc == 2 and f"checkpoint.dir {ck} already holds a run (latest iteration" in err
    assert "this run would overwrite its iterations" in err and err.count("\n") == 1
    rc, _, err = _train(BASE + [f"checkpoint.dir={tmp_path / 'new'}",
                                f"checkpoint.load_dir={tmp_path}"], capsys)
    assert rc == 2 and "holds no checkpoint" in err


def test_a_finished_run_extends_with_its_schedule_into_a_new_directory(saved, capsys, tmp_path):
    """The "nothing to do" message says how to extend; following it from iteration 1 of the
    source into a new directory (checkpoint.load_dir) trains step 2 exactly as the source run
    did, then step 3 past the saved decay at min_lr."""
    import shutil

    src, over, hist = saved
    ck = tmp_path / "source"  # the finished 2-step run as it was (other tests extend `saved`)
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("iter_0000003"))
    (ck / "latest_checkpointed_iteration.txt").write_text("2")
    over = [o for o in over if not o.startswith("checkpoint.dir")] + [f"checkpoint.dir={ck}"]
    rc, out, _ = _train(over, capsys)
    assert rc == 0 and "raise schedule.train_steps" in out and "schedule.decay_steps=2" in out
    rc, _, err = _train(over + ["schedule.train_steps=3"], capsys)
    assert rc == 2 and "schedule.decay_steps = 2 there, 3 here" in err
    assert "schedule.decay_steps=2 to keep the saved one" in err
    new = tmp_path / "extended"
    more = launch(TrainConfig.load(CPU_TINY, BASE + [
        f"checkpoint.load_dir={ck}", "checkpoint.load_iteration=1", f"checkpoint.dir={new}",
        "schedule.train_steps=3", "schedule.decay_steps=2"]), 2, 2)
    assert [h["step"] for h in more] == [2, 3]
    assert more[0]["loss"] == hist[1]["loss"]  # the source's own step 2, bit for bit
    assert (new / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_damaged_checkpoints_are_named_with_the_newest_intact_iteration(saved, capfd, tmp_path):
    import shutil

    ck, over, _ = saved
    bad = tmp_path / "ck"
    shutil.copytree(ck, bad)
    (bad / "latest_checkpointed_iteration.txt").write_text("2")
    over_bad = [o for o in over if not o.startswith("checkpoint.dir")] + [f"checkpoint.dir={bad}"]
    over_bad += ["schedule.train_steps=2"]
    (bad / "iter_0000002" / ".metadata").unlink()
    rc, _, err = _train(over_bad, capfd)
    assert rc == 2 and err.count("\n") == 1
    assert "iter_0000002 is damaged (.metadata is missing)" in err
    assert "checkpoint.load_iteration=1" in err
    shutil.rmtree(bad / "iter_0000002")
    (bad / "iter_0000002").mkdir()
    rc, _, err = _train(over_bad, capfd)
    assert rc == 2 and "the directory is empty" in err
    shutil.rmtree(bad / "iter_0000002")
    shutil.copytree(ck / "iter_0000002", bad / "iter_0000002")
    shard = next(p for p in (bad / "iter_0000002").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(b"")
    rc, _, err = _train(over_bad, capfd)
    assert rc == 2 and f"{shard.name} is empty" in err
    shutil.rmtree(bad / "iter_0000002")
    shutil.copytree(ck / "iter_0000002", bad / "iter_0000002")
    shard = sorted(p for p in (bad / "iter_0000002").iterdir() if p.suffix == ".distcp")[-1]
    shard.unlink()  # a deleted shard
    rc, _, err = _train(over_bad, capfd)
    assert rc == 2 and f"({shard.name} is missing)" in err and err.count("\n") == 1
    shutil.copy(ck / "iter_0000002" / shard.name, shard)
    meta = bad / "iter_0000002" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])  # .metadata truncated
    rc, _, err = _train(over_bad, capfd)
    assert rc == 2 and ".metadata does not load" in err and err.count("\n") == 1
    shutil.copy(ck / "iter_0000002" / ".metadata", meta)
    big = max((p for p in (bad / "iter_0000002").iterdir() if p.suffix == ".distcp"),
              key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())  # 4 KiB of other bytes inside a shard's tensor data
    data[len(data) // 3: len(data) // 3 + 4096] = bytes(range(256)) * 16
    big.write_bytes(bytes(data))
    longer = ["schedule.train_steps=3", "schedule.decay_steps=2"]  # something left to train
    rc, _, err = _train(over_bad + longer, capfd)  # found by the ranks as they load: one line
    assert rc == 1 and err.count("\n") == 1, err  # the run's own lines are on stdout
    assert "libra train: worker" in err and f"{big.name} does not match its saved checksum" in err
    assert "checkpoint.load_iteration=1" in err
    # the hint works: resume from the intact iteration 1 and train step 2 again
    hist = launch(TrainConfig.load(CPU_TINY, over_bad + ["checkpoint.load_iteration=1"]), 2, 2)
    assert [h["step"] for h in hist] == [2]


def test_train_prints_start_up_iteration_save_and_summary_lines(tmp_path, capfd):
    over = BASE + [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.save_interval=2",
                   "logging.log_interval=2"]
    assert main(["train", "--config", CPU_TINY, "--nproc", "2", *over]) == 0
    out, err = capfd.readouterr()
    for line in ("------------------------ libra train: config ---",
                 f"  data.context {'.' * 36} 128", f'  system.name {"." * 37} "libra"',
                 "libra train: layout: world 2 = tp 1 x cp 1",
                 "parameters on this rank", "libra train: attention backend: ",
                 "libra train: data: synthetic documents", "saved checkpoint at iteration 2 to",
                 "libra train: done: 2 step(s)"):
        assert line in out, (line, out[-3000:])
    assert err == "", err[-3000:]  # stdout holds the run's lines, stderr only what went wrong
    it = next(x for x in out.splitlines() if "iteration        2/       2" in x)
    for field in ("consumed samples:            8", "elapsed time per iteration (ms):",
                  "throughput per GPU (TFLOP/s/GPU):", "global batch size:     4", "lm loss:",
                  "number of skipped iterations:   0", "number of nan iterations:   0",
                  "attn work max/mean:", "exchange MB/rank:"):
        assert field in it, (field, it)
    assert "Transformer Engine and Apex are not installed" not in out + err  # filtered
