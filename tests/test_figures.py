"""Every figure in images/ is drawn by figures/ from the code it explains and from real runs.

Two process groups (4 and 2 gloo processes, one each for the module) record what every figure
needs. The schematics are then redrawn and compared byte for byte with the committed SVGs; the
measured figures are drawn at toy size. Where cheap, what a figure plots is checked against the
truth: the ring's recorded chunks against dist.all_reduce and against the schedule's partial sums,
the recorded bytes against the cost model, DDP's buckets against its own logging data.
"""
import gc
import json
import re
import sys

import matplotlib
import pytest
from conftest import ROOT
from PIL import Image

sys.path[:0] = [str(ROOT / "figures"), str(ROOT / "benchmarks")]  # the figure scripts import their neighbours
import accumulation_syncs  # noqa: E402
import allreduce_algorithms  # noqa: E402
import allreduce_speed  # noqa: E402
import bucket_assignment  # noqa: E402
import compile_breakdown  # noqa: E402
import ddp_step_lanes  # noqa: E402
import dp_vs_ddp  # noqa: E402
import hsdp_mesh  # noqa: E402
import overlap_timeline  # noqa: E402
import resume_sequence  # noqa: E402
import ring_allreduce  # noqa: E402
import simulate_memory  # noqa: E402
import step_time_breakdown  # noqa: E402
import worker_seeds  # noqa: E402
import zero_stages  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from common.lessons.allreduce import bytes_sent_per_rank, ring_schedule  # noqa: E402
from common.mnist import BasicNet  # noqa: E402
from common.spawn import run_in_process_group  # noqa: E402


def on_four_ranks(rank, world_size):
    return {"ring": ring_allreduce.record(rank, world_size),
            "algorithms": allreduce_algorithms.record(rank, world_size),
            "busbw": allreduce_speed.worker(rank, world_size, [2**10])}


def on_two_ranks(rank, world_size):
    recorded = {"buckets": bucket_assignment.record(rank, world_size),
                "accumulation": accumulation_syncs.record(rank, world_size),
                "overlap": overlap_timeline.record(rank, world_size, "toy"),
                "breakdown": step_time_breakdown.record(rank, world_size, "toy")}
    gc.collect()
    return {**recorded, "models left": sum(isinstance(thing, DDP) for thing in gc.get_objects())}


@pytest.fixture(scope="module")
def four():
    return run_in_process_group(on_four_ranks, 4, timeout=240)


@pytest.fixture(scope="module")
def two():
    return run_in_process_group(on_two_ranks, 2, timeout=240)


def test_no_ddp_outlives_the_figures_that_build_one(two):
    """A DDP that a reference cycle through its C++ reducer keeps alive (a hook whose closure holds the
    model, left on its parameters) keeps the process group and its gloo threads alive past
    destroy_process_group; at the interpreter's exit they aborted the process at random ("terminate
    called without an active exception"). The garbage collector cannot see that cycle, so any DDP left
    after a collection is one."""
    assert two["models left"] == 0


def assert_same_bytes(drawn, committed):
    """The same bytes as the committed SVG, where the matplotlib that drew it is the one installed."""
    drew_with = re.search(rb"Matplotlib v([\w.]+)", committed.read_bytes())
    if drew_with is None or drew_with.group(1).decode() != matplotlib.__version__:
        pytest.skip(f"{committed.name} was drawn with another matplotlib than {matplotlib.__version__}")
    assert drawn.read_bytes() == committed.read_bytes(), (
        f"{committed.name} differs from what figures/ draws now: run `make figures` and commit images/")


# ---- 1. the ring, step by step

def test_ring_figure_is_byte_stable_and_has_a_gif(four, tmp_path):
    ring_allreduce.draw(four["ring"], tmp_path / "ring.svg", tmp_path / "ring.gif")
    assert_same_bytes(tmp_path / "ring.svg", ROOT / "images" / "ring_allreduce.svg")
    with Image.open(tmp_path / "ring.gif") as gif:
        assert gif.n_frames == 1 + 2 * (4 - 1)  # the start, then every step
    assert (ROOT / "images" / "ring_allreduce.gif").stat().st_size > 0


