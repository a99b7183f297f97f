"""The decisions the GPU paths make, checked on a CPU: which device each process takes, what
--precision auto means, that DataParallel replicas keep the autocast dtype, how many processes the
Accelerate config starts, that evaluation survives fewer examples than processes, and that a skipped
fp16 step does not advance the schedule. test_gpu.py runs the same paths on real GPUs, where present.
"""
import os
import re
import shutil
import subprocess
import threading

import pytest
import torch
import torch.nn as nn
import yaml
from conftest import ACCELERATE, PYTHON, ROOT, TORCHRUN, assert_ran, offline_env, run_as_user

from common.distributed import Launch, detect_launch, device_for, processes_for_this_machine, processes_note
from common.precision import Autocast, accelerate_mixed_precision, auto_precision, optimizer_step

CH4 = ROOT / "src" / "ch4"


# ---- which GPU each process takes ----

def torchrun(local_rank, local_world_size):
    return Launch(local_rank, local_rank, local_world_size, "torchrun", local_world_size)


@pytest.mark.parametrize("local_rank", [0, 3])
def test_one_gpu_per_process(local_rank):
    assert device_for(torchrun(local_rank, 4), gpu_count=4) == torch.device("cuda", local_rank)
    assert device_for(torchrun(local_rank, 4), gpu_count=8) == torch.device("cuda", local_rank)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_two_processes_on_one_gpu_stop_with_a_sentence(local_rank):
    """Every rank, rank 0 included, says it: NCCL would refuse the shared GPU later, with a traceback."""
    with pytest.raises(SystemExit, match=r"2 processes on this node but 1 GPU\(s\) visible.*--nproc_per_node=1"):
        device_for(torchrun(local_rank, 2), gpu_count=1)


@pytest.mark.parametrize("environ", [{}, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}])
def test_lightning_with_more_processes_than_gpus_says_what_to_run(environ):
    """`mnist_5_lightning.py --devices 2` (or torchrun x2) on one GPU: Trainer() would raise Lightning's
    MisconfigurationException; on the CPU, and on two GPUs, it goes ahead."""
    from common.lightning_launch import check_launch
    with pytest.raises(SystemExit, match=r"2 processes on this node need 2 GPUs and 1 are visible: run 1 "
                                         r"\(--devices 1, or torchrun --nproc_per_node=1\), or hide the GPUs"):
        check_launch(2, 1, environ, gpu_count=1)
    check_launch(2, 1, environ, gpu_count=0)
    check_launch(2, 1, environ, gpu_count=2)
    check_launch("auto", 1, {}, gpu_count=1)


def test_srun_gpus_per_task_shows_each_task_its_own_gpu():
    launch = Launch(5, 1, 8, "slurm", 4)
    assert device_for(launch, gpu_count=1, environ={"SLURM_GPUS_PER_TASK": "1"}) == torch.device("cuda", 0)
    with pytest.raises(SystemExit, match="srun --gpus-per-task=1"):
        device_for(launch, gpu_count=1, environ={})  # four tasks, one GPU they all see


def test_slurm_tasks_per_node_without_ntasks_per_node():
    """sbatch -n 6 on 4-GPU nodes: SLURM lists 4 tasks on the first node, 2 on the second."""
    environ = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "6", "SLURM_NODEID": "0",
               "SLURM_STEP_TASKS_PER_NODE": "4,2"}
    assert detect_launch(environ).local_world_size == 4
    assert detect_launch({**environ, "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x1),2"}).local_world_size == 2
    assert detect_launch({**environ, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}).local_world_size == 8
    with pytest.raises(SystemExit, match="8 processes on this node but 4 GPU"):  # every rank of the node says it
        device_for(detect_launch({**environ, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}), gpu_count=4)


def test_typed_gpus_per_task():
    launch = Launch(1, 1, 2, "slurm", 2)
    assert device_for(launch, gpu_count=1, environ={"SLURM_GPUS_PER_TASK": "a100:1"}) == torch.device("cuda", 0)


def test_launchers_without_local_world_size_count_up_to_their_local_rank():
    assert detect_launch({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}).local_world_size == 2


