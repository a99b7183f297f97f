"""python -m planner.simulate: one training step at a simulated world size, trusted where it can be checked.

The simulation plays rank 0 of N under torch's fake backend, on fake tensors. The same function runs here
under a real gloo group with real tensors: rank 0's persistent state (parameters, gradients, optimizer
state) and its collectives (kind, count, bytes) must be the same. Then the persistent state must agree
with planner.plan at sizes no machine here has, and a planted error in the plan's formula must show.
"""
import json
import sys
from dataclasses import asdict, replace

import pytest
import torch.distributed as dist

import planner.plan as planner
from common.spawn import run_in_process_group
from planner.simulate import Case, fake_group, gathered_and_buffers, main, measure_step, simulate

SMALL = Case("fsdp", 2, 2, layers=2, hidden=64, batch=4)
CHECKED = ("param_bytes", "grad_bytes", "optimizer_bytes", "collectives")  # what equals a real run, below
STATE = ("param_bytes", "grad_bytes", "optimizer_bytes")


def real_rank0(rank, world_size, cases):
    """Each case under the real gloo group of this many processes: rank 0's measurements."""
    return [asdict(measure_step(replace(case, gpus=world_size), fake=False)) for case in cases]


def simulated(case):
    fake_group(case.gpus)
    try:
        return asdict(measure_step(case, fake=True))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_simulation_is_the_real_run_at_2_and_3_processes(world_size):
    """DDP (emulated in both) agrees in everything; the peak of the others differs where the real backend
    allocates its own staging copies, which fake collectives do not (the module docstring)."""
    cases = [replace(SMALL, strategy=strategy, gpus=world_size) for strategy in ("fsdp", "zero1", "zero2", "zero3", "ddp")]
    real = run_in_process_group(real_rank0, world_size, cases, timeout=120)
    for case, measured in zip(cases, real):
        fake = simulated(case)
        assert {key: fake[key] for key in CHECKED} == {key: measured[key] for key in CHECKED}, case.strategy
        assert fake["collectives"], case.strategy  # a step without collectives would make the check above empty
    assert simulated(cases[-1]) == real[-1]


def test_hsdp_on_a_2_by_2_mesh_is_the_real_run():
    case = replace(SMALL, strategy="hsdp", gpus=4, gpus_per_node=2)
    fake, real = simulated(case), run_in_process_group(real_rank0, 4, [case], timeout=120)[0]
    assert {key: fake[key] for key in CHECKED} == {key: real[key] for key in CHECKED}
    assert [c["kind"] for c in fake["collectives"]] == ["all_reduce", "all_gather", "reduce_scatter"]


def disagreements(sizes: dict[str, tuple[int, ...]], precision: str = "fp32") -> list[str]:
    """Where the plan's parameters, gradients or optimizer state differ from the simulation by more than 5 %."""
    found = []
    for strategy, world_sizes in sizes.items():
        for gpus in world_sizes:
            result = simulate(Case(strategy, gpus, min(8, gpus), layers=2, hidden=1024, batch=2, precision=precision))
            for key in STATE:
                ratio = result["measured"][key] / result["planned"][key]
                if abs(ratio - 1) > 0.05:
                    found.append(f"{strategy} at {gpus}: {key} measured/planned = {ratio:.3f}")
    return found


ALL_SIZES = (1, 2, 3, 4, 8, 64, 512, 1024)


def test_the_plan_agrees_with_the_simulation_up_to_1024_ranks():
    assert disagreements({"fsdp": ALL_SIZES, "zero3": (1, 3, 1024), "zero1": (3, 1024), "zero2": (3, 1024),
                          "ddp": (1024,), "hsdp": (64, 1024)}) == []