def test_ring_figure_shows_the_real_tensors(four):
    recording = four["ring"]
    world_size = recording["world_size"]
    truth = recording["ranks"][0]["all_reduce"]
    for rank, recorded in enumerate(recording["ranks"]):
        assert recorded["ring"] == recorded["all_reduce"] == truth  # the ring, run for real, equals gloo's
        assert sum(recorded["history"][-1], []) == truth  # its last recorded state is the result
    start = [ring_allreduce.starting_tensor(rank, world_size).tolist() for rank in range(world_size)]
    for index, state in enumerate(ring_allreduce.states(recording)[1: world_size]):  # the reduce-scatter
        for rank in range(world_size):
            chunk = state["received"][rank]
            contributors = [(rank - back) % world_size for back in range(index + 2)]  # itself and those to its left
            assert state["values"][rank][chunk] == [sum(start[r][chunk] for r in contributors)]
            assert state["sent"][(rank - 1) % world_size] == chunk  # it came from the left neighbour


def test_the_figure_draws_the_schedule_the_ring_runs():
    """A negative control: a schedule that sent the chunk it received would not be the one drawn."""
    for world_size in (2, 3, 4, 5):
        for rank in range(world_size):
            steps = list(ring_schedule(rank, world_size))
            assert len(steps) == 2 * (world_size - 1)
            left = list(ring_schedule((rank - 1) % world_size, world_size))
            assert all(mine[3] == theirs[2] for mine, theirs in zip(steps, left))
            assert any(mine[3] != mine[2] for mine in steps)


# ---- 2. who sends what

