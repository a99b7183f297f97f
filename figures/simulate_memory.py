"""Figure: memory per rank from 1 to 1,024 simulated ranks, and what FSDP2's peak is made of.

Every number is a `common.simulate` run: one AdamW step of a Llama-shaped model (Llama 3.2 1B's shape,
16 layers, hidden 2048, vocabulary 128,256, with an untied head so that it can be wrapped on its own),
one sequence of 2,048 tokens per rank, fp32, under the fake backend.
  left   the peak per rank against the world size, for each strategy, beside common.plan's total
         (dashed: its state plus its activation estimate)
  right  FSDP2's peak at 64 ranks split by what it is made of (the tracker's categories), wrapped per
         block (the embedding and the head stay in the root group, gathered whole all step), with the
         embedding and the head as groups of their own, and each with activation checkpointing

    python figures/simulate_memory.py        # the figure, at full size: a few minutes
    python figures/simulate_memory.py --toy  # seconds: a 2-layer model, 1 and 8 ranks
"""
from transformers import LlamaConfig

from common.machine import machine_name
from common.plan import STRATEGIES as NAMES
from common.simulate import STRATEGIES, Case, simulate
from style import COLORS, IMAGES, parser, plt, save

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
PARTS = [("sharded state", ("param_bytes", "grad_bytes", "optimizer_bytes")),
         ("gathered parameters", ("unsharded_param_bytes",)), ("activations", ("activation_bytes",)),
         ("communication buffers", ("comm_buffer_bytes",))]
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


def parts(measured: dict) -> dict[str, float]:
    """The peak split into PARTS, the rest of it (temporaries, inputs) as "other"."""
    split = {name: sum(measured[key] for key in keys) for name, keys in PARTS}
    return {**split, "other": max(0, measured["peak_bytes"] - sum(split.values()))}


def draw(recording: dict, path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
    for color, (strategy, results) in zip(COLORS, recording["curves"].items()):
        gpus = [result["gpus"] for result in results]
        left.plot(gpus, [r["measured"]["peak_bytes"] / GB for r in results], "o-", color=color, label=NAMES[strategy])
        left.plot(gpus, [r["planned"]["peak_bytes"] / GB for r in results], "--", color=color, alpha=0.6)
    left.set_xscale("log", base=2)
    left.set_xticks(gpus, [str(n) for n in gpus])
    left.set_yscale("log")
    left.set_xlabel("simulated ranks (GPUs)")
    left.set_ylabel("peak memory per rank, GB (10^9 bytes)")
    left.set_title("simulated (solid) and planned (dashed)", fontsize=9)
    left.legend(fontsize=8, ncol=2)
    names = list(recording["bars"])[::-1]
    split = {name: parts(recording["bars"][name]["measured"]) for name in names}
    start = [0.0] * len(names)
    for color, part in zip(COLORS, [name for name, _ in PARTS] + ["other"]):
        widths = [split[name][part] / GB for name in names]
        right.barh(names, widths, left=start, color=color, label=part)
        start = [a + b for a, b in zip(start, widths)]
    for y, total in enumerate(start):
        right.text(total, y, f" {total:.2f} GB", va="center", fontsize=8)
    right.set_xlim(0, max(start) * 1.3)
    right.set_xlabel("FSDP2's peak per rank, GB")
    gpus = recording["bars"][names[0]]["gpus"]
    right.set_title(f"FSDP2 at {gpus} ranks: what the peak holds", fontsize=9)
    right.legend(fontsize=8, loc="lower right")
    params = recording["curves"]["fsdp"][0]["params"]
    fig.suptitle(f"One AdamW step of a {params / 1e9:.2f} B-parameter Llama-shaped model, fp32, simulated on one "
                 f"{recording['machine']}", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def main():
    args = parser(__doc__, IMAGES / "simulate_memory.png", toy=True).parse_args()
    draw(record("toy" if args.toy else "default"), args.out)


if __name__ == "__main__":
    main()
