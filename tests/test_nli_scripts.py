"""The BERT chapter's scripts, run as users run them, offline, on a tiny random BERT and 130 NLI pairs (each
script's own launch, at its page's process count, is in test_as_users_run.py).

The 90/10 split holds out 13 pairs, which divide by neither 2 nor 3 processes: every run must
report an accuracy over exactly 13 pairs.
"""
import runpy

import pytest
import torch
import torch.nn as nn
from conftest import EVAL_PAIRS, PYTHON, ROOT, assert_clear_error, assert_ran

from common.loss_in_forward import LossInForward

CH4 = ROOT / "src" / "ch4"
EXACT = f"over {EVAL_PAIRS} pairs"


def assert_ok(result):
    assert_ran(result, EXACT)


def test_minimal_prints_the_loss_every_10_steps(run_command, tiny_bert, nli_pairs):
    result = run_command(PYTHON, CH4 / "nli_dp_minimal.py", "--model", tiny_bert, "--dataset", nli_pairs,
                         "--max-steps", "20", "--batch-size", "8")
    assert_ok(result)
    assert "step 10: loss" in result.stdout and "step 20: loss" in result.stdout and "step 30" not in result.stdout


@pytest.mark.parametrize("script, lr, max_steps", [("nli_dp_minimal.py", "3e-05", "300"),
                                                   ("nli_ddp_minimal.py", "3e-05", "300"),
                                                   ("ddp.py", "5e-05", "every step of --epochs")])
