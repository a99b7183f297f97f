"""Plan before you rent: memory per GPU and time per step for DDP, ZeRO-1/2/3, FSDP and HSDP.

    python -m planner.plan --params 7.5e9 --gpus 64 --precision mixed          # the ZeRO paper's Figure 1
    python -m planner.plan --model bert-base-uncased --gpus 8 --gpu H100 --intra nvlink
    python -m planner.plan --params 7e9 --gpus 64 --gpus-per-node 8 --network ib400 --strategy zero3 hsdp --json

Memory per GPU (the ZeRO paper's accounting, Rajbhandari et al. 2020, Figure 1 and section 3): Ψ
parameters trained with Adam hold, on every rank, parameters, gradients and K·Ψ bytes of optimizer state:
  fp32   4Ψ + 4Ψ + 8Ψ      (K = 8: the two moments)
  mixed  2Ψ + 2Ψ + 12Ψ     (bf16/fp16 weights and gradients; K = 12: an fp32 master copy and the moments)
ZeRO-1 divides the optimizer term by the N ranks that shard it, ZeRO-2 the gradients too, ZeRO-3 and FSDP
all three; HSDP shards like FSDP within a node and replicates across nodes (the shard count is the GPUs
per node). Activations are an estimate (Korthikanti et al. 2022, "Reducing activation recomputation",
section 4.1: 34·s·b·h bytes per transformer layer in 16-bit, twice that in fp32; their 5·a·s²·b more
for the attention scores only with --attention eager, since fused attention, torch's SDPA and
transformers' default, never stores them), plus a language model's logits, s·b·V in fp32 for the loss;
they need the layer count, width and heads, which --model reads from the config. FSDP and HSDP also hold
parameters gathered whole: the root group (what no block holds: the embeddings, the final norm, the head)
all step, two blocks (the one running, the next prefetched) and the whole fp32 gradient of a block (or
of the root, at the end of backward) before its reduce-scatter; with --wrap blocks+embeddings the embedding and the head leave the root and are
gathered in turn, like blocks. --model knows the blocks' sizes; --params does not, and leaves the gathers
out. The total adds the activations to the state and the gathers; planner.simulate measures all three.

Time per step: compute is 6 FLOPs per parameter per token (the matrices; embeddings do no matmul) plus
the attention scores, 6·L·s·h per token (Kaplan et al. 2020, table 1, times 3 for forward and backward),
at a stated model FLOPs utilisation (MFU) of the GPU's peak. Communication is the ring's cost model,
common.lessons.allreduce.bytes_sent_per_rank, plus one latency per ring step: an all-reduce of S bytes sends
2(N−1)/N·S per rank in 2(N−1) steps, a reduce-scatter or an all-gather half of that. The latency is paid
once per collective, and a step issues several: DDP one per gradient bucket (torch's 1 MiB first bucket,
then 25 MiB; three with PowerSGD), ZeRO and FSDP one per sharded unit (a transformer block each, plus the root). What overlap hides
is the Ultra-Scale Playbook's condition: a gradient reduction issued during backward is hidden as far
as backward lasts (DDP, ZeRO-2), ZeRO-3/FSDP's prefetched gathers and reductions as far as the whole
forward and backward last; ZeRO-1's reductions and the all-gather after the step are exposed.

Within a node the --intra link applies (NVLink by default). Across nodes, a ring (NCCL's rings, one per
NIC) carries 2(N−1)/N·S in and out of each node in all, so it runs at the node's bandwidth (its NICs
together: eight 400 Gb/s for ib400, as in a DGX H100; one NIC for the Ethernet presets), or at the
GPU's NVLink rate if that is lower. benchmarks/plan_check.py
measures what can be measured here (bytes per rank, and step times on CPU processes) beside these
predictions.
"""
import argparse
import json
import math
from dataclasses import asdict, dataclass, replace

from common.lessons.allreduce import bytes_sent_per_rank
from common.lessons.comm_hooks import powersgd_numel

