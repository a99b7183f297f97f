"""MultiNLI for the BERT chapter: model, tokenizer and premise/hypothesis pairs, from the hub or disk.

Defaults are the public ones (bert-base-cased, nyu-mll/multi_nli). Every input is also a local path,
and when one cannot be had the scripts stop with one sentence saying what to pass.

Accuracy: `evaluate.load("accuracy")` fetches a metric script from the hub, which fails offline.
Its definition is the fraction of predictions equal to the reference label (scikit-learn's
accuracy_score); the scripts compute exactly that from correct and seen counts summed over ranks, so
it works offline and stays exact under any world size.
"""
import re
import sys
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from common.distributed import pin_memory, print0

LABELS = ("entailment", "neutral", "contradiction")
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
SPLIT_WORDS = {"train": "train", "training": "train", "dev": "validation", "validation": "validation",
               "valid": "validation", "val": "validation", "test": "test", "testing": "test"}
# a split word at the start of the name or after a separator, then whatever follows: "_matched"
SPLIT_IN_NAME = re.compile(rf"(?:^|[-_. ])({'|'.join(SPLIT_WORDS)})((?:[-_][a-z]+)*)$")


# transformers 4.56 renamed torch_dtype to dtype; since 5, leaving it out loads the dtype the folder was saved in
DTYPE_ARGUMENT = "dtype" if tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2]) >= (4, 56) else "torch_dtype"


def load_model_and_tokenizer(name: str):
    """A sequence classifier with a fresh 3-label head, and its tokenizer. The weights are loaded in fp32
    whatever the folder was saved in: the precision is --precision's (autocast), never the checkpoint's."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=len(LABELS),
                                                                   **{DTYPE_ARGUMENT: torch.float32})
    except (OSError, ValueError) as error:  # not cached and no hub, or not a model folder
        sys.exit(f"error: could not load the model '{name}' ({str(error).strip().splitlines()[0]}); "
                 f"pass --model with a local folder that holds config.json, the weights and the tokenizer files.")
    return model, tokenizer


def _split_name(file: Path) -> str | None:
    """The split a data file holds, read from its name as datasets.load_dataset does for a folder:
    multinli_1.0_dev_matched.jsonl and dev_matched.tsv hold validation_matched, train.csv holds train."""
    found = SPLIT_IN_NAME.search(file.stem.lower())
    return found and SPLIT_WORDS[found.group(1)] + found.group(2).replace("-", "_")  # dev-matched: validation_matched


def _load_file(file: Path, split: str = "train"):
    """One local file as a Dataset; TSV is GLUE's MNLI layout: tabs, quote characters inside sentences."""
    from datasets import load_dataset
    options = {"sep": "\t", "quoting": 3, "keep_default_na": False} if file.suffix == ".tsv" else {}  # 3: QUOTE_NONE
    return load_dataset(LOCAL_FORMATS[file.suffix], data_files={split: str(file)}, split=split, **options)


def _load_folder(folder: Path):
    """A save_to_disk folder, or a folder of data files whose names say their split."""
    from datasets import DatasetDict, load_from_disk
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return load_from_disk(str(folder))
    files = sorted(f for f in folder.iterdir() if f.suffix in LOCAL_FORMATS and f.is_file())
    if not files:
        sys.exit(f"error: the folder '{folder}' is neither a save_to_disk folder nor holds data files "
                 f"({'/'.join(LOCAL_FORMATS)}); pass --dataset with a folder holding e.g. train.jsonl and "
                 "validation_matched.jsonl, or a single file.")
    splits = {file: _split_name(file) for file in files}
    if not any(splits.values()):  # no name says a split: all of it is training data, as in datasets
        splits = dict.fromkeys(files, "train")
    unnamed = [file.name for file, split in splits.items() if split is None]
    twice = sorted({split for split in splits.values() if list(splits.values()).count(split) > 1})
    if unnamed or twice:
        problem = (f"cannot tell the split of {', '.join(unnamed)}" if unnamed
                   else f"several files hold the split {', '.join(twice)}")
        sys.exit(f"error: in '{folder}' {problem}; name each file after its split (train.jsonl, "
                 "validation_matched.jsonl, multinli_1.0_dev_matched.jsonl, dev_matched.tsv), one file per split.")
    return DatasetDict({split: _load_file(file, split) for file, split in splits.items()})


def _load_source(dataset: str):
    from datasets import DatasetDict, load_dataset
    path = Path(dataset)
    if path.is_dir():
        return _load_folder(path)
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        return DatasetDict(train=_load_file(path))
    return load_dataset(dataset)


def _as_pairs(split):
    """premise, hypothesis and label 0..2 (-1: no label), from the hub's columns or the official files'.

    MultiNLI's own jsonl and GLUE's TSV name them sentence1, sentence2 and gold_label, a word, with '-'
    where the annotators did not agree; the words map to the hub's ids (entailment 0, neutral 1,
    contradiction 2).
    """
    if "gold_label" not in split.column_names or "label" in split.column_names:
        return split

    def convert(rows):
        return {"premise": rows["sentence1"], "hypothesis": rows["sentence2"],
                "label": [LABELS.index(word) if word in LABELS else -1 for word in rows["gold_label"]]}
    return split.map(convert, batched=True, remove_columns=split.column_names)


def _labeled(split, name: str):
    """The rows with a label 0..2, saying how many it dropped ('-' in the official files)."""
    kept = split.filter(lambda row: 0 <= row["label"] < len(LABELS))
    if len(kept) < len(split):
        print0(f"dropped {len(split) - len(kept)} of {len(split)} {name} pairs without a gold label")
    return kept


def load_pairs(dataset: str, eval_split: str, max_train: int | None, max_eval: int | None):
    """(train, eval) datasets of premise/hypothesis/label rows, labels in 0..2."""
    try:
        source = _load_source(dataset)
    except Exception as error:  # datasets raises several unrelated types when offline or misnamed
        sys.exit(f"error: could not load the dataset '{dataset}' ({type(error).__name__}: "
                 f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); pass --dataset with a "
                 f"local file, a folder of files or a save_to_disk folder of premise, hypothesis, label rows.")
    if "train" not in source:
        sys.exit(f"error: '{dataset}' has no train split (it has {', '.join(source)}); name the training file "
                 "train.jsonl (or .csv, .tsv, .parquet).")
    if eval_split == "split":
        parts = _as_pairs(source["train"]).train_test_split(test_size=0.1, seed=42)
        train, evaluation = parts["train"], parts["test"]
    elif "validation_matched" in source:
        train, evaluation = _as_pairs(source["train"]), _as_pairs(source["validation_matched"])
    else:
        sys.exit(f"error: '{dataset}' has no validation_matched split (it has {', '.join(source)}); "
                 f"use --eval-split split.")
    missing = {"premise", "hypothesis", "label"} - set(train.column_names)
    if missing:
        sys.exit(f"error: '{dataset}' lacks the column(s) {', '.join(sorted(missing))}; each row needs premise, "
                 "hypothesis and label (or MultiNLI's own sentence1, sentence2 and gold_label).")
    train, evaluation = _labeled(train, "training"), _labeled(evaluation, "evaluation")
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


def nli_loader(dataset, tokenizer, batch_size: int, sampler, generator=None) -> DataLoader:
    """Batches padded to their own longest pair (DataCollatorWithPadding), not to max_length.
    generator: see common.mnist.mnist_loader."""
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=DataCollatorWithPadding(tokenizer),
                      generator=generator, pin_memory=pin_memory())


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
