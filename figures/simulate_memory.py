"""Figure: memory per rank from 1 to 1,024 simulated ranks, and what FSDP2's peak is made of.

Every number is a `planner.simulate` run: one AdamW step of a Llama-shaped model (Llama 3.2 1B's shape,
16 layers, hidden 2048, vocabulary 128,256, with an untied head so that it can be wrapped on its own),
one sequence of 2,048 tokens per rank, fp32, under the fake backend.
  top     the peak per rank against the world size, for each strategy, beside planner.plan's total
          (dashed: its state, its activation estimate and FSDP's gathers)
  bottom  FSDP2's peak at 64 ranks split by what it is made of (the tracker's categories), wrapped per
         block (the embedding and the head stay in the root group, gathered whole all step), with the
         embedding and the head as groups of their own, and each with activation checkpointing

    python figures/simulate_memory.py        # the figure, at full size: a few minutes
    python figures/simulate_memory.py --toy  # seconds: a 2-layer model, 1 and 8 ranks
"""
from style import COLORS, IMAGES, parser, plt, save
from transformers import LlamaConfig

from common.machine import machine_name
from planner.plan import STRATEGIES as NAMES
from planner.simulate import STRATEGIES, Case, gathered_and_buffers, simulate

SHAPES = {
    "default": {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 128256},
    "toy": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 4096},
}
SIZES = {"default": (1, 2, 4, 8, 16, 64, 256, 1024), "toy": (1, 8)}
SEQ = {"default": 2048, "toy": 32}
BREAKDOWN_GPUS = {"default": 64, "toy": 8}
WRAPS = {"per block": ("blocks", False), "embedding, head apart": ("blocks+embeddings", False),
         "per block, recompute": ("blocks", True), "apart, recompute": ("blocks+embeddings", True)}
PARTS = ("sharded state", "gathered parameters", "activations", "other (backward's temporaries)")
GB = 1e9


def record(size: str = "default") -> dict:
    config = LlamaConfig(**SHAPES[size], tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                         bos_token_id=0, eos_token_id=0)

    def run(strategy, gpus, wrap="blocks", recompute=False):
        return simulate(Case(strategy, gpus, min(8, gpus), config=config, seq=SEQ[size], wrap=wrap,
                             recompute=recompute))

    curves = {strategy: [run(strategy, gpus) for gpus in SIZES[size]] for strategy in STRATEGIES}
    bars = {name: run("fsdp", BREAKDOWN_GPUS[size], wrap, recompute) for name, (wrap, recompute) in WRAPS.items()}
    return {"size": size, "curves": curves, "bars": bars, "machine": machine_name()}


def parts(measured: dict) -> list[float]:
    """The peak split into PARTS: the tracker's categories, gathered parameters with their all-gather buffers,
    and the rest of the peak (gradients of activations in backward, the loss's copies, inputs)."""
    split = [measured["param_bytes"] + measured["grad_bytes"] + measured["optimizer_bytes"],
             gathered_and_buffers(measured), measured["activation_bytes"]]
    return [*split, max(0, measured["peak_bytes"] - sum(split))]


def draw(recording: dict, path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.2, 8.4), gridspec_kw={"height_ratios": [1.5, 1]})
    for color, marker, (strategy, results) in zip(COLORS, "osD^vx", recording["curves"].items()):  # lines that coincide stay visible
        gpus = [result["gpus"] for result in results]
        top.plot(gpus, [r["measured"]["peak_bytes"] / GB for r in results], "-", marker=marker, markerfacecolor="none",
                 color=color, label=NAMES[strategy])
        top.plot(gpus, [r["planned"]["peak_bytes"] / GB for r in results], "--", color=color, alpha=0.6)
    top.set_xscale("log", base=2)
    top.set_xticks(gpus, [str(n) for n in gpus])
    top.set_ylim(bottom=0)
    top.set_xlabel("simulated ranks (GPUs)")
    top.set_ylabel("peak memory per rank, GB (10^9 bytes)")
    top.set_title("simulated (solid) and planned (dashed)", fontsize=9)
    top.legend(fontsize=8, ncol=2)
    names = list(recording["bars"])[::-1]
    split = {name: parts(recording["bars"][name]["measured"]) for name in names}
    start = [0.0] * len(names)
    for index, (color, part) in enumerate(zip(COLORS, PARTS)):
        widths = [split[name][index] / GB for name in names]
        bottom.barh(names, widths, left=start, color=color, label=part)
        start = [a + b for a, b in zip(start, widths)]
    for y, total in enumerate(start):
        bottom.text(total, y, f" {total:.2f} GB", va="center", fontsize=8)
    bottom.set_xlim(0, max(start) * 1.3)
    bottom.set_xlabel("FSDP2's peak per rank, GB")
    gpus = recording["bars"][names[0]]["gpus"]
    bottom.set_title(f"FSDP2 at {gpus} ranks: what the peak holds", fontsize=9)
    bottom.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    params = recording["curves"]["fsdp"][0]["params"]
    fig.suptitle(f"One AdamW step of a {params / 1e9:.2f} B-parameter Llama-shaped model, fp32,\nsimulated on one "
                 f"{recording['machine']}", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "simulate_memory.png", toy=True).parse_args()
    draw(record("toy" if args.toy else "default"), args.out)


if __name__ == "__main__":
    main()