def test_no_gpus_means_the_cpu_and_two_processes():
    assert device_for(torchrun(1, 2), gpu_count=0) == torch.device("cpu")
    assert processes_for_this_machine(64, gpu_count=0) == 2
    assert processes_note(2, 64, gpu_count=0) == "2 processes on the CPU"


@pytest.mark.parametrize("global_batch", [64, 32, 128, 96])
def test_processes_per_machine_divide_the_global_batch(global_batch):
    """One per GPU where that count divides the batch, else the largest count that does (3 GPUs: 2)."""
    chosen = {gpus: processes_for_this_machine(global_batch, gpu_count=gpus) for gpus in range(1, 9)}
    for gpus, processes in chosen.items():
        assert global_batch % processes == 0 and processes <= gpus
        assert not any(global_batch % more == 0 for more in range(processes + 1, gpus + 1))
    if global_batch == 64:
        assert chosen == {1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 4, 8: 8}
        assert processes_note(4, 64, gpu_count=6) == "4 processes of 6 GPU(s): the largest count that divides the global batch 64"
        assert processes_note(8, 64, gpu_count=8) == "8 processes of 8 GPU(s)"


# ---- what --precision auto means ----

@pytest.mark.parametrize("capability, expected", [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"),
                                                  ((8, 9), "bf16"), ((9, 0), "bf16")])
def test_auto_on_gpus_is_bf16_from_ampere_on_and_fp16_with_scaling_before(capability, expected):
    assert auto_precision(torch.device("cuda", 0), capability=capability) == expected


def test_auto_on_cpus_is_bf16_only_with_bf16_units():
    assert auto_precision(torch.device("cpu"), has_bf16=True) == "bf16"
    assert auto_precision(torch.device("cpu"), has_bf16=False) == "fp32"


def test_auto_means_the_same_in_the_accelerate_scripts():
    here = auto_precision(torch.device("cpu"))
    as_accelerate = {"fp32": "no"}.get(here, here)
    assert accelerate_mixed_precision("auto", environ={}) == as_accelerate
    assert accelerate_mixed_precision("auto", environ={"ACCELERATE_MIXED_PRECISION": "no"}) == as_accelerate
    assert accelerate_mixed_precision("auto", environ={"ACCELERATE_MIXED_PRECISION": "bf16"}) == "bf16"
    assert accelerate_mixed_precision("fp32", environ={"ACCELERATE_MIXED_PRECISION": "bf16"}) == "no"


def test_help_says_what_auto_means(run_command):
    result = run_command(PYTHON, CH4 / "mnist_1_single.py", "--help")
    assert "fp16 with loss scaling on older CUDA GPUs" in " ".join(result.stdout.split())


# ---- DataParallel keeps the autocast dtype in every replica ----

def in_replica_thread(module, x, thread_dtype=None):
    """What nn.DataParallel does for each replica (torch/nn/parallel/parallel_apply.py): run it in a
    new thread that re-enters autocast with the caller's enabled flag, but not the caller's dtype, so
    the thread gets the device's default (fp16 on CUDA; bf16 on the CPU, hence thread_dtype to mimic CUDA)."""
    enabled, out = torch.is_autocast_enabled("cpu"), {}

    def replica():
        with torch.amp.autocast("cpu", enabled=enabled, dtype=thread_dtype):
            out["y"] = module(x)
    thread = threading.Thread(target=replica)
    thread.start()
    thread.join()
    return out["y"]


def test_a_replica_thread_loses_the_callers_autocast_dtype():
    """The defect itself: fp16 asked for in the calling thread, the replica's thread autocasts to bf16."""
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.get_autocast_dtype("cpu") == torch.float16
        assert in_replica_thread(lambda _: torch.get_autocast_dtype("cpu"), None) == torch.bfloat16


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_inside_the_module_survives_replica_threads(precision, dtype):
    model = Autocast(nn.Linear(8, 8), torch.device("cpu"), precision)
    replica = model._replicate_for_data_parallel()  # what DataParallel's replicate() makes of it each step
    with torch.autocast("cpu", dtype=dtype):
        assert in_replica_thread(replica, torch.randn(2, 8), thread_dtype=torch.float16).dtype == dtype
        assert in_replica_thread(replica, torch.randn(2, 8), thread_dtype=torch.bfloat16).dtype == dtype