GB = 1e9
MiB = 2**20
STRATEGIES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP", "hsdp": "HSDP"}
SHARDED_TERMS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}  # optimizer, + grads, + params
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}  # parameters, gradients, optimizer state (K)


@dataclass(frozen=True)
class GPU:
    """Peak dense FLOP/s (16-bit tensor cores, and fp32 without TF32) and memory, from the vendor's datasheet."""
    name: str
    flops_16bit: float
    flops_fp32: float
    memory_bytes: float


GPUS = {  # NVIDIA datasheets: H100 SXM5 (2023), H200 SXM (2024), A100 SXM4 80GB (2021), V100 SXM2 (2020, fp16: no
    # bf16), L4 (2023)
    "H100": GPU("H100 SXM 80GB", 989e12, 67e12, 80e9),
    "H200": GPU("H200 SXM 141GB", 989e12, 67e12, 141e9),
    "A100": GPU("A100 SXM 80GB", 312e12, 19.5e12, 80e9),
    "V100": GPU("V100 SXM2 32GB", 125e12, 15.7e12, 32e9),
    "L4": GPU("L4 24GB", 121e12, 30.3e12, 24e9),
}


@dataclass(frozen=True)
class Link:
    """One link's bandwidth in bytes/s each way and latency per message in seconds; across nodes, a node
    has `per_node` of them (one per GPU in a DGX/HGX H100, one per node on a typical Ethernet cluster)."""
    name: str
    bandwidth: float
    latency: float
    per_node: int = 1


NETWORKS = {  # line rates: NVLink 4 (H100 datasheet: 900 GB/s both ways per GPU), ConnectX-7 NDR, Ethernet
    "nvlink": Link("NVLink 4", 450e9, 3e-6, 8),
    "ib400": Link("InfiniBand 400 Gb/s, one per GPU", 50e9, 5e-6, 8),
    "100gbe": Link("100 GbE, one per node", 12.5e9, 20e-6),
    "10gbe": Link("10 GbE, one per node", 1.25e9, 50e-6),
}


@dataclass(frozen=True)
class Model:
    """What the plan needs to know of a model: its parameter count and, when known, its shape."""
    params: int
    embedding_params: int = 0
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    powersgd_numel: dict | None = None  # PowerSGD's rank -> the elements it sends (from the parameter shapes)
    block_params: int | None = None  # the largest transformer block's
    root_params: int | None = None  # outside every block: embeddings, final norm, pooler, head
    end_params: tuple[int, int] | None = None  # the input embedding's and the output head's (0 if none)
    vocab: int | None = None  # a language model's: its logits, one per token and word
    built: str | None = None  # the class counted, for a transformers config (head_class's choice)


class PlanError(ValueError):
    """Input the plan cannot use; the message is one sentence for the user."""


def memory_bytes(strategy: str, params: int, shards: int, precision: str = "mixed") -> tuple[float, float, float]:
    """Parameters, gradients and optimizer state per GPU, in bytes, when `shards` ranks share them."""
    sharded = SHARDED_TERMS[strategy]
    return tuple(per_param * params / (shards if sharded >= 3 - term else 1)
                 for term, per_param in enumerate(BYTES_PER_PARAM[precision]))


def activation_bytes(model: Model, batch: int, seq: int, precision: str, recompute: bool = False,
                     attention: str = "fused") -> float | None:
    """Korthikanti et al.'s activations of one forward (with full recomputation, only each layer's input,
    2·s·b·h); the attention scores (5·a·s/h more per s·b·h) only where attention is eager; a language
    model's logits, s·b·V in fp32 for the loss; None without the shape."""
    if None in (model.layers, model.hidden, model.heads):
        return None
    s, h, a = seq, model.hidden, model.heads
    per_layer = 2 if recompute else 34 + (5 * a * s / h if attention == "eager" else 0)
    logits = 4 * s * batch * model.vocab if model.vocab else 0
    return model.layers * s * batch * h * per_layer * (2 if precision == "fp32" else 1) + logits


