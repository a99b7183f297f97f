"""The sharded chapter's wrapping policy for any transformers model: fully_shard on each block, then on the root.

FSDP2's fully_shard and MixedPrecisionPolicy are torch's own: the scripts import them from torch.distributed.fsdp.
"""
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

BLOCK_LISTS = ("encoder.layer", "layers", "h", "decoder.layers")  # BERT; Llama, Mistral; GPT-2; BART's decoder


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a transformers model (BERT's encoder.layer, Llama's layers, GPT-2's h)."""
    base = getattr(model, "base_model", model)
    for path in BLOCK_LISTS:
        blocks = base
        for name in path.split("."):
            blocks = getattr(blocks, name, None)
        if isinstance(blocks, nn.ModuleList):
            return blocks
    raise ValueError(f"{type(model).__name__} has no list of blocks under any of the names this knows "
                     f"({', '.join(BLOCK_LISTS)}), so it cannot be sharded block by block")


def fully_shard_blocks(model: nn.Module, wrap: str = "blocks", **options) -> nn.Module:
    """fully_shard on each block, then on the model: one all-gather per block in the forward, freed after it.

    The root group holds whatever no block holds (the embeddings, the pooler or final norm, the head), and
    it is gathered whole for the whole step. wrap="blocks+embeddings" shards the input embedding and the
    output head as groups of their own too, so that neither stays gathered while the blocks run; a head
    tied to the embedding (one Parameter in both) cannot be split from it. options go to every
    fully_shard call (mesh, mp_policy, reshard_after_forward).
    """
    if wrap not in ("blocks", "blocks+embeddings"):
        raise ValueError(f"wrap must be blocks or blocks+embeddings, not {wrap!r}")
    blocks = transformer_blocks(model)
    ends = [model.get_input_embeddings(), model.get_output_embeddings()] if wrap == "blocks+embeddings" else []
    if len(ends) == 2 and ends[1] is not None and ends[1].weight is ends[0].weight:
        raise ValueError(f"{type(model).__name__} ties its output head to its input embedding (one weight), "
                         "so --wrap blocks+embeddings cannot shard them apart: use --wrap blocks")
    for module in [*blocks, *(end for end in ends if end is not None)]:
        fully_shard(module, **options)
    return fully_shard(model, **options)