def test_fp32_autocast_wrapper_changes_nothing():
    layer = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    assert torch.equal(Autocast(layer, torch.device("cpu"), "fp32")(x), layer(x))


# ---- a skipped fp16 step does not advance the schedule ----

@pytest.mark.parametrize("gradient, stepped", [(1.0, True), (float("inf"), False)])
def test_optimizer_step_says_whether_the_scaler_skipped(gradient, stepped):
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    scaler.scale((weight * gradient).sum()).backward()
    assert optimizer_step(optimizer, scaler) is stepped
    assert torch.equal(weight.detach(), torch.ones(3)) is not stepped


# ---- the Accelerate GPU config: every GPU, never a silent 2 ----

def test_multi_gpu_config_leaves_the_process_count_to_the_command(run_command, tiny_mnist):
    config = yaml.safe_load((CH4 / "accelerate_configs" / "multi_gpu_fp16.yaml").read_text())
    assert "num_processes" not in config and config["mixed_precision"] == "fp16"
    result = run_command(*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "multi_gpu_fp16.yaml",
                         CH4 / "mnist_4_accelerate.py", "--data-dir", tiny_mnist)
    assert result.returncode != 0 and "manually pass in `--num_processes`" in result.stderr, result.stderr[-2000:]


def test_a_multi_process_config_runs_one_process_as_on_one_gpu(run_command, tiny_mnist):
    """--num_processes 1 with a MULTI_GPU config: the path one GPU takes with multi_gpu_fp16.yaml."""
    result = run_command(*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "cpu_2_processes.yaml",
                         "--num_processes", "1", CH4 / "mnist_4_accelerate.py", "--data-dir", tiny_mnist)
    assert_ran(result, "1 process on cpu")


