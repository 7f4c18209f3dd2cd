"""pretrain_gpt_libra.py: Libra inside Megatron-LM's own training loop (megatron.training of
megatron-core >= 0.19, Python >= 3.12), on CPU with gloo."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.processes import with_token

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                       reason="megatron.training ships with megatron-core >= 0.19 (Python >= "
                              "3.12): .ci/run's second environment runs these"),
    pytest.mark.slow,
]

TINY = [
    "--distributed-backend", "gloo", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
    "--lr", "1e-3", "--use-cpu-initialization", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--log-interval", "1", "--eval-iters", "0",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
]
MOCK = ["--mock-data", "--vocab-size", "512", "--tokenizer-type", "NullTokenizer"]


RANKS = r"""
import ctypes, os, runpy, signal, sys
nproc, port, script, *args = sys.argv[1:]
nproc = int(nproc)
from megatron.libra.notices import quiet_megatron_notices
quiet_megatron_notices()
import megatron.training.training  # noqa: F401 (Megatron-LM's loop and Libra's, imported once)
import megatron.libra.megatron_lm.main  # noqa: F401
try:  # the tokenizers' module (Transformers), which each rank would import as it starts
    import megatron.core.tokenizers.text  # noqa: F401
except ImportError:
    pass
pids = []
for rank in range(nproc):
    pid = os.fork()
    if pid == 0:  # a rank, with the environment torchrun gives it
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # (PR_SET_PDEATHSIG: it ends with this)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        raise SystemExit(0)
    pids.append(pid)
codes = {}
while len(codes) < nproc:
    pid, status = os.wait()
    codes[pid] = os.waitstatus_to_exitcode(status)
    if codes[pid] != 0:  # as torchrun does: one rank failed, the others end
        for other in set(pids) - set(codes):
            os.kill(other, signal.SIGTERM)
sys.exit(next((c for c in codes.values() if c), 0))
"""
"""`nproc` ranks of a script, each with the environment torchrun gives it (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT), forked from one process that has imported Megatron-LM's training
loop once: torchrun's ranks would import it each (about 10 s of CPU a rank). torchrun itself
runs in the tests that are about it (the sbatch script, the killed runs)."""


def _ranks(nproc: int, args: list[str], timeout: int = 600, tiny: bool = True,
           env: dict | None = None) -> subprocess.CompletedProcess:
    from libra_ext.distributed import free_port

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    for attempt in range(2):
        cmd = [sys.executable, "-c", RANKS, str(nproc), str(free_port()),
               str(ROOT / "pretrain_gpt_libra.py"), *(TINY if tiny else []), *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env=env)
        # the rendezvous port can be taken between free_port() and rank 0's bind, seconds
        # later, by another run's sockets (two runs go at a time): once more on a new port
        if p.returncode == 0 or "EADDRINUSE" not in p.stderr or attempt:
            return p


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"\] iteration +\d+/ *\d+ \|.*?lm loss: ([0-9.E+-]+)",
                                         out)]


def _validation(out: str) -> dict:
    """Megatron-LM's validation lines: {prefix after "at ": loss}."""
    return {m[0]: float(m[1]) for m in re.findall(
        r"validation loss at (iteration \d+(?: on validation set)?) \| lm loss value: "
        r"([0-9.E+-]+) \| lm loss PPL: [0-9.E+-]+ \|", out)}