def test_in_the_mixed_policy_the_plan_counts_fp32_state_and_bf16_gathers():
    """FSDP2's MixedPrecisionPolicy keeps fp32 shards (the plan's fp32 accounting, not the ZeRO paper's mixed)
    and gathers bf16 copies: half the bytes of an fp32 gather, the reduce-scatter still fp32."""
    assert disagreements({"fsdp": ALL_SIZES, "zero3": (1024,), "hsdp": (64,)}, "mixed") == []
    fp32, mixed = (simulate(replace(SMALL, precision=precision)) for precision in ("fp32", "mixed"))
    for result in (fp32, mixed):  # the bytes; the counts differ where the root group holds nothing (the plan adds one)
        measured, planned = ({c["kind"]: c["bytes_per_rank"] for c in result[side]["collectives"]}
                             for side in ("measured", "planned"))
        assert measured == pytest.approx(planned)
    gathered = [result["measured"]["collectives"][0]["bytes_per_rank"] for result in (fp32, mixed)]
    assert gathered[1] * 2 == gathered[0]


def test_a_planted_error_in_the_plans_formula_shows(monkeypatch):
    """The controls: AdamW's state counted as 12 bytes per parameter in fp32 (the mixed figure) is caught; so
    is a plan that forgets the prefetched block."""
    monkeypatch.setitem(planner.BYTES_PER_PARAM, "fp32", (4, 4, 12))
    assert disagreements({"fsdp": (64,)}) == ["fsdp at 64: optimizer_bytes measured/planned = 0.667"]
    monkeypatch.undo()
    one_block = planner.gathered_bytes
    monkeypatch.setattr(planner, "gathered_bytes", lambda *args: one_block(*args) - 4 * (1024 * 1024 + 1024))
    measured, planned = gathers(STACK)
    assert measured != planned


TOY_LLAMA = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=4096, tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=0,
                 eos_token_id=0)


STACK = Case("fsdp", 8, 8, layers=4, hidden=1024)  # blocks big beside their activations: the peak is the gathers'


def gathers(case):
    result = simulate(case)
    return gathered_and_buffers(result["measured"]), gathered_and_buffers(result["planned"])


def test_the_plan_counts_what_fsdp_holds_gathered():
    """The most FSDP2 holds gathered at once: the root group, two blocks and the fp32 gradient of a block (a stack
    without a root) or of the root (a language model whose head and embedding outweigh its blocks), byte for byte
    where the peak is that moment, in fp32 and in the mixed policy's bf16 gathers. With the embedding and the head
    wrapped apart, the peak comes at another moment, with less gathered: the 4096 × 64 head and embedding no
    longer stay gathered all step."""
    from transformers import LlamaConfig
    llama = Case("fsdp", 8, 8, config=LlamaConfig(**TOY_LLAMA), seq=16)
    for case in (STACK, replace(STACK, precision="mixed"), llama):
        measured, planned = gathers(case)
        assert measured == planned > 0, case
    blocks, apart = gathers(llama), gathers(replace(llama, wrap="blocks+embeddings"))
    assert apart[0] < blocks[0] and apart[0] <= apart[1] < blocks[1]