def gathered_bytes(strategy: str, model: Model, precision: str, wrap: str = "blocks") -> float | None:
    """The most that FSDP and HSDP hold gathered at once (fully_shard_blocks' groups): the root group, all
    step; two units (the one running and the next, prefetched); and the whole fp32 gradient of a unit or,
    at the end of backward, of the root, waiting for its reduce-scatter. A unit is a block, or with
    wrap="blocks+embeddings" also the embedding or the head, which then leave the root. 0 where nothing is
    sharded; None where the blocks' sizes are unknown (--params), and for ZeRO-3, whose units are modules,
    not blocks (common/lessons/zero.py)."""
    if strategy in ("ddp", "zero1", "zero2"):
        return 0
    if strategy == "zero3" or model.block_params is None:
        return None
    root, unit = model.root_params, model.block_params
    if wrap == "blocks+embeddings":
        root, unit = root - sum(model.end_params), max(unit, *model.end_params)
    return BYTES_PER_PARAM[precision][0] * (root + 2 * unit) + 4 * max(unit, root)


def step_flops(model: Model, tokens: int, seq: int) -> float:
    """FLOPs of one forward and backward over `tokens` tokens."""
    attention = 6 * model.layers * seq * model.hidden if model.layers and model.hidden else 0
    return tokens * (6 * (model.params - model.embedding_params) + attention)


def ring_seconds(kind: str, size_bytes: float, ranks: int, link: Link, pieces: int = 1) -> float:
    """size_bytes moved by `pieces` ring collectives: all_reduce, or reduce_scatter / all_gather (half an
    all-reduce). The bytes cost the same however they are cut; each piece pays the ring's latency."""
    if ranks == 1 or size_bytes == 0:
        return 0.0
    fraction = 1 if kind == "all_reduce" else 0.5
    steps = 2 * (ranks - 1) * fraction
    return pieces * steps * link.latency + fraction * bytes_sent_per_rank("ring", size_bytes, ranks) / link.bandwidth


def all_reduces_per_bucket(compression: str) -> int:
    """What DDP's hook issues per gradient bucket: one all-reduce, or powerSGD_hook's three once it compresses
    (the tensors it sends whole, then the Ps, then the Qs; common/lessons/comm_hooks.py registers that hook)."""
    return 3 if compression.startswith("powersgd") else 1


def collectives_per_step(strategy: str, model: "Model", grad_bytes: float) -> int:
    """How many pieces each kind of collective is cut into in one step: DDP's buckets at torch's default
    caps (a 1 MiB first bucket, then 25 MiB); ZeRO and FSDP one per unit, a layer each plus the root."""
    if strategy == "ddp":
        return 1 + math.ceil(max(0.0, grad_bytes - MiB) / (25 * MiB))
    return model.layers + 1 if model.layers else 1


@dataclass
class Plan:
    """One strategy's prediction, per GPU; seconds per step, bytes per GPU."""
    strategy: str
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float | None
    gathered_bytes: float | None
    total_bytes: float
    fits: bool
    compute_s: float
    communication_s: float
    hidden_s: float
    exposed_s: float
    step_s: float
    samples_per_s: float
    scaling_efficiency: float
    communication: str
    collectives: int


