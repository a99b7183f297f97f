"""--compile (common/compile.py, docs/compile.md): a compiled model trains as the eager one does, DDP's
compiled graph is split into one graph per gradient bucket, and the flag runs under every launcher.

The equality checks train the same model from the same weights, eagerly and compiled, for STEPS AdamW
steps, in eval mode (no dropout: inductor draws its own masks, so the two would differ by design) and
compare the weights within TOLERANCE. aot_eager is the backend where the lesson does not need generated
code: it captures the same forward and backward graphs as inductor and runs them with eager kernels.
One inductor run, on a tiny model, checks the generated code too.
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from conftest import ACCELERATE, PYTHON, ROOT, TEST_IMAGES, TORCHRUN, TORCHRUN_FRESH, assert_ran
from torch.nn.parallel import DistributedDataParallel as DDP

from common.compile import compiled
from common.spawn import run_in_process_group

STEPS = 3
# The largest weight difference allowed after STEPS steps of AdamW at lr 1e-2 (a step moves a weight by up to
# 1e-2): aot_eager runs eager's kernels and differs by 0; inductor's fused kernels add in another order (2e-5).
TOLERANCE = 1e-4
LAYERS, WIDTH = 3, 512  # each Linear holds 1.05 MB: more than DDP's smallest bucket


class Stack(nn.Module):
    """LAYERS x (Linear, tanh). A module class of our own: dynamo starts tracing at a forward written outside
    torch; nn.Sequential's, called from DDP's forward (which dynamo skips), would be left eager."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Stack().eval()


def batch_for(rank: int, step: int):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, WIDTH, generator=generator), torch.randint(0, WIDTH, (4,), generator=generator)


def train(model, parameters, rank: int = 0) -> list[torch.Tensor]:
    """STEPS AdamW steps on this rank's batches; the weights afterwards."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    for step in range(STEPS):
        inputs, labels = batch_for(rank, step)
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in parameters]


def largest_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def bf16_backend(graph, example_inputs):
    """A planted bug: a 'compiler' that quietly runs the captured graph in bf16."""
    def run(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return graph(*args)
    return run


def eager_and_compiled(backend) -> float:
    eager = small_model()
    expected = train(eager, list(eager.parameters()))
    model = small_model()
    torch._dynamo.reset()  # no graph of another case is reused
    got = train(compiled(model, backend) if isinstance(backend, str) else torch.compile(model, backend=backend),
                list(model.parameters()))
    return largest_gap(expected, got)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_and_eager_train_alike(backend):
    assert eager_and_compiled(backend) < TOLERANCE


def test_the_equality_check_fails_when_compile_changes_the_math():
    """Negative control: a backend that runs the same graph in bf16 is caught by the same tolerance."""
    assert eager_and_compiled(bf16_backend) > 100 * TOLERANCE


# ---- DDP: one graph per bucket, when compiled after the wrap ----

def ddp_graphs(rank: int, world_size: int) -> dict:
    """DDP's buckets; the graphs dynamo hands the backend for the DDP model compiled after the wrap, and with
    dynamo's DDPOptimizer turned off; the weights of eager and of compiled DDP after STEPS steps from the same
    weights."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return aot_eager(graph, example_inputs)

    cap_mb = 1  # each layer's gradients fill a bucket (below 1 MiB, dynamo's DDPOptimizer refuses to start)
    eager = DDP(small_model(seed=rank), bucket_cap_mb=cap_mb)  # DDP copies rank 0's weights to every rank
    expected = train(eager, list(eager.parameters()), rank)
    buckets = len(eager.reducer._get_zeros_like_grad_buckets())  # as rebuilt after the first step

    model = DDP(small_model(seed=rank), bucket_cap_mb=cap_mb)
    torch._dynamo.reset()
    got = train(torch.compile(model, backend=counting), list(model.parameters()), rank)
    after_wrap = len(graphs)

    graphs.clear()
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = False
    unsplit = torch.compile(DDP(small_model(seed=rank), bucket_cap_mb=cap_mb), backend=counting)
    unsplit(batch_for(rank, 0)[0]).sum().backward()
    gap = torch.tensor(largest_gap(expected, got))
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return {"buckets": buckets, "after_wrap": after_wrap, "unsplit": len(graphs), "gap": gap.item()}


@pytest.fixture(scope="module")
def ddp_recorded():
    return run_in_process_group(ddp_graphs, 3, timeout=240)


def test_compiled_after_the_wrap_ddp_splits_the_graph_at_each_bucket(ddp_recorded):
    assert ddp_recorded["buckets"] == LAYERS  # the small bucket_cap_mb forces one bucket per layer
    assert ddp_recorded["after_wrap"] == ddp_recorded["buckets"]