def test_1024_ranks_of_fsdp_gather_each_layer_twice_and_hold_a_1024th(capsys):
    main(["--layers", "8", "--hidden", "1024", "--gpus", "1024", "--strategy", "fsdp", "--json"])
    [result] = json.loads(capsys.readouterr().out)
    assert result["measured"]["param_bytes"] == 8 * (1024 * 1024 + 1024) * 4 // 1024
    assert result["measured"]["collectives"] == [
        {"kind": "all_gather", "count": 16, "bytes_per_rank": 2 * 8 * (1024 * 1024 + 1024) * 4},
        {"kind": "reduce_scatter", "count": 8, "bytes_per_rank": 8 * (1024 * 1024 + 1024) * 4 // 1024}]


@pytest.mark.parametrize("argv, says", [
    (["--layers", "2", "--hidden", "64", "--gpus", "12", "--gpus-per-node", "8", "--strategy", "hsdp"],
     "--gpus 12 is not a whole number of nodes of --gpus-per-node 8"),
    (["--model", "MISSING", "--gpus", "2"], "no config.json there and not in the Hugging Face cache"),
    (["--layers", "2", "--hidden", "64", "--strategy", "zero3", "--wrap", "blocks+embeddings"],
     "--wrap blocks+embeddings is FSDP2's: zero3 has no groups of blocks to wrap"),
    (["--layers", "2", "--hidden", "64", "--head", "causal-lm"], "--head causal-lm chooses the head of --model's config"),
])
def test_bad_input_is_one_sentence(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and says in err and "Traceback" not in err, err


def test_a_torch_without_the_fake_backend_is_one_sentence(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)  # import fails, as before 2.4
    with pytest.raises(SystemExit) as stopped:
        main(["--layers", "2", "--hidden", "64", "--gpus", "2"])
    assert stopped.value.code == 2 and "has no fake process-group backend" in capsys.readouterr().err


def test_a_model_that_cannot_be_built_on_fake_tensors_is_one_sentence(tmp_path, capsys, monkeypatch):
    """A model whose constructor needs real data (here: one that reads a weight's values) is named, not a traceback."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class NeedsValues(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.lm_head.weight.sum().item()  # a fake tensor has no value to give

        @classmethod
        def from_config(cls, config):  # as the Auto classes build one
            return cls(config)

    LlamaConfig(**TOY_LLAMA).save_pretrained(tmp_path)
    monkeypatch.setattr(planner, "head_class", lambda config, head: NeedsValues)
    with pytest.raises(SystemExit) as stopped:
        main(["--model", str(tmp_path), "--gpus", "2", "--seq", "8"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "cannot be built without memory (on fake tensors)" in err and "Traceback" not in err, err


def test_a_tied_model_is_refused_by_zero_and_by_the_split_wrap(tmp_path, capsys):
    from transformers import GPT2Config
    GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, architectures=["GPT2LMHeadModel"],
               eos_token_id=0).save_pretrained(tmp_path)
    for argv, says in ((["--strategy", "zero2"], "common/lessons/zero.py refuses this model"),
                       (["--wrap", "blocks+embeddings"], "ties its output head to its input embedding")):
        with pytest.raises(SystemExit):
            main(["--model", str(tmp_path), "--gpus", "2", "--seq", "8", *argv])
        assert says in capsys.readouterr().err


def test_a_decoder_only_config_that_names_no_architecture_is_simulated_as_a_causal_lm(tmp_path, capsys):
    """A config made in code and saved (LlamaConfig(...).save_pretrained) names no architectures: Llama's model
    type is decoder-only, so the step is a causal LM's, untied head and all, as if the config named
    LlamaForCausalLM; a BERT config stays a classifier, and --head chooses by hand. The first line names the
    class built, and so does the JSON."""
    from transformers import BertConfig, LlamaConfig
    LlamaConfig(**{key: value for key, value in TOY_LLAMA.items() if key != "architectures"}).save_pretrained(tmp_path / "llama")
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
               max_position_embeddings=16).save_pretrained(tmp_path / "bert")
    main(["--model", str(tmp_path / "llama"), "--gpus", "2", "--seq", "8", "--strategy", "ddp", "--json"])
    [result] = json.loads(capsys.readouterr().out)
    named = planner.model_of_config(LlamaConfig(**TOY_LLAMA))  # architectures=["LlamaForCausalLM"]
    assert result["params"] == named.params and result["measured"]["param_bytes"] == 4 * named.params
    assert result["model_class"] == "LlamaForCausalLM"
    for folder, flags, built in (("llama", [], "LlamaForCausalLM"), ("bert", [], "BertForSequenceClassification"),
                                 ("llama", ["--head", "sequence-classification"], "LlamaForSequenceClassification")):
        main(["--model", str(tmp_path / folder), "--gpus", "2", "--seq", "8", "--strategy", "ddp", *flags])
        assert f" parameters in {built} at 2 simulated ranks" in capsys.readouterr().out.splitlines()[0]