def test_cpu_config_runs_on_the_cpu_where_there_are_gpus(tmp_path):
    """cpu_2_processes.yaml on a machine with GPUs (CUDA_VISIBLE_DEVICES unset, as there): each process
    must see no GPU, or it would run NCCL on them. What torch would see is read from the variable
    accelerate exports, as torch.cuda reads it; Accelerate's state, made as the scripts make it, says where."""
    script = tmp_path / "where.py"
    script.write_text("import sys, torch\nfrom accelerate import PartialState\n"
                      "from common.distributed import detect_launch, device_for\n"
                      "state = PartialState(cpu=device_for(detect_launch()).type == 'cpu')\n"
                      "print(f'rank {state.process_index} of {state.num_processes}: {state.device.type} {state.backend} '\n"
                      "      f'{torch.cuda._parse_visible_devices()}', file=open(f'{sys.argv[1]}/{state.process_index}', 'w'))\n")
    environ = {key: value for key, value in offline_env().items() if key != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run([*ACCELERATE, "--config_file", str(CH4 / "accelerate_configs" / "cpu_2_processes.yaml"),
                             str(script), str(tmp_path)], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [(tmp_path / str(rank)).read_text() for rank in (0, 1)] == [f"rank {rank} of 2: cpu gloo []\n" for rank in (0, 1)]


def test_accelerate_ranks_build_the_same_model_before_prepare(tmp_path, tiny_bert, nli_pairs):
    """Under FSDP2 (fsdp2_gpus.yaml, GPUs only) prepare() shards each rank's own weights and broadcasts
    nothing, so nli_accelerate.py must build the same weights on every rank, the randomly initialized
    classifier head included, which a pretrained checkpoint lacks (as bert-base-cased does: the tiny
    BERT's head is removed). Recorded here as prepare() receives them, on 3 CPU processes."""
    from safetensors.torch import load_file, save_file
    pretrained = shutil.copytree(tiny_bert, tmp_path / "without-head")
    weights = load_file(pretrained / "model.safetensors")
    save_file({name: tensor for name, tensor in weights.items() if not name.startswith("classifier.")},
              pretrained / "model.safetensors", metadata={"format": "pt"})
    script = tmp_path / "record.py"
    script.write_text("import sys\nimport torch\nimport torch.distributed as dist\nfrom accelerate import Accelerator\n"
                      "sys.path.insert(0, 'src/ch4')\nimport nli_accelerate\nfrom common.cli import nli_parser\n\n"
                      "def record(accelerator, model, *others):\n"
                      "    torch.save(model.state_dict(), f'{sys.argv[1]}/{accelerator.process_index}.pt')\n"
                      "    dist.destroy_process_group()\n    sys.exit(0)\n\n"
                      "Accelerator.prepare = record\nnli_accelerate.training_function(nli_parser('').parse_args(sys.argv[2:]))\n")
    result = run_as_user(*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "cpu_2_processes.yaml",
                         "--num_processes", "3", script, tmp_path, "--model", pretrained, "--dataset", nli_pairs,
                         "--batch-size", "6", timeout=240)
    assert result.returncode == 0, result.stderr[:3000]
    built = [torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in range(3)]
    assert any("classifier" in name for name in built[0])
    for other in built[1:]:
        assert all(torch.equal(built[0][name], other[name]) for name in built[0])


# ---- evaluation with fewer examples than processes ----

@pytest.mark.parametrize("script", ["ddp.py", "nli_ddp_minimal.py", "sharded/nli_fsdp.py"])
def test_fewer_eval_pairs_than_processes(run_command, tiny_bert, nli_pairs, script):
    """Rank 2 has no evaluation pair; a forward through DDP on the others would broadcast buffers alone,
    and under FSDP every rank must run each forward (all-gathers): rank 2 scores a repeat and skips it."""
    result = run_command(*TORCHRUN, "--nproc_per_node=3", CH4 / script, "--model", tiny_bert, "--dataset", nli_pairs,
                         "--max-steps", "2", "--batch-size", "6", "--max-eval-samples", "2", "--dist-timeout", "60",
                         timeout=240)
    assert_ran(result, "over 2 pairs")


def test_lightning_with_fewer_test_images_than_processes(run_command, tmp_path):
    """One test image on 2 ranks: rank 1's test loader is empty, which Lightning refuses unless told."""
    from mnist_files import write_tiny_mnist
    data = write_tiny_mnist(tmp_path, train_size=64, test_size=1)
    result = run_command(*TORCHRUN, "--nproc_per_node=2", CH4 / "mnist_5_lightning.py", "--data-dir", data,
                         "--dist-timeout", "60", timeout=240)
    assert_ran(result, "over 1 images")


# ---- small ones ----

@pytest.mark.parametrize("script", ["nli_dp_minimal.py", "nli_ddp_minimal.py"])
def test_minimal_scripts_do_not_pretend_to_take_a_precision(run_command, script):
    result = run_command(PYTHON, CH4 / script, "--precision", "bf16")
    assert result.returncode == 2 and "unrecognized arguments: --precision" in result.stderr


def test_accelerate_and_ddp_follow_the_same_schedule(run_command, tiny_bert, nli_pairs):
    """The prepare()d scheduler of nli_accelerate.py steps once per process per step: built for the
    single-process step count it would reach zero halfway. After epoch 0 both scripts have the same lr."""
    flags = ["--model", tiny_bert, "--dataset", nli_pairs, "--epochs", "2", "--batch-size", "16",
             "--max-eval-samples", "4", "--precision", "fp32"]
    ddp = run_command(*TORCHRUN, "--nproc_per_node=2", CH4 / "ddp.py", *flags, "--dist-timeout", "60", timeout=240)
    accelerate = run_command(*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "cpu_2_processes.yaml",
                             CH4 / "nli_accelerate.py", *flags, timeout=240)
    rates = [re.findall(r"epoch (\d): mean training loss [\d.]+, learning rate ([\d.e+-]+)", result.stdout)
             for result in (ddp, accelerate)]
    assert rates[0] and rates[0] == rates[1], (rates, ddp.stderr[-1500:], accelerate.stderr[-1500:])
    assert float(rates[0][0][1]) > 0  # halfway through the schedule, not at its end


def test_cpu_suite_hides_gpus_from_what_it_starts(run_command):
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    result = run_command(PYTHON, "-c", "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.device_count())")
    assert result.stdout.split() == ["''", "0"]


@pytest.mark.parametrize("session_gpus, skipped", [("7", False), ("", True)])
def test_the_gpu_tests_get_the_sessions_gpus_on_every_worker(session_gpus, skipped):
    """`make test` runs tests/test_gpu.py on pytest-xdist workers, which a process that has hidden the GPUs
    starts: they must still see the session's CUDA_VISIBLE_DEVICES, or every GPU test skips on a GPU
    machine. --setup-plan decides the skips and runs nothing. Control: a session with none skips them."""
    env = {key: value for key, value in os.environ.items() if key != "CPU_SUITE_SESSION_CUDA_VISIBLE_DEVICES"}
    result = subprocess.run([PYTHON, "-m", "pytest", "--numprocesses=1", "-p", "no:cacheprovider", "-q", "-rs",
                             "--setup-plan", "tests/test_gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**env, "CUDA_VISIBLE_DEVICES": session_gpus})
    assert result.returncode in (0, 5), result.stdout[-2000:] + result.stderr[-2000:]  # 5: no test ran
    assert ("no GPU on this machine" in result.stdout) == skipped, result.stdout[-2000:]


def test_gpu_check_without_a_gpu_says_so_and_exits_0(run_command, tmp_path):
    """make gpu-check on a machine without a GPU: one sentence, exit 0, and the results page left alone."""
    page = tmp_path / "gpu_results.md"
    result = run_command(PYTHON, "tools/gpu_check.py", "--data-dir", tmp_path, "--output", page)
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    assert result.stdout == "gpu-check: no CUDA GPU is visible on this machine, so there is nothing to check; run it where there is one.\n"
    assert not page.exists()


def test_gpu_check_sets_the_plan_beside_the_bert_rows():
    """The GPU rows' code, run on the CPU on a tiny BERT: the model state it measures (fp32 AdamW: 4 + 4 + 8
    bytes a parameter) is the plan's, byte for byte but AdamW's step counters (one 4-byte scalar per
    parameter tensor: 41 here); the device name picks the plan's preset."""
    import importlib.util

    from transformers import BertConfig

    from planner.plan import GPUS
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    config = BertConfig(vocab_size=1100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=3)
    row = gpu_check.bert_base_row("fp32", torch.device("cpu"), config, batch=2, tokens=8, warmup=1, steps=1)
    beside = gpu_check.plan_beside(row, "fp32", GPUS["H100"], config)
    assert row["state_bytes"] - beside["state_bytes"] == 4 * 41, (row, beside)
    assert row["samples_per_s"] > 0 and 0 < beside["mfu"] < 1 and beside["total_bytes"] > beside["state_bytes"]
    names = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200", "NVIDIA A100-SXM4-80GB": "A100",
             "Tesla V100-SXM2-32GB": "V100", "NVIDIA L4": "L4", "NVIDIA L40S": None, "NVIDIA H100 PCIe": None,
             "NVIDIA H100 NVL": None}
    assert {name: gpu_check.gpu_preset(name) for name in names} == \
        {name: GPUS[key] if key else None for name, key in names.items()}
    measured = {"fp32": {**row, "peak_bytes": 10**9}}
    base = gpu_check.plan_beside(row, "fp32", GPUS["H100"])  # the page's rows are BERT-base's
    assert base["state_bytes"] == 16 * 109_484_547  # BertForSequenceClassification(BertConfig(num_labels=3))
    assert gpu_check.bert_table(measured, "NVIDIA H100 80GB HBM3")[-1] == (
        f"| fp32 | {row['samples_per_s']:.0f} ({base['samples_per_s']:.0f}) | {base['mfu']:.2f} | "
        f"{row['state_bytes'] / 1e9:.2f} (1.75) | 1.0 ({base['total_bytes'] / 1e9:.1f}) |")
    assert "no preset in planner.plan matches NVIDIA L40S" in "\n".join(gpu_check.bert_table(measured, "NVIDIA L40S"))


def test_gpu_check_writes_its_results_between_the_pages_markers(tmp_path):
    import importlib.util
    """The page keeps its own text (opening, how to run it, footer); a second run replaces the first's results."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    page = tmp_path / "gpu_results.md"
    page.write_text((ROOT / "docs" / "gpu_results.md").read_text())
    gpu_check.write_results(page, "## Results\n\nrow A\n")
    gpu_check.write_results(page, "## Results\n\nrow B\n")
    text = page.read_text()
    assert "row B" in text and "row A" not in text and text.count("## Results") == 1
    def outside(page_text):  # the page without what lies between its markers
        before, rest = page_text.split(gpu_check.RESULTS_START)
        return before + rest.split(gpu_check.RESULTS_END)[1]
    assert outside(text) == outside((ROOT / "docs" / "gpu_results.md").read_text())
    elsewhere = tmp_path / "other.md"
    gpu_check.write_results(elsewhere, "## Results\n")
    assert elsewhere.read_text() == "## Results\n"


# ---- gpu_check --cpu: every row's code path and the page writer, on the CPU ----

def load_gpu_check(name="gpu_check", planted=None):
    """tools/gpu_check.py as a module; planted=(old, new) loads its text with old replaced by new (once), as if the
    file said so, to show that a test catches that regression."""
    import importlib.util
    import types
    path = ROOT / "tools" / "gpu_check.py"
    if planted is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    source = path.read_text()
    assert source.count(planted[0]) == 1, f"{planted[0]!r} is not in tools/gpu_check.py once"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    exec(compile(source.replace(*planted), str(path), "exec"), module.__dict__)
    return module


def assert_every_row_measured(page: str, gpu_check, data_dir):
    """Each MNIST and BERT row of the check is in the page with numbers; the ones the CPU runs in another
    precision say so."""
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    for (name, precision), (_, ran_as) in gpu_check.mnist_runs(str(data_dir), torch.device("cpu")).items():
        line = next((line for line in rows if line.startswith(f"| {name} | {precision}")), None)
        assert line is not None, f"no row for {name} ({precision}):\n{page}"
        assert re.search(r"\| [\d.]+ \| \d+ \| [\d.]+% \|$", line), line
        assert ("ran in" in line) == (ran_as != precision), line
    for precision in ("fp32", "bf16", "fp16"):
        line = next((line for line in rows if line.startswith(f"| {precision}")), None)
        assert line is not None and re.match(rf"\| {precision}[^|]* \| \d+ \|", line), f"BERT {precision}:\n{page}"


def test_gpu_check_cpu_runs_every_row_and_writes_the_page(run_command, tmp_path):
    """`gpu_check.py --cpu`: each MNIST row a real run of its script as the GPU run starts it (on a tiny MNIST),
    the BERT rows' code at toy size, and the page written between its markers; the fp16 rows run in the CPU's
    precision and say so. measure(command) without its env (issue 34's crash) fails here: the next test."""
    from mnist_files import write_tiny_mnist
    data = write_tiny_mnist(tmp_path, train_size=64, test_size=16)
    page = tmp_path / "gpu_results.md"
    page.write_text((ROOT / "docs" / "gpu_results.md").read_text())
    result = run_command(PYTHON, "tools/gpu_check.py", "--cpu", "--data-dir", data, "--output", page, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = page.read_text()
    assert_every_row_measured(text, load_gpu_check(), data)
    assert "`tests/test_gpu.py`: not run" in text and "the CPU (`--cpu`" in text
    assert re.search(r"^\| 1 \| 1 \| no \| [\d.]+ \| [\d,]+ \| [\d,]+ \| \d+% \|$", text, re.MULTILINE), text  # the loader's row
    own = (ROOT / "docs" / "gpu_results.md").read_text()
    assert text.split("<!-- gpu-check results -->")[0] == own.split("<!-- gpu-check results -->")[0]
    assert text.split("<!-- end gpu-check results -->")[1] == own.split("<!-- end gpu-check results -->")[1]


def test_gpu_check_cpu_runs_the_bf16_rows_in_the_cpus_auto_precision():
    """`--cpu` on a CPU without bf16 units: the bf16 rows, MNIST's commands and BERT's, run in fp32 (--precision
    auto there), as the fp16 rows do, instead of an emulated bf16 several times slower; with the units, in bf16.
    The CPU's units are passed in: this machine has them. A GPU row keeps its own precision."""
    gpu_check, cpu = load_gpu_check(), torch.device("cpu")
    for has_bf16, expected in ((False, "fp32"), (True, "bf16")):
        runs = gpu_check.mnist_runs("data", cpu, has_bf16)
        bf16_rows = [(command, ran_as) for (_, precision), (command, ran_as) in runs.items() if precision == "bf16"]
        assert len(bf16_rows) == 2
        for command, ran_as in bf16_rows:
            assert ran_as == expected and command[command.index("--precision") + 1] == expected, command
        assert [gpu_check.on_device(precision, cpu, has_bf16) for precision in ("fp32", "bf16", "fp16")] == \
            ["fp32", expected, expected]
    assert gpu_check.on_device("bf16", torch.device("cuda"), has_bf16=False) == "bf16"
    assert gpu_check.precision_cell("bf16", "fp32") == "bf16, ran in fp32 (the CPU has no bf16 units)"


def test_gpu_check_cpu_catches_measure_called_without_its_env(tmp_path, monkeypatch):
    """The negative control: gpu_check.py as it was (measure(command), no env) makes every MNIST row fail with
    the TypeError, written as a failed row; the page check of the test above rejects that page, and main exits
    non-zero. Nothing is started: the MNIST calls fail before any process, and the loader's row, which the bug
    does not touch (the test above runs it), is left empty here."""
    from mnist_files import write_tiny_mnist
    data = write_tiny_mnist(tmp_path, train_size=64, test_size=16)
    planted = load_gpu_check("gpu_check_planted", ("measure(command, env)", "measure(command)"))
    monkeypatch.setattr(planted, "loader_rows", lambda data_dir, toy=False: {"lines": []})
    page = tmp_path / "gpu_results.md"
    with pytest.raises(SystemExit) as stopped:
        planted.main(["--cpu", "--data-dir", str(data), "--output", str(page)])
    assert "5 row(s) failed, each written with its reason" in str(stopped.value.code)
    text = page.read_text()
    assert text.count("| failed: TypeError: measure() missing 1 required positional argument: 'env' |") == 5, text
    with pytest.raises(AssertionError):
        assert_every_row_measured(text, planted, data)


def test_gpu_check_writes_a_failed_row_with_its_one_line_reason():
    """A run that exits non-zero (measure's sys.exit, with the end of its stderr), a run past its time limit and
    any exception each become one line for the table; the other rows still run (mnist_rows catches per row)."""
    gpu_check = load_gpu_check()
    stderr = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: CUDA error: out of memory | x\n"
    assert gpu_check.one_line(SystemExit(f"error: python x.py failed:\n{stderr}")) == \
        "RuntimeError: CUDA error: out of memory \\| x"
    assert gpu_check.one_line(subprocess.TimeoutExpired(["python", "x.py"], 1800)) == "did not finish within 1800 s"
    assert gpu_check.one_line(AttributeError("'NoneType' object has no attribute 'groups'\nmore")) == \
        "AttributeError: 'NoneType' object has no attribute 'groups'"
    mnist = {("MNIST epoch: x", "fp32"): {"failed": "did not finish within 1800 s", "ran_as": "fp32"}}
    bert = {"fp16": {"failed": "OutOfMemoryError: CUDA out of memory.", "ran_as": "fp16"}}
    page = gpu_check.results("3 passed in 1.0s", mnist, bert, "NVIDIA H100 80GB HBM3", 60.0)
    assert "| MNIST epoch: x | fp32 | failed: did not finish within 1800 s | | |" in page
    assert "| fp16 | failed: OutOfMemoryError: CUDA out of memory. | | | |" in page
    assert gpu_check.failed_rows(mnist, bert) == ["MNIST epoch: x (fp32)", "BERT-base fp16"]


def test_gpu_check_records_a_pytest_timeout_as_a_line():
    """tests/test_gpu.py past its time limit: a line for the page and one sentence to exit with, no traceback."""
    gpu_check = load_gpu_check()
    summary, problem, _ = gpu_check.run_gpu_tests(dict(os.environ), timeout=0.01)
    assert summary == "did not finish within 0.01 s (stopped)"
    assert problem == "tests/test_gpu.py did not finish within 0.01 s (stopped)."


H100_LISTING = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0bb1c2d3-e4f5-6789-abcd-ef0123456789)\n"


def test_gpu_check_stops_loudly_when_torch_misses_the_gpus_nvidia_smi_lists():
    """A torch built for a newer CUDA than the driver sees no GPU: that is an error, not 'no GPU'; unless
    CUDA_VISIBLE_DEVICES is empty on purpose (as in the CPU suite), or nvidia-smi lists none or is missing."""
    gpu_check = load_gpu_check()
    decide = gpu_check.gpu_decision
    status, sentence = decide(H100_LISTING, {}, 0, "2.11.0+cu130", "13.0")
    assert status == 1 and "\n" not in sentence and sentence.endswith(".")
    assert sentence.startswith("error: nvidia-smi lists 1 GPU(s) but torch 2.11.0+cu130 (built for CUDA 13.0) sees none")
    assert "CUDA_VISIBLE_DEVICES=7" in decide(H100_LISTING, {"CUDA_VISIBLE_DEVICES": "7"}, 0)[1]
    assert "built without CUDA" in decide(H100_LISTING, {}, 0, "2.11.0+cpu", None)[1]
    assert decide(H100_LISTING, {"CUDA_VISIBLE_DEVICES": ""}, 0) == (0, gpu_check.NO_GPU)
    assert decide(None, {}, 0) == decide("", {}, 0) == (0, gpu_check.NO_GPU)
    assert decide(H100_LISTING, {}, 1) is None
    mig = H100_LISTING + "  MIG 1g.10gb     Device  0: (UUID: MIG-0123)\n" + H100_LISTING.replace("GPU 0", "GPU 1")
    assert gpu_check.listed_gpus(mig) == 2


def test_gpu_check_names_the_gpus_for_the_gpu_tests():
    """With CUDA_VISIBLE_DEVICES unset, tests/test_gpu.py would find the GPUs only through nvidia-smi on the PATH:
    gpu_check names the ones torch sees; a set value stays; the repository is on PYTHONPATH (no install)."""
    gpu_check = load_gpu_check()
    env = gpu_check.gpu_tests_env({"CPU_SUITE_SESSION_CUDA_VISIBLE_DEVICES": "unset", "PYTHONPATH": "/x"}, 2, "/cache")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "CPU_SUITE_SESSION_CUDA_VISIBLE_DEVICES" not in env
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}/x" and env["TORCHINDUCTOR_CACHE_DIR"] == "/cache"
    assert gpu_check.gpu_tests_env({"CUDA_VISIBLE_DEVICES": "1"}, 1, "/cache")["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("summary, returncode, says", [
    ("14 skipped in 0.52s", 0, "every test of tests/test_gpu.py skipped (14 skipped in 0.52s)"),
    ("no tests ran in 0.01s", 5, "no test of tests/test_gpu.py ran"),
    ("1 failed, 12 passed, 1 skipped in 80.1s", 1, "tests/test_gpu.py failed (1 failed, 12 passed, 1 skipped in 80.1s)."),
    ("2 errors, 12 skipped in 3.0s", 1, "tests/test_gpu.py failed"),
    ("13 passed, 1 skipped in 80.1s", 0, None)])
def test_gpu_check_fails_when_every_gpu_test_skipped(summary, returncode, says):
    problem = load_gpu_check().tests_problem(summary, returncode)
    assert problem == says if says is None else problem.startswith(says), problem


def test_offline_gpu_check_installs_only_what_the_machine_lacks(tmp_path):
    """make gpu-check-offline on the lent GPU machine's python3 (everything but datasets, dill, multiprocess):
    their wheels only; a core package missing with no wheel stops it; datasets missing with no wheel only
    warns (its rows do not import it, tests/test_gpu.py's BERT tests do)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_offline", ROOT / "tools" / "gpu_offline.py")
    offline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offline)
    wheels = [tmp_path / name for name in ("datasets-5.2.0-py3-none-any.whl", "dill-0.4.1-py3-none-any.whl",
                                           "multiprocess-0.70.19-py312-none-any.whl", "pytest_xdist-3.8.0-py3-none-any.whl")]
    lent = lambda module: module not in ("datasets", "dill", "multiprocess")  # noqa: E731
    assert offline.plan(lent, wheels) == (wheels[:3], [], [])
    assert offline.plan(lambda module: module not in ("datasets", "xdist"), wheels) == ([wheels[3], wheels[0]], [], [])
    assert offline.plan(lambda module: module != "torchvision", wheels) == ([], ["torchvision"], [])
    assert offline.plan(lent, []) == ([], [], ["datasets", "dill", "multiprocess"])