def test_every_system_and_two_pipeline_stages_train_and_validate_to_the_same_losses(tmp_path):
    # 4 processes, cp 2: dp 2 in one pool of 2 per system, and 2 pipeline stages (libra, wlb);
    # the same model, weights and samples. WLB-LLM holds nothing back here (outlier length
    # above the sequence), so its steps hold the same documents and its losses must equal the
    # others'. Validation (--eval-iters 1 --eval-interval 1) at every iteration and at the end
    # (the same batches each time: the end's equals the last iteration's), planned by each
    # system with a planner of its own, the same under every system. Under pipeline
    # parallelism the stages exchange each activation's shape (tokens per rank change from
    # micro-batch to micro-batch), and per-document CP's padding needs it.
    runs, vals = {}, {}
    ck, tb = tmp_path / "ck", tmp_path / "tb"
    cases = [(s, 1) for s in ("libra", "ulysses", "wlb", "distca")] + [("wlb", 2), ("libra", 2)]

    def launch(case):
        system, pp = case
        extra = ["--libra-wlb-outlier-len", "100000"] if system == "wlb" else []
        if (system, pp) == ("libra", 1):  # checkpoints, TensorBoard, timers (once)
            extra += ["--save", str(ck), "--save-interval", "1", "--ckpt-format", "torch",
                      "--tensorboard-dir", str(tb), "--timing-log-level", "2"]
        return _ranks(4, [*MOCK, "--global-batch-size", "8", "--train-iters", "2",
                             "--eval-iters", "1", "--eval-interval", "1",
                             "--context-parallel-size", "2",
                             "--libra-pool-size", "2" if pp == 1 else "1",
                             "--pipeline-model-parallel-size", str(pp),
                             "--libra-system", system, *extra])

    # two runs at a time: a run's import and its process groups' set-up each leave a core idle
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(launch, cases))
    for (system, pp), run in zip(cases, done):
        assert run.returncode == 0, run.stderr[-3000:]
        losses = _losses(run.stdout)
        assert len(losses) == 2, run.stdout[-3000:]
        runs[(system, pp)] = losses
        val = _validation(run.stdout)
        assert set(val) == {"iteration 1", "iteration 2", "iteration 2 on validation set"}, \
            run.stdout[-3000:]
        assert val["iteration 2"] == val["iteration 2 on validation set"]
        vals[(system, pp)] = val
        if (system, pp) == ("libra", 1):  # Libra's timers among Megatron-LM's
            assert re.search(r"libra-plan-wait \.+: \([0-9.]+, [0-9.]+\)", run.stdout)
            assert re.search(r"libra-pool-exchange-wait \.+: \([0-9.]+, [0-9.]+\)", run.stdout)
        if pp == 2:
            continue
        # Megatron-LM's iteration line, and Libra's fields beside it
        assert re.search(r"iteration +2/ +2 \| consumed samples: +16 \|", run.stdout)
        cp = "CP all-gather \\+ reduce" if system == "wlb" else "CP all-to-all"
        assert re.search(rf"libra \| iteration +2 \| system: {system} \| tokens/s: [0-9.]+ \| "
                         r"attn work max/mean: [0-9.]+ \| attn time max/mean: [0-9.]+ \(mean "
                         r"[0-9.]+ ms/iteration\) \| inter-pool imbalance: [0-9.]+ \| planning "
                         rf"ms: [0-9.]+ \| pool exchange MB/rank: [0-9.]+ \| {cp} MB/rank: "
                         r"[0-9.]+ \|", run.stdout), run.stdout[-2000:]
        # the kernel's pick is one line (rank 0), not one per rank
        assert (run.stdout + run.stderr).count("attention backend:") == 1
    ref, ref_val = runs[("libra", 1)], vals[("libra", 1)]
    assert 5.0 < ref[0] < 7.0  # ln(512) = 6.24 at initialisation
    for key, losses in runs.items():
        for a, b in zip(losses, ref):
            assert abs(a - b) <= 1e-5 * abs(b), (key, losses, ref)
        for k, v in ref_val.items():
            assert abs(vals[key][k] - v) <= 1e-5 * abs(v), (key, k, vals)
    # the last iteration's checkpoint, after its validation
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # TensorBoard: Libra's scalars beside Megatron-LM's (read back from the event file)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("libra/attn work max over mean", "libra/attn time max over mean",
                "libra/inter-pool imbalance", "libra/pool exchange MB per rank",
                "libra/CP all-to-all MB per rank", "libra/tokens per s", "libra/planning ms",
                "lm loss validation"):
        assert tag in tags, (tag, sorted(tags))
    rate = acc.Scalars("libra/tokens per s")
    assert [e.step for e in rate] == [1, 2] and all(e.value > 0 for e in rate)


