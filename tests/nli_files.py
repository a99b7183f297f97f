"""A tiny random BERT and a few NLI pairs, written by the tests: no hub, no real model needed."""
import json
import random
from pathlib import Path

WORDS = ("a man woman child dog cat plays sleeps runs eats walks sits in on the park house street food "
         "ball is not happy sad outside inside").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_tiny_bert(folder: Path) -> Path:
    """A 2-layer BERT (hidden 32) with a 3-label head, and a WordPiece tokenizer saved as tokenizer.json.

    The tokenizer is built with the tokenizers library and saved whole: in transformers 5,
    BertTokenizerFast(vocab_file=...) silently ignores the file and builds a 5-token vocabulary.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL + list(WORDS))}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    assert len(tokenizer) == len(vocab), f"tokenizer has {len(tokenizer)} tokens, expected {len(vocab)}"
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=3)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_nli_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """count rows of JSON lines with premise, hypothesis and label (0, 1 or 2)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            premise = " ".join(rng.choices(WORDS, k=rng.randint(4, 12)))
            hypothesis = " ".join(rng.choices(WORDS, k=rng.randint(3, 8)))
            out.write(json.dumps({"premise": premise, "hypothesis": hypothesis, "label": rng.randrange(3)}) + "\n")
    return path
