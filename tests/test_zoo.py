"""`torch-pjrt zoo`: a fixed slice of shrunk Hugging Face architectures matches CPU (forward and a
training step); user factories run through worker processes, a crashing model costs only its row;
filters select by family, task and name; the report is written."""

from __future__ import annotations

import json
import os

import pytest

from torch_pjrt.cli import zoo
from torch_pjrt.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_MODELS = os.path.join(ROOT, "examples", "zoo_models.py")
CRASHING_MODELS = os.path.join(ROOT, "tests", "fixtures", "zoo", "crashing_models.py")
SLICE = {"llama/causal-lm", "gpt2/causal-lm", "bert/masked-lm", "t5/seq2seq-lm"}


def test_fixed_slice_matches_cpu() -> None:
    cases = [c for c in zoo.select_cases(["causal-lm", "masked-lm", "seq2seq-lm"], ["llama", "gpt2", "bert", "t5"])
             if c.key in SLICE]
    assert {c.key for c in cases} == SLICE
    rows = zoo.run_cases(cases, isolate=False)
    for row in rows:
        assert row["status"] == "match", row
        assert row["forward_max_diff"] <= 1e-4 and row["training_max_diff"] <= 1e-3
    # gpt2, bert and t5 tie their embeddings to the output layer; model.to("pjrt") unties them
    assert {r["key"] for r in rows if r.get("untied_by_to")} >= {"gpt2/causal-lm", "t5/seq2seq-lm"}


def test_user_factories_in_workers_and_a_crash_is_one_row(tmp_path: pytest.TempPathFactory) -> None:
    out = tmp_path / "zoo.json"
    report = tmp_path / "zoo.md"
    status = main(["zoo", "--model", USER_MODELS, "--model", CRASHING_MODELS, "--jobs", "1", "--timeout", "120",
                   "--json", str(out), "--report", str(report)])
    rows = {row["key"].rsplit(":", 1)[1]: row for row in json.loads(out.read_text())["rows"]}
    assert status == 1  # the crash is an error
    assert rows["mlp"]["status"] == rows["convnet"]["status"] == rows["linear"]["status"] == "match", rows
    assert rows["crashes"]["status"] == "error" and "died" in rows["crashes"]["detail"]
    text = report.read_text()
    assert "| error | 1 |" in text and "| match | 3 |" in text


def test_filters_select_by_family_task_and_name(capsys: pytest.CaptureFixture) -> None:
    keys = {c.key for c in zoo.select_cases(["causal-lm", "sequence-classification"], ["llama", "gpt2"], name="^gpt2/")}
    assert keys == {"gpt2/causal-lm", "gpt2/sequence-classification"}
    assert main(["zoo", "--list", "--family", "mistral", "--task", "causal-lm,token-classification"]) == 0
    assert capsys.readouterr().out.split() == ["mistral/causal-lm", "MistralForCausalLM",
                                               "mistral/token-classification", "MistralForTokenClassification"]
    assert main(["zoo", "--task", "no-such-task"]) == 2
