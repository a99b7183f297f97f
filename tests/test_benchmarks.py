"""Every benchmark script runs as the README says, at toy sizes, and prints its table and plot.

The benchmarks read the chapter scripts' output (train time, accuracy lines): a change there that
breaks them fails here, not in a user's `make demo`. Where a column says what a configuration did
(all-reduces per step, whether a hand-written all-reduce summed exactly), the numbers are checked,
so that each row is the thing it names. The figures themselves are not checked.
"""
import sys

from conftest import PYTHON, ROOT, assert_clear_error


def assert_table_and_plot(result, plot, *rows):
    assert result.returncode == 0, result.stderr[-3000:]
    for row in rows:
        assert f"| {row} |" in result.stdout, result.stdout[-3000:]
    if plot is not None:
        assert plot.stat().st_size > 0


def table_rows(stdout: str, first_cell: str) -> dict[str, list[str]]:
    """Markdown rows keyed by their first cell, for the rows whose first cell starts with first_cell."""
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in stdout.splitlines() if line.startswith("| ")]
    return {row[0]: row[1:] for row in cells if row[0].startswith(first_cell)}


def test_mnist_speed_prints_a_table_and_a_plot(run_command, tiny_mnist, tmp_path):
    plot = tmp_path / "mnist.png"
    result = run_command(PYTHON, "benchmarks/mnist_speed.py", "--data-dir", tiny_mnist,
                         "--runs", "single", "ddp", "--plot", plot, timeout=300)  # the original loop: gpu_check --cpu
    assert_table_and_plot(result, plot, "mnist_1_single.py", "mnist_3_ddp.py, 2 processes")


def test_mnist_speed_downloads_a_missing_dataset_first_and_names_the_flag_where_it_cannot(run_command, tmp_path):
    """make demo on a fresh machine: MNIST is fetched before any run is timed; offline (the tests' dead proxy),
    the download fails in one sentence that says what to pass."""
    result = run_command(PYTHON, "benchmarks/mnist_speed.py", "--data-dir", tmp_path, "--runs", "single")
    assert "downloading it first, so that no run times the download" in result.stdout, result.stdout
    assert_clear_error(result, "could not be downloaded", "--data-dir")


def test_loader_speed_prints_a_table_and_a_plot(run_command, tiny_mnist, tmp_path):
    plot = tmp_path / "loader.png"
    result = run_command(PYTHON, "benchmarks/loader_speed.py", "--data-dir", tiny_mnist, "--ranks", "2", "--workers", "1",
                         "--steps", "2", "--plot", plot, timeout=300)
    assert_table_and_plot(result, plot)
    rows = [line.split(" | ")[1] for line in result.stdout.splitlines() if line.startswith("| 2 | ")]
    assert rows == ["compute alone", "1"], result.stdout  # and no pin_memory row: no accelerator here
    assert "pin_memory has nothing to pin" in result.stdout


def test_mnist_floor(run_command):
    result = run_command(PYTHON, "benchmarks/mnist_floor.py", "--train-seconds", "100")
    assert_table_and_plot(result, None, "training FLOPs per image", "fastest possible fp32 epoch")
    assert "| training FLOPs per image | 71.6 M |" in result.stdout, result.stdout


def test_allreduce_speed(run_command, tmp_path):
    plot = tmp_path / "allreduce.png"
    result = run_command(PYTHON, "benchmarks/allreduce_speed.py", "--world-sizes", "3", "--max-mb", "0.01",
                         "--plot", plot)  # test_allreduce.py checks each algorithm at 2 and 3 ranks
    assert_table_and_plot(result, plot, "3 | 4 KiB | ring")
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 2 * 4  # 2 sizes (1 and 4 KiB) x 4 algorithms
    assert all(line.endswith("| yes |") for line in rows), result.stdout  # each summed exactly
    from common.lessons.allreduce import bytes_sent_per_rank
    ring_3_4k = next(line for line in rows if line.startswith("| 3 | 4 KiB | ring |")).split(" | ")
    assert float(ring_3_4k[5]) == round(bytes_sent_per_rank("ring", 4096, 3) / 2**20, 2)