def test_the_same_losses_as_libra_train_on_the_same_model_weights_data_and_layout(tmp_path):
    # two loops, one answer: Megatron-LM's pretrain and `libra train`, both at cp 2 / pool 2 on
    # 4 processes, the same tiny GPT (weights drawn from --seed per global layer, as libra train
    # draws them), Libra's synthetic long-tail documents of the same seed, the same optimizer
    # and learning-rate schedule
    iters = 4
    mlm = _ranks(4, [
        "--libra-data", "synthetic", "--libra-workload", "libra-256k", "--vocab-size", "512",
        "--tokenizer-type", "NullTokenizer", "--ffn-hidden-size", "128", "--kv-channels", "16",
        "--untie-embeddings-and-output-weights", "--global-batch-size", "8", "--train-iters",
        str(iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "1", "--weight-decay", "0", "--adam-beta2", "0.95",
        "--clip-grad", "1.0", "--context-parallel-size", "2", "--libra-pool-size", "2",
        "--libra-chunks", "2"])
    assert mlm.returncode == 0, mlm.stderr[-3000:]
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    lt = subprocess.run(
        [sys.executable, "-m", "megatron.libra.cli", "train", "--config",
         "configs/train/cpu_tiny.yaml", "--nproc", "4", "data.context=256", "data.gbs=8",
         f"schedule.train_steps={iters}", "schedule.warmup_steps=1", "optimizer.lr=3e-3",
         "optimizer.min_lr=3e-4", "optimizer.weight_decay=0", "optimizer.adam_beta2=0.95",
         "optimizer.clip_grad=1.0", "system.chunks=2", "logging.log_interval=1",
         f"logging.metrics_file={metrics}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert lt.returncode == 0, lt.stderr[-3000:]
    ours = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    theirs = _losses(mlm.stdout)
    assert len(ours) == len(theirs) == iters, (ours, mlm.stdout[-2000:])
    assert 5.0 < ours[0] < 7.0
    # Megatron-LM (0.19) keeps the first iteration's loss in its interval sums, so its line at
    # iteration 2 prints the mean of iterations 1 and 2; every other line is its iteration's
    expect = [ours[0], (ours[0] + ours[1]) / 2, *ours[2:]]
    for i, (a, b) in enumerate(zip(theirs, expect)):
        assert abs(a - b) <= 1e-5 * abs(b), (i + 1, theirs, expect, ours)


BAD = [
    (["--libra-system", "bogus"], "argument --libra-system: invalid choice: 'bogus'"),
    (["--libra-pool-size", "3"],
     "--libra-pool-size (P=3) must divide the data-parallel size (D=2)"),
    (["--cp-comm-type", "p2p"], "--cp-comm-type p2p: with --libra-system libra"),
    (["--micro-batch-size", "2"], "--micro-batch-size 2: Libra's micro-batch is one packed"),
    (["--libra-chunks", "0"], "--libra-chunks must be >= 1, got 0"),
    (["--libra-data", "synthetic", "--libra-workload", "libra-1k"],
     "--libra-workload must be one of "),
    (["--libra-system", "megatron-hybrid"],
     "--libra-system megatron-hybrid runs megatron-core's hybrid CP scheduler, which needs a GPU"),
]


def _at_once(cmds: dict) -> dict:
    """name -> (command, environment), each run in a process of its own, all started at once
    (each keeps about one core busy): name -> its CompletedProcess."""
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=ROOT, env=env) for k, (cmd, env) in cmds.items()}
    out = {}
    try:
        for k, p in procs.items():
            stdout, stderr = p.communicate(timeout=600)
            out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


@pytest.fixture(scope="module")
def bad_argument_runs() -> dict:
    # one process standing for rank 0 of 4 (cp 2, dp 2) and no launcher: a refusal must come
    # before anything waits for the other ranks
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="4", RANK="0", LOCAL_RANK="0")
    base = [sys.executable, str(ROOT / "pretrain_gpt_libra.py"), *TINY, *MOCK,
            "--global-batch-size", "8", "--train-iters", "2", "--context-parallel-size", "2"]
    return _at_once({i: ([*base, *extra], env) for i, (extra, _) in enumerate(BAD)})