def test_help_prints_the_defaults_the_script_trains_with(monkeypatch, capsys, script, lr, max_steps):
    """--help and the run take lr and --max-steps from one place (a set_defaults once left --help at 5e-05)."""
    monkeypatch.setattr("sys.argv", [script, "--help"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(CH4 / script), run_name="__main__")
    flat = " ".join(capsys.readouterr().out.split())
    assert f"learning rate (default: {lr})" in flat and f"optimizer steps (default: {max_steps})" in flat


def test_validation_matched_from_a_saved_dataset(run_command, tiny_bert, nli_pairs, tmp_path):
    from datasets import DatasetDict, load_dataset
    pairs = load_dataset("json", data_files=str(nli_pairs))["train"]
    DatasetDict(train=pairs.select(range(100)), validation_matched=pairs.select(range(100, 111))).save_to_disk(tmp_path / "mnli")
    result = run_command(PYTHON, CH4 / "data_parallel.py", "--model", tiny_bert, "--dataset", tmp_path / "mnli",
                         "--eval-split", "validation_matched", "--max-steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "over 11 pairs" in result.stdout


# ---- the data files users already have: official MultiNLI, GLUE's TSV, folders of files ----

HUB_IDS = {"entailment": 0, "neutral": 1, "contradiction": 2}  # nyu-mll/multi_nli's ClassLabel names, in order


def test_official_multinli_and_glue_files_load_as_they_come(tmp_path, capsys):
    """sentence1/sentence2/gold_label words become the hub's ids; '-' rows are dropped and counted;
    quotes and an 'NA' inside sentences survive the TSV; GLUE's unlabeled test_matched.tsv is no obstacle."""
    from nli_files import official_rows, write_glue_mnli, write_official_multinli

    from common.nli import load_pairs
    expected = [(row["sentence1"], row["sentence2"], HUB_IDS[row["gold_label"]])
                for row in official_rows(20, unlabeled=3, seed=1) if row["gold_label"] != "-"]
    for folder in (write_official_multinli(tmp_path / "multinli_1.0", 40, 20, unlabeled=3),
                   write_glue_mnli(tmp_path / "MNLI", 40, 20, unlabeled=3)):
        train, evaluation = load_pairs(str(folder), "validation_matched", None, None)
        assert [(row["premise"], row["hypothesis"], row["label"]) for row in evaluation] == expected
        assert len(train) == 37 and train.column_names == ["premise", "hypothesis", "label"]
        printed = capsys.readouterr().out
        assert "dropped 3 of 40 training pairs" in printed and "dropped 3 of 20 evaluation pairs" in printed
    train, evaluation = load_pairs(str(tmp_path / "multinli_1.0" / "multinli_1.0_train.jsonl"), "split", None, None)
    assert len(train) + len(evaluation) == 37  # one official file alone: the 10% split of its labeled rows


@pytest.mark.parametrize("suffix", ["jsonl", "csv", "parquet"])
def test_a_folder_of_files_named_after_their_splits(nli_pairs, tmp_path, suffix):
    from datasets import load_dataset

    from common.nli import load_pairs
    pairs = load_dataset("json", data_files=str(nli_pairs), split="train")
    write = {"jsonl": "to_json", "csv": "to_csv", "parquet": "to_parquet"}[suffix]
    getattr(pairs.select(range(100)), write)(str(tmp_path / f"train.{suffix}"))
    getattr(pairs.select(range(100, 111)), write)(str(tmp_path / f"validation_matched.{suffix}"))
    train, evaluation = load_pairs(str(tmp_path), "validation_matched", None, None)
    assert (len(train), len(evaluation)) == (100, 11)
    assert evaluation[0] == pairs[100]


def test_a_chapter_script_on_the_official_files(run_command, tiny_bert, tmp_path):
    from nli_files import write_official_multinli
    folder = write_official_multinli(tmp_path / "multinli_1.0", 40, 20, unlabeled=3)
    result = run_command(PYTHON, CH4 / "nli_dp_minimal.py", "--model", tiny_bert, "--dataset", folder,
                         "--eval-split", "validation_matched", "--max-steps", "2")
    assert_ran(result, "over 17 pairs", "dropped 3 of 20 evaluation pairs without a gold label")


@pytest.mark.parametrize("names, problem", [(["README.txt"], "is neither a save_to_disk folder nor holds data files"),
                                            (["train.jsonl", "pairs.jsonl"], "cannot tell the split of pairs.jsonl"),
                                            (["train.jsonl", "train.csv"], "several files hold the split train")])
def test_a_folder_the_scripts_cannot_read_is_one_sentence(nli_pairs, tmp_path, names, problem):
    from common.nli import load_pairs
    for name in names:
        (tmp_path / name).write_text(nli_pairs.read_text())
    with pytest.raises(SystemExit, match=problem):
        load_pairs(str(tmp_path), "split", None, None)


# ---- offline without local copies: one sentence saying what to pass ----

def test_default_model_offline(run_command, nli_pairs):
    result = run_command(PYTHON, CH4 / "data_parallel.py", "--dataset", nli_pairs)
    assert_clear_error(result, "could not load the model 'bert-base-cased'", "pass --model with a local folder")


def test_default_dataset_offline(run_command, tiny_bert):
    result = run_command(PYTHON, CH4 / "data_parallel.py", "--model", tiny_bert)
    assert_clear_error(result, "could not load the dataset 'nyu-mll/multi_nli'", "pass --dataset with a local")


def test_missing_local_file(run_command, tiny_bert, tmp_path):
    result = run_command(PYTHON, CH4 / "data_parallel.py", "--model", tiny_bert, "--dataset", tmp_path / "none.jsonl")
    assert_clear_error(result, "could not load the dataset")


# ---- the loss-in-forward helper ----

def test_loss_in_forward_equals_loss_outside():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    inputs, labels = torch.randn(10, 8), torch.randint(0, 3, (10,))
    outside = nn.functional.cross_entropy(model(inputs), labels)
    outside.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    wrapped = LossInForward(model, nn.CrossEntropyLoss())
    replicas = [wrapped(chunk, labels=chunk_labels) for chunk, chunk_labels in zip(inputs.split(5), labels.split(5))]
    assert all(loss.shape == (1,) for loss in replicas)  # what DataParallel gathers: one number per replica
    inside = torch.cat(replicas).mean()  # equal chunks: the mean of means is the batch mean
    inside.backward()
    torch.testing.assert_close(inside, outside)
    for got, want in zip([p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(wrapped(inputs), model(inputs))  # without labels: the model's output


def test_loss_in_forward_under_data_parallel(tiny_bert):
    """The same through nn.DataParallel and a real BERT output, as nli_loss_in_forward.py uses it."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert).eval()
    ids = torch.randint(5, 20, (4, 7))
    labels = torch.tensor([0, 1, 2, 1])
    outside = nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
    inside = nn.DataParallel(LossInForward(model, nn.CrossEntropyLoss()))(input_ids=ids, labels=labels).mean()
    torch.testing.assert_close(inside, outside)
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, outside)  # the HuggingFace route


def test_a_model_saved_in_bf16_trains_in_fp32(tiny_bert, tmp_path):
    """transformers 5 loads the dtype a folder was saved in unless told; the scripts' precision is autocast over
    fp32 weights, so a bf16 folder must come back fp32 (else --precision fp32 trains in pure bf16)."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    from common.nli import load_model_and_tokenizer
    shutil.copytree(tiny_bert, tmp_path / "bf16")
    AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=3).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    as_saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "bf16", num_labels=3)
    assert next(as_saved.parameters()).dtype == torch.bfloat16  # the control: the folder really is bf16
    model, _ = load_model_and_tokenizer(str(tmp_path / "bf16"))
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