def test_bucketing_speed(run_command, tmp_path):
    plot = tmp_path / "bucketing.png"
    result = run_command(PYTHON, "benchmarks/bucketing_speed.py", "--layers", "4", "--width", "256", "--batch", "4",
                         "--steps", "2", "--nproc", "2", "--plot", plot)
    assert_table_and_plot(result, plot, "torch DDP, bucket_cap_mb=25")
    rows = table_rows(result.stdout, "ours")  # 4 layers of 0.25 MiB: 1 MiB buckets need two all-reduces
    assert {name: row[1] for name, row in rows.items()} == {
        "ours, one bucket after backward": "1", "ours, 1 MiB buckets": "2", "ours, 4 MiB buckets": "1",
        "ours, 16 MiB buckets": "1", "ours, 25 MiB buckets": "1"}


def test_grad_sync(run_command):
    result = run_command(PYTHON, "benchmarks/grad_sync.py", "--nproc", "2", "--accumulation-steps", "2",
                         "--micro-batch", "2", "--optimizer-steps", "1")
    assert_table_and_plot(result, None, "accelerator.accumulate")
    counts = {name: row[1] for name, row in table_rows(result.stdout, "").items() if name != "variant"}
    assert list(counts.values()) == ["4", "4", "2", "2"], counts  # 2 micro-batches x 2 buckets, or 1 x 2


def test_nli_speed(run_command, tiny_bert, tmp_path):
    plot = tmp_path / "nli.png"
    result = run_command(PYTHON, "benchmarks/nli_speed.py", "--model", tiny_bert, "--steps", "4", "--warmup", "1",
                         "--batch-size", "4", "--nproc", "2", "--plot", plot, timeout=300)
    assert_table_and_plot(result, plot, "data_parallel.py, 1 process on the CPU", "ddp.py, 2 processes")
    for row in result.stdout.splitlines():
        if row.startswith("| data_parallel.py") or row.startswith("| ddp.py"):
            assert row.split(" | ")[1] == "2" and row.endswith("| host peak RSS |"), row  # 4 steps - 1 warm-up - 1


def test_nli_speed_needs_steps_after_warmup(run_command, tiny_bert):
    result = run_command(PYTHON, "benchmarks/nli_speed.py", "--model", tiny_bert, "--steps", "3", "--warmup", "3")
    assert result.returncode == 2 and "--steps must be at least --warmup + 2 = 5" in result.stderr


def test_checkpoint_cost(run_command, tmp_path):
    plot = tmp_path / "checkpoint.png"
    result = run_command(PYTHON, "benchmarks/checkpoint_cost.py", "--models", "basicnet", "--repeats", "1",
                         "--dir", tmp_path, "--plot", plot)
    assert_table_and_plot(result, plot)
    row = table_rows(result.stdout, "BasicNet")["BasicNet"]
    assert row[0] == "1.2 M" and row[4] == "200"  # BasicNet, at mnist_3_ddp_resume.py's default interval
    assert 13 < float(row[1]) < 15  # 1.2 M fp32 weights and AdamW's two moments: 3 x 4.8 MB, plus a little
    assert list(tmp_path.iterdir()) == [plot]  # the temporary checkpoints are gone