@pytest.mark.parametrize("case", range(len(BAD)), ids=[b[0][-2] for b in BAD])
def test_bad_arguments_are_refused_before_any_process_group(case, bad_argument_runs):
    message, run = BAD[case][1], bad_argument_runs[case]
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain_gpt_libra.py: error: ") and message in last, last
    assert "initializing torch distributed" not in run.stdout


def test_a_missing_data_path_is_refused_naming_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    run = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt_libra.py"), *TINY, "--vocab-size", "512",
         "--tokenizer-type", "NullTokenizer", "--global-batch-size", "2", "--train-iters", "1",
         "--data-path", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        f"pretrain_gpt_libra.py: error: --data-path: {tmp_path / 'nothing'}.bin does not exist")


def test_trains_and_validates_on_an_indexed_dataset_made_from_text_with_a_real_tokenizer(tmp_path):
    # a real text file, tokenized offline by the project's dataset tool (a byte-level BPE
    # trained on it), read back by Megatron-LM's own HuggingFaceTokenizer (--tokenizer-type)
    # from the folder the tool keeps beside the data and served by Megatron's own GPTDataset;
    # the plan's documents are the index's
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    paras = [p for p in text.split("\n\n") if p.strip()]
    for i, p in enumerate(paras):
        (corpus / f"doc{i:04d}.txt").write_text(p, encoding="utf-8")
    prefix = tmp_path / "readme"
    built = subprocess.run([sys.executable, str(ROOT / "tools/build_indexed_dataset.py"),
                            str(corpus), str(prefix)], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    assert built.returncode == 0, built.stderr[-2000:]
    hf = f"{prefix}.hf_tokenizer"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a folder on disk: nothing to fetch
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
        HuggingFaceTokenizer,
    )

    tok = HuggingFaceTokenizer(hf)
    data = IndexedDataset(str(prefix))
    # Megatron-LM's tokenizer gives the dataset's ids, and its eod closes every document
    assert tok.text_to_ids(paras[0]) == data[0][:-1].tolist()
    assert all(int(data[i][-1]) == tok.eod for i in range(len(data)))
    # validation on the index's held-out split, at iteration 2 and at the end
    run = _ranks(2, ["--data-path", str(prefix), "--split", "90,10,0", "--tokenizer-type",
                        "HuggingFaceTokenizer", "--tokenizer-model", hf,
                        "--global-batch-size", "4", "--train-iters", "2",
                        "--eval-iters", "2", "--eval-interval", "2",
                        "--context-parallel-size", "2"], env={"HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"tokenizer_type \.+ HuggingFaceTokenizer", run.stdout)
    assert "padded vocab (size: 512)" in run.stdout + run.stderr  # the BPE's 512 ids
    losses = _losses(run.stdout)
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), run.stdout[-2000:]
    assert "libra | iteration        2 | system: libra" in run.stdout
    val = _validation(run.stdout)
    assert set(val) == {"iteration 2", "iteration 2 on validation set"}, run.stdout[-3000:]
    assert val["iteration 2"] == val["iteration 2 on validation set"]  # the same batches
    assert all(0 < x < 10 for x in val.values())


def test_a_resume_with_other_libra_settings_is_refused_naming_old_and_new(tmp_path):
    ck = str(tmp_path / "ck")
    common = [*MOCK, "--global-batch-size", "2", "--train-iters", "2", "--save", ck,
              "--save-interval", "1", "--ckpt-format", "torch"]
    first = _ranks(1, common)
    assert first.returncode == 0, first.stderr[-3000:]
    # the planner's state sits beside Megatron-LM's shards, where its loader ignores it
    assert (tmp_path / "ck/iter_0000001/mp_rank_00/train_dataloader_dprank000.pt").is_file()
    import shutil

    shutil.rmtree(tmp_path / "ck/iter_0000002")  # "killed" after iteration 1's checkpoint
    (tmp_path / "ck/latest_checkpointed_iteration.txt").write_text("1")
    again = _ranks(1, [*common, "--load", ck, "--libra-chunks", "3"])
    assert again.returncode != 0
    assert ("resume at iteration 1 with other Libra settings than the checkpoint's: "
            "--libra-chunks = 2 there, 3 here") in again.stderr, again.stderr[-3000:]


def _state(path: Path) -> dict:
    import torch

    sd = torch.load(path / "mp_rank_00/model_optim_rng.pt", weights_only=False)
    flat = {}

    def walk(x, key):
        if isinstance(x, torch.Tensor):
            flat[key] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}[{i}]")

    walk(sd["model"], "model")
    walk(sd["optimizer"], "optimizer")
    return flat


