"""A tiny random BERT and a few NLI pairs, written by the tests: no hub, no real model needed."""
import json
import random
from pathlib import Path

import torch

WORDS = ("a man woman child dog cat plays sleeps runs eats walks sits in on the park house street food "
         "ball is not happy sad outside inside").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_tiny_bert(folder: Path) -> Path:
    """A 2-layer BERT (hidden 32) with a 3-label head, and a WordPiece tokenizer saved as tokenizer.json.

    The tokenizer is built with the tokenizers library and saved whole: in transformers 5,
    BertTokenizerFast(vocab_file=...) silently ignores the file and builds a 5-token vocabulary. The
    weights are drawn from seed 0: a test that compares the predictions of two correct ways of computing
    them (tests/test_nli_trainer.py) needs logits that no rounding can reorder, and so the same draw.
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
    with torch.random.fork_rng():  # the same weights in every session, whatever ran before in this worker
        torch.manual_seed(0)
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


def official_rows(count: int, unlabeled: int, seed: int = 0) -> list[dict]:
    """Rows as MultiNLI's own files hold them: sentence1, sentence2, gold_label a word, '-' for no consensus
    (the last `unlabeled` rows), parses and ids beside them. Sentences carry a quote and an 'NA' word,
    which a careless TSV reader turns into a quoted field or a missing value."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        words = rng.choices(WORDS, k=rng.randint(4, 12))
        premise = " ".join(['"' + words[0]] + words[1:] + ["NA"])
        hypothesis = " ".join(rng.choices(WORDS, k=rng.randint(3, 8)))
        gold = "-" if index >= count - unlabeled else rng.choice(["entailment", "neutral", "contradiction"])
        rows.append({"annotator_labels": [gold], "genre": "fiction", "gold_label": gold, "pairID": f"{index}e",
                     "promptID": str(index), "sentence1": premise, "sentence1_binary_parse": f"( {premise} )",
                     "sentence1_parse": f"(ROOT {premise})", "sentence2": hypothesis,
                     "sentence2_binary_parse": f"( {hypothesis} )", "sentence2_parse": f"(ROOT {hypothesis})"})
    return rows


def write_official_multinli(folder: Path, train: int, dev: int, unlabeled: int) -> Path:
    """multinli_1.0_{train,dev_matched,dev_mismatched}.jsonl, as in the official zip (its .txt copies and
    README.txt beside them, which are not data files of any format the scripts read)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", train, 0), ("dev_matched", dev, 1), ("dev_mismatched", dev, 2)):
        with (folder / f"multinli_1.0_{split}.jsonl").open("w") as out:
            for row in official_rows(count, unlabeled, seed):
                out.write(json.dumps(row) + "\n")
        (folder / f"multinli_1.0_{split}.txt").write_text("gold_label\tsentence1\tsentence2\n")
    (folder / "README.txt").write_text("MultiNLI 1.0\n")
    return folder


GLUE_COLUMNS = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]


def write_glue_mnli(folder: Path, train: int, dev: int, unlabeled: int) -> Path:
    """GLUE's MNLI folder: train.tsv (label1, gold_label), dev_matched.tsv (label1..label5, gold_label) and
    test_matched.tsv (no labels): tab-separated, quotes inside sentences left as they are."""
    folder.mkdir(parents=True, exist_ok=True)
    layouts = (("train", train, 0, ["label1", "gold_label"]),
               ("dev_matched", dev, 1, [f"label{n}" for n in range(1, 6)] + ["gold_label"]),
               ("test_matched", dev, 2, []))
    for split, count, seed, labels in layouts:
        lines = ["\t".join(GLUE_COLUMNS + labels)]
        for index, row in enumerate(official_rows(count, unlabeled, seed)):
            values = [str(index)] + [row[column] for column in GLUE_COLUMNS[1:]] + [row["gold_label"]] * len(labels)
            lines.append("\t".join(values))
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return folder