def test_recorded_bytes_equal_the_cost_model(four, tmp_path):
    recording = four["algorithms"]
    for name in ("reduce_broadcast", "all_to_all", "ring"):
        sent = allreduce_algorithms.bytes_sent(recording, name)
        assert max(sent) == bytes_sent_per_rank(name, recording["size_bytes"], 4), name
    assert allreduce_algorithms.bytes_sent(recording, "reduce_broadcast")[1:] == [recording["size_bytes"]] * 3
    ring_pairs = allreduce_algorithms.pairs(recording, "ring")
    assert sorted(ring_pairs) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert all(sizes == [recording["size_bytes"] // 4] * 6 for sizes in ring_pairs.values())
    allreduce_algorithms.draw(recording, tmp_path / "algorithms.svg")
    assert_same_bytes(tmp_path / "algorithms.svg", ROOT / "images" / "allreduce_algorithms.svg")


# ---- 4. buckets

def test_bucket_figure_matches_ddp_and_ours(two, tmp_path, tiny_bert):
    layouts = two["buckets"]
    for name, layout in layouts.items():
        sizes = layout["sizes"]
        first, rebuilt = layout["ddp_first"], layout["ddp_rebuilt"]
        assert len(first) == 1  # DDP's first backward: one bucket
        bucket_bytes = [sum(sizes[n] for n in bucket) for bucket in rebuilt]
        assert layout["logged"]["rebuilt_bucket_sizes"] == ", ".join(map(str, bucket_bytes)), name
        assert layout["logged"]["bucket_sizes"] == str(sum(sizes.values()))
        assert sorted(sum(rebuilt, [])) == sorted(sizes) == sorted(sum(layout["ours"], []))
    basicnet = layouts["BasicNet"]
    assert basicnet["ddp_rebuilt"][0] == ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]  # the 1 MiB first bucket, overflowed
    model = BasicNet()
    assert sum(basicnet["ours"], []) == [n for n, _ in model.named_parameters()][::-1]
    assert len(basicnet["ours"]) == 1  # 4.58 MiB < 25 MiB
    config = json.loads((tiny_bert / "config.json").read_text())
    assert {key: config[key] for key in bucket_assignment.TINY_BERT if key != "num_labels"} == {
        key: value for key, value in bucket_assignment.TINY_BERT.items() if key != "num_labels"}
    assert len(config["id2label"]) == bucket_assignment.TINY_BERT["num_labels"]
    bucket_assignment.draw(layouts, tmp_path / "buckets.svg")
    assert_same_bytes(tmp_path / "buckets.svg", ROOT / "images" / "bucket_assignment.svg")


# ---- 5. accumulation

def test_accumulation_figure_counts(two, tmp_path):
    recording = two["accumulation"]
    syncs = recording["syncs"]
    buckets = 2  # BasicNet under DDP after the rebuild (tests/test_accumulation.py)
    every = sorted(list(range(1, 5)) * buckets)
    assert list(syncs.values()) == [every, every, [4] * buckets, [4] * buckets]
    accumulation_syncs.draw(recording, tmp_path / "accumulation.svg")
    assert_same_bytes(tmp_path / "accumulation.svg", ROOT / "images" / "accumulation_syncs.svg")


# ---- 8. DataParallel vs DDP

def test_dp_vs_ddp_figure(tmp_path):
    works = dp_vs_ddp.workloads()
    mnist = works["BasicNet (MNIST), global batch 64"]
    assert mnist["params"] == sum(p.numel() for p in BasicNet().parameters()) == 1_199_882
    moves = dp_vs_ddp.moves(mnist)
    replicate = next(size for step, size in moves["DataParallel: one process, GPU 0 drives all"] if "replicate" in step)
    assert replicate == 3 * mnist["param_bytes"]
    all_reduce = next(size for step, size in moves["DDP: one process per GPU"] if "all-reduce" in step)
    assert all_reduce == 2 * bytes_sent_per_rank("ring", mnist["param_bytes"], 4)
    dp_vs_ddp.draw(tmp_path / "dp_vs_ddp.svg")
    assert_same_bytes(tmp_path / "dp_vs_ddp.svg", ROOT / "images" / "dp_vs_ddp.svg")
    assert dp_vs_ddp.markdown_tables() in (ROOT / "docs" / "mnist.md").read_text()  # the numbers the page shows


# ---- measured: 3, 6, 7

def test_overlap_timeline_at_toy_size(two, tmp_path):
    recording = two["overlap"]
    params = 2 * recording["size"]["layers"]
    for name, ranks in recording["timelines"].items():
        for timeline in ranks:
            assert len(timeline["ticks"]) == params, name  # a tick for every gradient
            assert sorted(timeline["launch"]) == sorted(timeline["finish"]) and timeline["launch"], name
            assert all(timeline["launch"][i] <= timeline["finish"][i] for i in timeline["launch"])
            assert timeline["marks"]["start"] <= min(timeline["ticks"]) <= max(timeline["ticks"]) <= timeline["marks"]["backward"]
    for timeline in recording["timelines"]["ours, one bucket after backward"]:
        assert timeline["launch"] == {0: max(timeline["ticks"])}  # one all-reduce, launched by the last gradient
    for timeline in recording["timelines"]["ours, 1 MB buckets"]:
        assert len(timeline["launch"]) == 2  # 4 layers of 256 KiB: the first bucket starts while backward goes on
        assert timeline["launch"][0] < max(timeline["ticks"])
    overlap_timeline.draw(recording, tmp_path / "overlap.png")
    assert (tmp_path / "overlap.png").stat().st_size > 0


def test_step_time_breakdown_at_toy_size(two, tmp_path):
    recording = two["breakdown"]
    assert list(recording["results"]) == list(step_time_breakdown.CONFIGURATIONS)
    for ranks in recording["results"].values():
        for phases in ranks:
            assert set(phases) == set(step_time_breakdown.PHASES)
            assert phases["forward"] > 0 and phases["backward"] > 0 and phases["exposed communication"] >= 0
    step_time_breakdown.draw(recording, tmp_path / "breakdown.png")
    assert (tmp_path / "breakdown.png").stat().st_size > 0


def test_compile_breakdown_at_toy_size(tmp_path):
    recording = compile_breakdown.record("toy")
    assert list(recording["results"]) == ["eager", "compiled (aot_eager)"]
    for segments in recording["results"].values():
        assert list(segments) == compile_breakdown.SEGMENTS
        assert segments["forward, the rest"] > 0 and segments["backward, the rest"] > 0 and segments["optimizer"] > 0
    assert recording["results"]["eager"]["dropout masks"] > 0  # BasicNet trains with dropout: eager draws masks
    compile_breakdown.draw(recording, tmp_path / "compile.png")
    assert (tmp_path / "compile.png").stat().st_size > 0


def test_simulate_memory_at_toy_size(tmp_path):
    """Every strategy at 1 and 8 simulated ranks: sharding lowers the peak; FSDP's peak with the embedding and
    the head wrapped apart is below the per-block wrap's, its gathered parameters the first to fall."""
    recording = simulate_memory.record("toy")
    assert {strategy: [r["gpus"] for r in results] for strategy, results in recording["curves"].items()} == \
        {strategy: [1, 8] for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")}
    peak = {strategy: [r["measured"]["peak_bytes"] for r in results] for strategy, results in recording["curves"].items()}
    assert peak["zero3"][1] < peak["zero1"][1] < peak["ddp"][1] == peak["ddp"][0]
    bars = {name: simulate_memory.parts(result["measured"]) for name, result in recording["bars"].items()}
    assert sum(bars["embedding, head apart"]) < sum(bars["per block"])
    assert bars["embedding, head apart"][1] < bars["per block"][1]  # the gathered parameters
    simulate_memory.draw(recording, tmp_path / "simulate.png")
    assert (tmp_path / "simulate.png").stat().st_size > 0


def test_bus_bandwidth_at_toy_size(four, tmp_path):
    rows = four["busbw"]
    assert all(exact for *_, exact in rows)
    model = allreduce_speed.model_bus_bandwidth(rows, 4)
    assert model["reduce_broadcast"] == pytest.approx(model["ring"] * 2 / 4)  # sends (N-1)S where the ring sends 2(N-1)/N S
    assert model["dist.all_reduce (gloo)"] == model["ring"]
    allreduce_speed.plot(rows, str(tmp_path / "busbw.png"), "toy")
    assert (tmp_path / "busbw.png").stat().st_size > 0


def test_every_figure_is_committed():
    for name in ("ring_allreduce.svg", "ring_allreduce.gif", "allreduce_algorithms.svg", "overlap_timeline.png",
                 "bucket_assignment.svg", "accumulation_syncs.svg", "step_time_breakdown.png", "allreduce_busbw.png",
                 "compile_breakdown.png", "dp_vs_ddp.svg", "zero_stages.svg", "zero_stages.png", "ddp_step_lanes.svg",
                 "resume_sequence.svg", "worker_seeds.svg", "hsdp_mesh.svg", "simulate_memory.png"):
        assert (ROOT / "images" / name).stat().st_size > 0, name


def test_zero_stages_figure_is_byte_stable(tmp_path):
    zero_stages.draw(tmp_path / "zero_stages.svg")
    assert_same_bytes(tmp_path / "zero_stages.svg", ROOT / "images" / "zero_stages.svg")
    assert (tmp_path / "zero_stages.png").stat().st_size > 0


@pytest.mark.parametrize("figure, name", [(ddp_step_lanes, "ddp_step_lanes.svg"), (resume_sequence, "resume_sequence.svg"),
                                          (hsdp_mesh, "hsdp_mesh.svg"), (worker_seeds, "worker_seeds.svg")])
def test_drawn_schematics_are_byte_stable(figure, name, tmp_path):
    figure.draw(tmp_path / name)
    assert_same_bytes(tmp_path / name, ROOT / "images" / name)


def test_the_worker_seeds_figure_shows_what_the_workers_draw():
    """Seeded by the rungs, the four workers of two ranks draw four different lists of shifts; with one generator made
    in __init__ (the figure's right half), all four draw the same."""
    seeded = [tuple(drawn) for rank in (0, 1) for drawn in worker_seeds.shifts(rank, True)]
    trap = [tuple(drawn) for rank in (0, 1) for drawn in worker_seeds.shifts(rank, False)]
    assert len(set(seeded)) == 4 and len(set(trap)) == 1


def test_the_step_lanes_overlap_all_but_the_last_bucket():
    """The schematic's schedule says what the page says: buckets fill in reverse layer order, the first
    all-reduce runs during backward, and only the last one delays the optimizer."""
    plan = ddp_step_lanes.schedule()
    backward_end = max(end for _, end in plan["backward"].values())
    (first, first_start, first_end), (_, last_start, last_end) = plan["reduces"]
    assert first == (ddp_step_lanes.LAYERS, ddp_step_lanes.LAYERS - 1)
    assert first_end <= backward_end < last_end and plan["wait"] == (backward_end, last_end)


COLUMN_PX, SMALLEST_PX = 720, 9  # a page's column, and the smallest text a reader reads there without zooming


def smallest_text_px(svg: str, column_px: int = COLUMN_PX) -> float:
    """The smallest font of an SVG whose text is text (svg.fonttype none), in pixels when the figure is
    shown at the column's width."""
    width = float(re.search(r'<svg[^>]*\swidth="([\d.]+)pt"', svg)[1])
    return min(float(size) for size in re.findall(r"font-size: ([\d.]+)px", svg)) * column_px / width


@pytest.mark.parametrize("svg", sorted(path.name for path in (ROOT / "images").glob("*.svg")))
def test_every_schematic_is_legible_in_a_720_px_column(svg):
    smallest = smallest_text_px((ROOT / "images" / svg).read_text())
    assert smallest >= SMALLEST_PX, f"images/{svg}: its smallest text is {smallest:.1f} px in a {COLUMN_PX}-px column"


def test_small_text_in_a_wide_figure_is_caught():
    planted = '<svg width="936pt" height="518pt"><text style="font: 8.5px sans-serif; font-size: 8.5px">x</text></svg>'
    assert smallest_text_px(planted) < SMALLEST_PX
