"""MultiNLI for the BERT chapter: model, tokenizer and premise/hypothesis pairs, from the hub or disk.

Defaults are the public ones (bert-base-cased, nyu-mll/multi_nli). Every input is also a local path,
and when one cannot be had the scripts stop with one sentence saying what to pass.

Accuracy: `evaluate.load("accuracy")` fetches a metric script from the hub, which fails offline.
Its definition is the fraction of predictions equal to the reference label (scikit-learn's
accuracy_score); the scripts compute exactly that from correct and seen counts summed over ranks, so
it works offline and stays exact under any world size.
"""
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from common.cli import positive_int, training_parser

LABELS = ("entailment", "neutral", "contradiction")
DEFAULT_MODEL = "bert-base-cased"
DEFAULT_DATASET = "nyu-mll/multi_nli"
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv"}


def nli_parser(doc: str, precision: bool = True):
    """The shared flags with this chapter's defaults (global batch 32, AdamW 5e-5), and the NLI ones."""
    parser = training_parser(doc, batch_size=32, eval_batch_size=64, lr=5e-5, precision=precision)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"hub name or local folder with config, weights and tokenizer (default: {DEFAULT_MODEL})")
    parser.add_argument("--dataset", default=DEFAULT_DATASET,
                        help="hub name, a .json/.jsonl/.csv file, or a folder from Dataset.save_to_disk, with "
                             f"premise, hypothesis and label columns (default: {DEFAULT_DATASET})")
    parser.add_argument("--eval-split", choices=["split", "validation_matched"], default="split",
                        help="split: hold out 10%% of train (train_test_split, seed 42); "
                             "validation_matched: the official matched validation set")
    parser.add_argument("--max-train-samples", type=positive_int, help="use only the first N training pairs")
    parser.add_argument("--max-eval-samples", type=positive_int, help="evaluate on the first N pairs only")
    parser.add_argument("--max-steps", type=positive_int, help="stop training after this many optimizer steps")
    parser.add_argument("--max-length", type=positive_int, default=128, help="truncate each pair to this many tokens")
    return parser


def load_model_and_tokenizer(name: str):
    """A sequence classifier with a fresh 3-label head, and its tokenizer."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=len(LABELS))
    except (OSError, ValueError) as error:  # not cached and no hub, or not a model folder
        sys.exit(f"error: could not load the model '{name}' ({str(error).strip().splitlines()[0]}); "
                 f"pass --model with a local folder that holds config.json, the weights and the tokenizer files.")
    return model, tokenizer


def _load_source(dataset: str):
    from datasets import load_dataset, load_from_disk
    path = Path(dataset)
    if path.is_dir():
        return load_from_disk(str(path))
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        return load_dataset(LOCAL_FORMATS[path.suffix], data_files={"train": str(path)})
    return load_dataset(dataset)


def load_pairs(dataset: str, eval_split: str, max_train: int | None, max_eval: int | None):
    """(train, eval) datasets of premise/hypothesis/label rows, labels in 0..2."""
    try:
        source = _load_source(dataset)
    except Exception as error:  # datasets raises several unrelated types when offline or misnamed
        sys.exit(f"error: could not load the dataset '{dataset}' ({type(error).__name__}: "
                 f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); pass --dataset with a "
                 f"local .json/.jsonl/.csv file or a save_to_disk folder of premise, hypothesis, label rows.")
    if eval_split == "split":
        parts = source["train"].train_test_split(test_size=0.1, seed=42)
        train, evaluation = parts["train"], parts["test"]
    elif "validation_matched" in source:
        train, evaluation = source["train"], source["validation_matched"]
    else:
        sys.exit(f"error: '{dataset}' has no validation_matched split (it has {', '.join(source)}); "
                 f"use --eval-split split.")
    missing = {"premise", "hypothesis", "label"} - set(train.column_names)
    if missing:
        sys.exit(f"error: '{dataset}' lacks the column(s) {', '.join(sorted(missing))}; "
                 "each row needs premise, hypothesis and label.")
    train, evaluation = (part.filter(lambda row: 0 <= row["label"] < len(LABELS)) for part in (train, evaluation))
    if max_train:
        train = train.select(range(min(max_train, len(train))))
    if max_eval:
        evaluation = evaluation.select(range(min(max_eval, len(evaluation))))
    return train, evaluation


def tokenize_pairs(dataset, tokenizer, max_length: int):
    """datasets.map tokenization, once up front; padding is left to the collator, per batch."""
    def encode(rows):
        return tokenizer(rows["premise"], rows["hypothesis"], truncation=True, max_length=max_length)
    encoded = dataset.map(encode, batched=True, remove_columns=["premise", "hypothesis"])
    return encoded.rename_column("label", "labels")  # lists of ids: the collator pads them into tensors


def make_loader(dataset, tokenizer, batch_size: int, sampler, generator=None) -> DataLoader:
    """Batches padded to their own longest pair (DataCollatorWithPadding), not to max_length.
    generator: see common.mnist.make_loader."""
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=DataCollatorWithPadding(tokenizer),
                      generator=generator)


class PairCollator:
    """For the minimal scripts: tokenize raw premise/hypothesis pairs batch by batch, in the loader."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, rows):
        batch = self.tokenizer([r["premise"] for r in rows], [r["hypothesis"] for r in rows], padding=True,
                               truncation=True, max_length=self.max_length, return_tensors="pt")
        batch["labels"] = torch.tensor([r["label"] for r in rows])
        return batch


def to_device(batch, device: torch.device) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