def communication(strategy: str, params: int, gpus: int, per_node: int, precision: str, intra: Link, inter: Link,
                  compression: str = "none", model: Model | None = None, gloo: bool = False,
                  pieces: int = 1) -> tuple[float, float, str]:
    """Seconds of communication per step: (reduced during backward, the rest), and what moves.

    gloo=True: gloo computes reduce_scatter_tensor as a whole all-reduce (common/lessons/zero.py's docstring)."""
    param_bytes, grad_bytes, _ = BYTES_PER_PARAM[precision]
    grads, weights = grad_bytes * params, param_bytes * params
    nodes = gpus // per_node
    node_bandwidth = inter.bandwidth * min(inter.per_node, per_node)
    link = intra if nodes == 1 else Link(f"{intra.name} + {inter.name}", min(intra.bandwidth, node_bandwidth),
                                         max(intra.latency, inter.latency))
    reduce_scatter = "all_reduce" if gloo else "reduce_scatter"
    if strategy == "ddp":
        if compression == "fp16":
            grads = min(grads, 2 * params)
        elif compression.startswith("powersgd"):  # its own compute, and its effect on accuracy, are left out
            grads = grad_bytes * model.powersgd_numel[int(compression.removeprefix("powersgd"))]
        return (ring_seconds("all_reduce", grads, gpus, link, pieces), 0.0,
                f"all-reduce {grads / GB:.3g} GB of gradients")
    if strategy in ("zero1", "zero2"):
        reduce = ring_seconds(reduce_scatter, grads, gpus, link, pieces)
        gather = ring_seconds("all_gather", weights, gpus, link, pieces)
        return reduce, gather, "reduce-scatter the gradients, all-gather the parameters after the step"
    if strategy in ("zero3", "fsdp"):
        return (ring_seconds(reduce_scatter, grads, gpus, link, pieces),
                2 * ring_seconds("all_gather", weights, gpus, link, pieces),
                "all-gather the parameters in forward and in backward, reduce-scatter the gradients")
    within = (ring_seconds(reduce_scatter, grads, per_node, intra, pieces)
              + 2 * ring_seconds("all_gather", weights, per_node, intra, pieces))
    # each GPU all-reduces its gradient shard with its peers in the other nodes; the node's GPUs share its NICs
    across = ring_seconds("all_reduce", grads / per_node, nodes,
                          Link(inter.name, node_bandwidth / per_node, inter.latency), pieces)
    return across, within, "FSDP within each node; all-reduce each GPU's gradient shard across nodes"


def plan(strategy: str, model: Model, gpus: int, per_node: int, gpu: GPU, intra: Link, inter: Link,
         precision: str = "mixed", batch: int = 8, seq: int = 512, mfu: float = 0.4, compression: str = "none",
         overlap: bool = True, gloo: bool = False, recompute: bool = False, pieces: int | None = None,
         attention: str = "fused", wrap: str = "blocks") -> Plan:
    """The prediction for one strategy; batch is per GPU. recompute: activation checkpointing, which
    keeps each layer's input only and runs the forward twice (8 FLOPs per parameter per token, not 6).
    pieces: collectives of each kind per step (for DDP its buckets, each all-reduced as many times as its hook
    does), where they are known, else collectives_per_step's."""
    shards = per_node if strategy == "hsdp" else gpus
    parts = memory_bytes(strategy, model.params, shards, precision)
    activations = activation_bytes(model, batch, seq, precision, recompute, attention)
    gathered = gathered_bytes(strategy, model, precision, wrap)
    total = sum(parts) + (activations or 0) + (gathered or 0)
    peak = gpu.flops_fp32 if precision == "fp32" else gpu.flops_16bit
    compute = step_flops(model, batch * seq, seq) * (4 / 3 if recompute else 1) / (peak * mfu)
    pieces = pieces or collectives_per_step(strategy, model, BYTES_PER_PARAM[precision][1] * model.params)
    if strategy == "ddp":
        pieces *= all_reduces_per_bucket(compression)
    during_backward, rest, what = communication(strategy, model.params, gpus, per_node, precision, intra, inter,
                                                compression, model, gloo, pieces)
    if not overlap or strategy == "zero1":
        hidden = 0.0
    elif strategy in ("zero3", "fsdp", "hsdp"):
        hidden = min(during_backward + rest, compute)  # prefetched gathers run under forward and backward
    else:
        hidden = min(during_backward, 2 / 3 * compute)  # backward is two thirds of the compute
    exposed = during_backward + rest - hidden
    step = compute + exposed
    return Plan(STRATEGIES[strategy], *parts, activations, gathered, total, total <= gpu.memory_bytes,
                compute, during_backward + rest, hidden, exposed, step, batch * gpus / step, compute / step, what,
                pieces)