def test_sharded_memory_matches_the_zero_formula(run_command, tiny_bert, tmp_path):
    """Each rank's optimizer state is the formula's 8Ψ/N (ZeRO-1/2/3, FSDP2) or 8Ψ (DDP), within 5%;
    gradients shrink from ZeRO-2 on and parameters from ZeRO-3 on."""
    plot = tmp_path / "memory.png"
    result = run_command(PYTHON, "benchmarks/sharded_memory.py", "--model", tiny_bert, "--world-sizes", "2",
                         "--steps", "2", "--batch", "2", "--length", "8", "--plot", plot, timeout=240)
    assert_table_and_plot(result, plot)
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    runs = {cells[1].strip(): [cell.strip() for cell in cells[2:]] for cells in rows}  # run: its cells after the name
    assert list(runs) == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"], result.stdout
    measured = {run: [float(cell.split(" (")[0]) for cell in cells[:3]] for run, cells in runs.items()}
    for run, cells in runs.items():
        assert 0.95 <= float(cells[3]) <= 1.05, (run, result.stdout)
    assert measured["ZeRO-1"][2] < 0.55 * measured["DDP"][2]
    assert measured["ZeRO-2"][1] < 0.55 * measured["ZeRO-1"][1]
    assert measured["ZeRO-3"][0] < 0.55 * measured["ZeRO-2"][0]


def test_bar_labels_end_inside_the_axes():
    """A long label beside the longest bar used to run off the figure (checkpoint_cost_cpu.png); a fixed
    margin clips it (negative control), fit_labels widens the axis until it fits."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as the benchmarks find it
    from plotting import fit_labels

    def right_edges(fit):
        fig, ax = plt.subplots(figsize=(8, 2))
        bars = ax.barh(["short", "long"], [1.0, 0.5])
        labels = ax.bar_label(bars, ["0.38 % (0.02 s per save, every 200 steps)", "x"], padding=3)
        ax.set_xlim(0, 1.35)
        fig.tight_layout()
        if fit:
            fit_labels(fig, ax, labels)
        renderer = fig.canvas.get_renderer()
        edges = max(label.get_window_extent(renderer).x1 for label in labels), ax.get_window_extent(renderer).x1
        plt.close(fig)
        return edges

    label_end, axes_end = right_edges(fit=False)
    assert label_end > axes_end
    label_end, axes_end = right_edges(fit=True)
    assert label_end <= axes_end


def test_basicnet_computes_the_seeds_function_at_less_cost():
    """The chapter's BasicNet pools before its ReLU and draws dropout masks with torch.rand; the reference's
    SeedNet keeps the seed's order and nn.Dropout. Without dropout (eval mode) both give the same outputs
    and gradients, bit for bit; in training, the mask keeps each element with probability 1 - p and scales
    it by 1 / (1 - p), as nn.Dropout does, and a seeded run draws it again."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reference_mnist import SeedNet

    from common.mnist import BasicNet, Dropout
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    grads = []
    for model in (BasicNet(), SeedNet()):
        torch.manual_seed(0)
        model.load_state_dict(BasicNet().state_dict())
        F.nll_loss(model.eval()(images), labels).backward()
        grads.append([model(images), *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))

    dropout, ones = Dropout(0.25), torch.ones(1_000_000)
    torch.manual_seed(1)
    masked = dropout(ones)
    assert set(masked.unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()} and abs((masked > 0).float().mean() - 0.75) < 0.005
    torch.manual_seed(1)
    assert torch.equal(dropout(ones), masked)
    assert torch.equal(dropout.eval()(ones), ones)


def test_simulate_speed(run_command, tmp_path):
    """One tiny Llama-shaped case, as the 8 B and 70 B ones run: a config written, one simulation timed."""
    plot = tmp_path / "simulate.png"
    result = run_command(PYTHON, "benchmarks/simulate_speed.py", "--cases", "tiny:fsdp:8", "--seq", "16", "--plot", plot,
                         timeout=300)
    assert_table_and_plot(result, plot, "tiny:fsdp:8")
    assert "| 5 all-gather, 3 reduce-scatter |" in result.stdout, result.stdout  # the root once, 2 blocks twice


def test_simulate_speed_names_a_bad_case(run_command):
    result = run_command(PYTHON, "benchmarks/simulate_speed.py", "--cases", "70b-fsdp-1024")
    assert_clear_error(result, "write SIZE:STRATEGY:GPUS")