def test_without_ddp_optimizer_the_graph_is_one(ddp_recorded):
    """Negative control: the split is dynamo's DDPOptimizer; turned off, one graph holds every bucket's
    gradients, and the count above would fail."""
    assert ddp_recorded["unsplit"] == 1 < ddp_recorded["buckets"]


def test_compiled_ddp_and_eager_ddp_train_alike_on_3_processes(ddp_recorded):
    assert ddp_recorded["gap"] < TOLERANCE


# ---- the flag on the chapter scripts, under each launcher they support ----

CH4 = ROOT / "src" / "ch4"
CRASH = ROOT / "tests" / "crash.py"
LAUNCHES = {
    "single": [PYTHON, CH4 / "mnist_1_single.py"],
    "accelerate": [*ACCELERATE, "--config_file", CH4 / "accelerate_configs" / "cpu_2_processes.yaml",
                   CH4 / "mnist_4_accelerate.py"],
    "fsdp": [*TORCHRUN, "--nproc_per_node=2", CH4 / "sharded" / "mnist_fsdp.py"],
}


# mnist_2_data_parallel.py is left out: on a CPU, DataParallel calls the module, and the run is step 1's;
# mnist_3_ddp.py trains with --compile eager in the gloo test below, which checks its accuracy line too.
# The backend is eager (dynamo's capture, no backward graph): these runs check the flag's wiring under each
# launcher, the cheapest way; the equality checks above are where the backends are compared.
@pytest.mark.parametrize("launch", LAUNCHES)
def test_mnist_scripts_train_with_compile(run_command, tiny_mnist, launch):
    result = run_command(*LAUNCHES[launch], "--data-dir", tiny_mnist, "--compile", "eager", "--dist-timeout", 60)
    assert_ran(result, f"over {TEST_IMAGES} images")


@pytest.mark.parametrize("crash, gloo_left", [("threads-at-exit", False), ("threads-at-exit,keep-compiled-code", True)])
def test_a_compiled_ddp_run_stops_gloo_before_the_interpreters_teardown(run_command, tiny_mnist, crash, gloo_left):
    """dynamo's caches hold the DDP module and its process group past destroy_process_group(); gloo threads
    left running into the interpreter's teardown abort a process now and then (docs/traps.md). With the
    compiled code released at exit (common/compile.py), none is left; kept (the negative control), they are.
    Fresh interpreters (torchrun itself): the teardown is theirs."""
    result = run_command(*TORCHRUN_FRESH, "--nproc_per_node=2", CRASH, crash, CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist,
                         "--compile", "eager", "--dist-timeout", 60)
    left = re.findall(r"^threads at exit: (.*)$", result.stdout, re.MULTILINE)
    assert left and all(("gloo" in threads) == gloo_left for threads in left), result.stdout + result.stderr[-3000:]
    if not gloo_left:  # both ranks got to the end of their exit functions, and exited cleanly
        assert len(left) == 2
        assert_ran(result, f"over {TEST_IMAGES} images")
    # kept, a rank may abort in its teardown (the fault itself), and torchrun then stops the other before its line


def test_bert_ddp_trains_with_compile(run_command, tiny_bert, nli_pairs):
    result = run_command(*TORCHRUN, "--nproc_per_node=2", CH4 / "ddp.py", "--model", tiny_bert, "--dataset", nli_pairs,
                         "--max-steps", 1, "--batch-size", 8, "--compile", "eager", "--dist-timeout", 60)
    assert_ran(result, "eval accuracy")


@pytest.mark.parametrize("script", ["data_parallel.py"])  # nli_loss_in_forward.py has the same two lines
def test_the_bert_base_scripts_train_with_compile(run_command, tiny_bert, nli_pairs, script):
    """The flag lives in the base script, so ddp.py's lesson diff does not show it."""
    result = run_command(PYTHON, CH4 / script, "--model", tiny_bert, "--dataset", nli_pairs, "--max-steps", 1,
                         "--batch-size", 8, "--compile", "eager")
    assert_ran(result, "eval accuracy")


def test_inductor_without_a_compiler_says_so(monkeypatch, tmp_path):
    """No C++ compiler on the PATH: one sentence (sys.exit's, on stderr) naming the ways out."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match=r"needs a C\+\+ compiler .* or pass --compile aot_eager, or leave out --compile"):
        compiled(small_model(), "inductor")
    assert compiled(small_model(), "aot_eager") is not None  # the way out needs no compiler