def load_config(name: str):
    """A transformers config from a local folder or the Hugging Face cache; nothing is downloaded."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        raise PlanError(f"--model {name}: no config.json there and not in the Hugging Face cache (nothing is "
                        "downloaded): pass a local folder holding the model's config.json") from None


HEADS = ("auto", "causal-lm", "sequence-classification")


def add_head_flag(parser: argparse.ArgumentParser) -> None:
    """--head, which both planners take: the head of --model's config (head_class)."""
    parser.add_argument("--head", choices=HEADS, default="auto",
                        help="--model's head: auto (default: a causal LM for a decoder-only model type or where the "
                             "config's architectures name one, else a sequence classifier), causal-lm, "
                             "sequence-classification")


def head_class(config, head: str = "auto"):
    """The model a config is trained as here: `head`'s, or with auto the head its architectures name (a causal LM,
    its head untied or not, or a sequence classifier); where they name neither (a config made in code names none),
    a causal LM for a decoder-only model type (one transformers builds as a causal LM and neither as a masked LM
    nor as a sequence-to-sequence LM: Llama, GPT-2, not BERT), else a sequence classifier (the course's BERT task)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.models.auto import modeling_auto
    if head != "auto":
        return {"causal-lm": AutoModelForCausalLM, "sequence-classification": AutoModelForSequenceClassification}[head]
    names = config.architectures or []
    if any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in names) or getattr(config, "is_decoder", False):
        return AutoModelForCausalLM
    if any(name.endswith("ForSequenceClassification") for name in names):
        return AutoModelForSequenceClassification
    kind = config.model_type
    decoder_only = kind in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES \
        and kind not in modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    return AutoModelForCausalLM if decoder_only else AutoModelForSequenceClassification


def model_of_config(config, model_class=None, powersgd_ranks=(1, 4), head: str = "auto") -> Model:
    """A transformers config's model (head_class's unless model_class) built on the meta device, counted."""
    import torch

    from common.fsdp import transformer_blocks
    with torch.device("meta"):
        model = (model_class or head_class(config, head)).from_config(config)
    built = type(model).__name__
    params = list(model.parameters())  # a tied parameter once
    embeddings = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    powersgd = {rank: sum(powersgd_numel(p.shape, rank) for p in params) for rank in powersgd_ranks}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = [getattr(text, key, None) for key in ("num_hidden_layers", "hidden_size", "num_attention_heads")]
    count = lambda module: sum(p.numel() for p in module.parameters()) if module is not None else 0  # noqa: E731
    try:
        blocks = [count(block) for block in transformer_blocks(model)]
    except ValueError:  # no blocks it knows: no gathers planned
        return Model(sum(p.numel() for p in params), embeddings, *shape, powersgd, built=built)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight  # one parameter: counted with the embedding
    total = sum(p.numel() for p in params)
    vocab = text.vocab_size if head is not None and head.out_features == text.vocab_size else None
    return Model(total, embeddings, *shape, powersgd, max(blocks), total - sum(blocks),
                 (count(embedding), 0 if tied else count(head)), vocab, built)


def positive(kind):
    """An argparse type: a number above zero (floats accept 7.5e9)."""
    def parse(text: str):
        try:
            value = kind(float(text)) if kind is int else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above zero, not {text}")
        return value
    return parse


def preset(table: dict, what: str):
    """An argparse type: a key of table, case-insensitive, with the known ones named when it is not."""
    def parse(text: str):
        found = {key.lower(): value for key, value in table.items()}.get(text.lower())
        if found is None:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; known: {', '.join(table)}")
        return found
    return parse


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="python -m planner.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=positive(int), help="parameter count, e.g. 7e9")
    size.add_argument("--model", help="a hub name (from the local cache) or a folder with a config.json")
    add_head_flag(parser)
    parser.add_argument("--gpus", type=positive(int), default=8, help="GPUs in all (default: 8)")
    parser.add_argument("--gpus-per-node", type=positive(int), help="(default: 8, or --gpus if fewer)")
    parser.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                        help="one or more (default: all)")
    parser.add_argument("--precision", choices=BYTES_PER_PARAM, default="mixed",
                        help="mixed: 16-bit weights and gradients, fp32 master and Adam (default); fp32")
    parser.add_argument("--batch", type=positive(int), default=8, help="sequences PER GPU per step (default: 8)")
    parser.add_argument("--seq", type=positive(int), default=512, help="tokens per sequence (default: 512)")
    parser.add_argument("--recompute", action="store_true",
                        help="activation checkpointing: keep each layer's input only, run the forward twice")
    parser.add_argument("--attention", choices=("fused", "eager"), default="fused",
                        help="fused (default: SDPA, FlashAttention) stores no attention scores; eager stores them")
    parser.add_argument("--wrap", choices=("blocks", "blocks+embeddings"), default="blocks",
                        help="FSDP's groups: each block and the root (default), or the embedding and head apart too")
    parser.add_argument("--layers", type=positive(int), help="with --params: layers, for activations and attention")
    parser.add_argument("--hidden", type=positive(int), help="with --params: hidden size")
    parser.add_argument("--heads", type=positive(int), help="with --params: attention heads")
    parser.add_argument("--gpu", type=preset(GPUS, "GPU"), default=GPUS["H100"], help=f"{', '.join(GPUS)} (default: H100)")
    parser.add_argument("--peak-tflops", type=positive(float), help="peak FLOP/s by hand, in TFLOP/s (replaces the preset's)")
    parser.add_argument("--memory-gb", type=positive(float), help="GPU memory by hand, in GB")
    parser.add_argument("--mfu", type=positive(float), default=0.4, help="model FLOPs utilisation (default: 0.4)")
    parser.add_argument("--intra", type=preset(NETWORKS, "network"), default=NETWORKS["nvlink"],
                        help=f"link within a node: {', '.join(NETWORKS)} (default: nvlink)")
    parser.add_argument("--network", type=preset(NETWORKS, "network"), default=NETWORKS["ib400"],
                        help=f"links across nodes: {', '.join(NETWORKS)} (default: ib400)")
    parser.add_argument("--bandwidth-gbps", type=positive(float), help="across nodes by hand: Gb/s per node")
    parser.add_argument("--latency-us", type=positive(float), help="across nodes by hand: µs per message")
    parser.add_argument("--compression", choices=["none", "fp16", "powersgd1", "powersgd4"], default="none",
                        help="DDP communication hook: fp16_compress_hook, or PowerSGD at rank 1 or 4 (needs --model)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")
    args = parser.parse_args(argv)
    args.gpus_per_node = args.gpus_per_node or min(8, args.gpus)
    if args.gpus_per_node > args.gpus:
        parser.error(f"--gpus-per-node {args.gpus_per_node} is more than --gpus {args.gpus}")
    if args.gpus % args.gpus_per_node:
        parser.error(f"--gpus {args.gpus} is not a whole number of nodes of {args.gpus_per_node}")
    if args.mfu > 1:
        parser.error(f"--mfu {args.mfu:g} is above 1: it is a fraction of the peak")
    if args.head != "auto" and not args.model:
        parser.error(f"--head {args.head} chooses the head of --model's config: --params has no head to choose")
    if args.compression.startswith("powersgd") and not args.model:
        parser.error("PowerSGD's bytes depend on the parameter shapes: give --model instead of --params")
    if args.compression != "none" and args.strategy != ["ddp"]:
        parser.error("communication hooks are DDP's (register_comm_hook): use --strategy ddp with --compression")
    return args, parser


def main(argv=None) -> None:
    args, parser = parse_args(argv)
    try:
        model = model_of_config(load_config(args.model), head=args.head) if args.model else \
            Model(args.params, 0, args.layers, args.hidden, args.heads)
    except PlanError as error:
        parser.error(str(error))
    gpu, inter = args.gpu, args.network
    if args.peak_tflops:
        gpu = replace(gpu, name=f"{gpu.name} at {args.peak_tflops:g} TFLOP/s", flops_16bit=args.peak_tflops * 1e12,
                      flops_fp32=args.peak_tflops * 1e12)
    if args.memory_gb:
        gpu = replace(gpu, name=f"{gpu.name} with {args.memory_gb:g} GB", memory_bytes=args.memory_gb * GB)
    if args.bandwidth_gbps:
        inter = replace(inter, name=f"{args.bandwidth_gbps:g} Gb/s per node", bandwidth=args.bandwidth_gbps * 1e9 / 8,
                        per_node=1)
    if args.latency_us:
        inter = replace(inter, name=f"{inter.name}, {args.latency_us:g} µs", latency=args.latency_us * 1e-6)
    plans = [plan(name, model, args.gpus, args.gpus_per_node, gpu, args.intra, inter, args.precision, args.batch,
                  args.seq, args.mfu, args.compression, recompute=args.recompute, attention=args.attention,
                  wrap=args.wrap) for name in args.strategy]
    if args.json:
        print(json.dumps({"params": model.params, "model_class": model.built, "gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
                          "gpu": asdict(gpu), "intra": asdict(args.intra), "network": asdict(inter),
                          "precision": args.precision, "batch_per_gpu": args.batch, "seq": args.seq,
                          "mfu": args.mfu, "compression": args.compression, "recompute": args.recompute,
                          "attention": args.attention, "wrap": args.wrap,
                          "plans": [asdict(p) for p in plans]}, indent=1))
        return
    nodes = args.gpus // args.gpus_per_node
    print(f"{model.params / 1e9:.4g} B parameters ({model.params:,}){f' in {model.built}' if model.built else ''}, "
          f"{args.gpus} × {gpu.name} "
          f"({nodes} node{'s' * (nodes > 1)} of {args.gpus_per_node}; {args.intra.name} within"
          + (f", {inter.name} across" if nodes > 1 else "") + f"), {args.precision} precision, Adam; "
          f"batch {args.batch} × {args.seq} tokens per GPU; MFU {args.mfu:g}"
          + (f"; compression {args.compression}" if args.compression != "none" else "")
          + ("; activation checkpointing" if args.recompute else "") + "; GB = 10^9 bytes")
    for p in plans:
        print(f"{p.strategy}: {p.total_bytes / GB:.1f} GB per GPU")
    print()
    print("| strategy | params GB | grads GB | optimizer GB | activations GB | gathered GB | total GB | fits "
          f"{gpu.memory_bytes / GB:g} GB | compute ms | comm ms | hidden ms | exposed ms | step ms | samples/s "
          "| scaling eff. | what moves |")
    print("|---|" + "---:|" * 14 + "---|")
    for p in plans:
        activations, gathered = ("n/a" if value is None else f"{value / GB:.1f}" for value in (p.activation_bytes, p.gathered_bytes))
        print(f"| {p.strategy} | {p.param_bytes / GB:.2f} | {p.grad_bytes / GB:.2f} | {p.optimizer_bytes / GB:.2f} "
              f"| {activations} | {gathered} | {p.total_bytes / GB:.1f} | {'yes' if p.fits else 'NO'} | {p.compute_s * 1e3:.1f} "
              f"| {p.communication_s * 1e3:.1f} | {p.hidden_s * 1e3:.1f} | {p.exposed_s * 1e3:.1f} "
              f"| {p.step_s * 1e3:.1f} | {p.samples_per_s:,.0f} | {p.scaling_efficiency:.0%} | {p.communication} |")
    if model.layers is None:
        print("Activations not counted: give --model, or --layers, --hidden and --heads.")
    if any(p.gathered_bytes is None for p in plans):
        print("Gathered parameters not counted (n/a): " + ("they need the blocks' sizes, which --model reads."
              if model.block_params is None else "common/lessons/zero.py's ZeRO-3 gathers module by module, not block by block."))


if __name__ == "__main__":
    main()