def test_a_killed_run_resumes_to_the_uninterrupted_runs_losses_and_weights(tmp_path):
    # configs/megatron/cpu_tiny.yaml (cp 2, one pool of 2) with WLB-LLM from the command line,
    # which wins over the file's libra.name: WLB-LLM holds documents back across steps, so the
    # resumed run must get the planner's state from beside the checkpoint to run the same
    # documents. A run is killed (SIGKILL to torchrun and its workers) once iteration 2's
    # checkpoint is saved; resumed, every later iteration has the uninterrupted run's loss
    # (--libra-metrics-file: each iteration's own) and the weights and Adam states after the
    # last step are the same bits.
    import signal

    from libra_ext.distributed import free_port

    common = ["--yaml-cfg", "configs/megatron/cpu_tiny.yaml", "--train-iters", "4",
              "--libra-system", "wlb", "--save-interval", "2", "--ckpt-format", "torch"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run = _ranks(4, [*common, "--save", str(full), "--libra-metrics-file",
                        str(tmp_path / "full.jsonl")], tiny=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "arguments from --yaml-cfg configs/megatron/cpu_tiny.yaml" in run.stdout
    assert "libra | iteration        4 | system: wlb |" in run.stdout
    ref = [json.loads(x)["loss"] for x in (tmp_path / "full.jsonl").read_text().splitlines()]
    assert len(ref) == 4 and _losses(run.stdout)[0] == pytest.approx(ref[0], rel=1e-6)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(free_port()), str(ROOT / "pretrain_gpt_libra.py"), *common,
           "--save", str(cut)]
    # unbuffered: the save's line is read as it is printed, and the kill follows it
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    killed = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    from megatron.libra.launch import _below, _process_tree

    def kill_job():  # as a scheduler ends a job: torchrun and every worker (own sessions)
        for pid in [killed.pid, *_below([killed.pid], _process_tree())]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    seen = []
    try:
        for line in killed.stdout:
            seen.append(line)
            if "successfully saved checkpoint from iteration       2" in line:
                kill_job()
                break
    finally:
        if killed.poll() is None:
            kill_job()
        killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "".join(seen[-40:])
    assert not any("iteration        4/       4" in x for x in seen)  # killed before the end
    assert (cut / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    again = _ranks(4, [*common, "--save", str(cut), "--load", str(cut),
                          "--libra-metrics-file", str(tmp_path / "resumed.jsonl")], tiny=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "loading" in again.stdout and "iteration        3/       4" in again.stdout
    resumed = [json.loads(x) for x in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        assert abs(r["loss"] - ref[r["step"] - 1]) <= 1e-6 * abs(ref[r["step"] - 1]), (
            resumed, ref)
    a, b = _state(full / "iter_0000004"), _state(cut / "iter_0000004")
    assert a.keys() == b.keys() and len(a) > 20
    for k in a:
        assert a[k].dtype == b[k].dtype and bool((a[k] == b[k]).all()), k


def test_the_sbatch_script_runs_it_under_torchrun_on_every_node(tmp_path):
    # srun and scontrol are stand-ins (run here, name this host); torchrun and its c10d
    # rendezvous are real: 2 "GPUs" of one node, cp 2
    from tests.integration.test_slurm_scripts import _slurm

    env = dict(_slurm(tmp_path), PYTHONPATH=str(ROOT))
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/pretrain_gpt_libra.sbatch"), *TINY, *MOCK,
         "--global-batch-size", "2", "--train-iters", "1", "--context-parallel-size", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_losses(run.stdout)) == 1
    assert "libra | iteration        1 | system: libra" in run.stdout


def test_a_bad_yaml_cfg_is_refused_before_any_process_group(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text((ROOT / "configs/megatron/cpu_tiny.yaml").read_text()
                   + "  wlb_outlier_length: 4096\n")  # under libra: (wlb_outlier_len)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="4", RANK="0", LOCAL_RANK="0")
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt_libra.py"), "--yaml-cfg",
                          str(cfg)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=env)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"pretrain_gpt_libra.py: error: --yaml-cfg {cfg}: libra.wlb_outlier_length is not a "
        "key of the system section or one of name, pool_size, data, workload, lengths_file, "
        "attention_time (did you mean wlb_outlier_len?)")


def test_libra_ab_through_megatron_lm_writes_the_report_of_libra_ab(tmp_path):
    # `libra ab --trainer megatron`: Libra and Ulysses through this script (cpu_tiny.yaml,
    # Libra's synthetic documents), interleaved, into libra ab's report and figures
    out = tmp_path / "ab"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "megatron.libra.cli", "ab", "--trainer", "megatron", "--config",
         "configs/megatron/cpu_tiny.yaml", "--nproc", "4", "--steps", "3", "--repeats", "1",
         "--out", str(out), "--json", "--", "--libra-data", "synthetic"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert r["trainer"] == "megatron" and r["world_size"] == 4 and r["steps"] == 3
    assert list(r["systems"]) == ["libra", "ulysses"]
    for name, s in r["systems"].items():
        assert len(s["loss"]) == 3 and 5.0 < s["loss"][0] < 7.0
        assert s["max_rel_loss_diff_vs_ulysses"] <= 1e-5, (name, s["loss"])
        assert all(g > 0 for g in s["grad_norm"])  # Megatron-LM's own line's
        assert len(s["attn_time_per_rank"][0]) == 4 and s["tokens"][0] == 8 * 256
    # Libra's plan balances the pool's attention work at least as well as Ulysses' placement
    lib, uly = (sum(r["systems"][n]["attn_work_max_over_mean"]) for n in ("libra", "ulysses"))
    assert lib <= uly + 1e-9
    # every rank sends: the CP group's all-to-alls (and, for Libra, the pool's exchange)
    assert all(b > 0 for n in ("libra", "ulysses") for b in r["systems"][n]["bytes_exchanged"])
    assert json.loads((out / "ab.json").read_text())["trainer"] == "megatron"
    report = (out / "report.md").read_text()
    assert "Trainer: Megatron-LM's own loop (`pretrain_gpt_libra.py`" in report
    for fig in ("loss.png", "attention_time.png", "tokens_per_s.png"):
        assert (out / fig).stat().st_size > 1000


def test_eval_iters_alone_validates_at_the_end_and_keeps_the_last_checkpoint(tmp_path):
    # --eval-iters without --eval-interval, Libra's synthetic documents: one validation at the
    # last iteration (and Megatron-LM's at the end), then the last interval's checkpoint
    ck = tmp_path / "ck"
    run = _ranks(4, ["--libra-data", "synthetic", "--vocab-size", "512", "--tokenizer-type",
                        "NullTokenizer", "--global-batch-size", "8", "--train-iters", "4",
                        "--eval-iters", "2", "--context-parallel-size", "2",
                        "--libra-pool-size", "2", "--save", str(ck), "--save-interval", "2",
                        "--ckpt-format", "torch"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert set(_validation(run.stdout)) == {"iteration 4", "iteration 4 on validation set"}
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def _kill_mid_save(cmd: list[str], ck: Path, marker: str, tmp_path: Path) -> list[int]:
    """Start `cmd` in a session of its own with a token in its environment, SIGKILL the whole
    session once a checkpoint save is under way (`marker` appears under `ck`), and return what
    is still alive of it 5 s later."""
    import signal
    import time
    import uuid

    token = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LIBRA_RUN_TOKEN=token)
    with open(tmp_path / "log", "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        t0 = time.monotonic()
        while not (ck / marker).exists():
            assert p.poll() is None and time.monotonic() - t0 < 300, \
                (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.05)
        assert with_token(token), "the run is not running"
        os.killpg(p.pid, signal.SIGKILL)  # the launcher (torchrun's workers have sessions of
        p.wait()  # their own)
        time.sleep(5)
    left = with_token(token)
    for pid in left:  # (whatever a failure leaves behind)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def test_a_run_killed_mid_save_leaves_no_process_behind(tmp_path):
    # scripts/pretrain_gpt_cpu.sh (Megatron-LM's GPT launch shrunk to CPU: 2 pipeline stages x
    # cp 2, validation, TensorBoard, torch_dist checkpoints) killed with SIGKILL - torchrun -
    # while its workers save: every worker, megatron-core's writer processes and their result
    # queue's manager, and the resource trackers end with it
    from libra_ext.distributed import free_port

    ck = tmp_path / "ck"
    cmd = ["bash", str(ROOT / "scripts/pretrain_gpt_cpu.sh"), str(ck), str(tmp_path / "tb"),
           "--train-iters", "50", "--save-interval", "2", "--eval-interval", "2"]
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["PYTHON"] = sys.executable
    try:
        assert _kill_mid_save(cmd, ck, "iter_0000004", tmp_path) == []
    finally:
        del os.environ["MASTER_PORT"], os.environ["PYTHON"]
    log = (tmp_path / "log").read_text()
    assert "validation loss at iteration 2 |" in log and "iteration        2/      50" in log


def test_refusals_come_first_once_and_name_what_fails(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="4", RANK="0", LOCAL_RANK="0")
    base = [sys.executable, str(ROOT / "pretrain_gpt_libra.py"), "--yaml-cfg",
            str(ROOT / "configs/megatron/cpu_tiny.yaml")]
    libra_first = (  # Libra's checks before Megatron-LM's own (its --dataloader-type check)
        (["--hybrid-context-parallel"], "--hybrid-context-parallel is megatron-core's own "
         "CP scheduler; use it with --libra-system megatron-hybrid, not libra"),
        (["--sequence-parallel", "--tensor-model-parallel-size", "2"],
         "--sequence-parallel needs Transformer Engine layers"),
        (["--use-distributed-optimizer"], "--use-distributed-optimizer needs a GPU"))
    # every run at once (one process each, about one core each)
    runs = _at_once({"min-lr": ([*base, "--min-lr", "1"], env),
                     "min-lr rank 1": ([*base, "--min-lr", "1"], dict(env, RANK="1")),
                     "help": ([*base[:2], "--help"], env),
                     **{i: ([*base, *extra], env) for i, (extra, _) in enumerate(libra_first)}})
    for name, run in runs.items():
        assert run.returncode == (0 if name == "help" else 2), (name, run.stderr[-2000:])
    # Megatron-LM's own assertion without a message: the failing statement and where it is
    run = runs["min-lr"]
    assert run.stderr.strip().splitlines()[-1].startswith(
        "pretrain_gpt_libra.py: error: assert args.min_lr <= args.lr "
        "(megatron/training/arguments.py:"), run.stderr[-1000:]
    # the refusal is the first thing on stdout and stderr (no argument dump before it), once;
    # another rank says nothing
    assert "arguments" not in run.stdout and run.stderr.count("error:") == 1
    assert runs["min-lr rank 1"].stderr.count("error:") == 0
    for i, (_, message) in enumerate(libra_first):
        last = runs[i].stderr.strip().splitlines()[-1]
        assert last.startswith("pretrain_gpt_libra.py: error: " + message), last
    # --help lists Megatron-LM's arguments and Libra's (a % in megatron-core's own help text)
    run = runs["help"]
    assert "--num-layers" in run.stdout and "--libra-system" in run.stdout
    assert "--moe-paged-stash-buffer-size-factor-cuda" in run.stdout
