"""`torch-pjrt zoo`: a fixed slice of shrunk Hugging Face architectures matches CPU (forward and a
training step); user factories run and are reported; a model that kills its worker process costs only
its row; filters select by family, task and name."""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch

from torch_pjrt.cli import zoo
from torch_pjrt.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_MODELS = os.path.join(ROOT, "examples", "zoo_models.py")
CRASHING_MODELS = os.path.join(ROOT, "tests", "fixtures", "zoo", "crashing_models.py")
SLICE = {"llama/causal-lm", "gpt2/causal-lm", "bert/masked-lm", "vit/image-classification"}


def test_fixed_slice_matches_cpu() -> None:
    cases = [c for c in zoo.select_cases(["causal-lm", "masked-lm", "image-classification"],
                                         ["llama", "gpt2", "bert", "vit"]) if c.key in SLICE]
    assert {c.key for c in cases} == SLICE
    rows = zoo.run_cases(cases, isolate=False)
    for row in rows:
        assert row["status"] == "match", row
        assert row["forward_max_diff"] <= 1e-4 and row["training_max_diff"] <= 1e-3


def test_user_factories_and_the_report(tmp_path: pytest.TempPathFactory) -> None:
    out, report = tmp_path / "zoo.json", tmp_path / "zoo.md"
    assert main(["zoo", "--model", USER_MODELS, "--in-process", "--json", str(out), "--report", str(report)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["key"].rsplit(":", 1)[1], row["status"]) for row in rows] == [("mlp", "match"), ("convnet", "match")]
    assert "| match | 2 |" in report.read_text()


def test_a_crashing_model_costs_only_its_row() -> None:
    cases = zoo.select_cases(user_models=[CRASHING_MODELS])
    crashed, after = zoo.run_cases(cases, jobs=1, timeout=120)
    assert crashed["status"] == "error" and "died (signal 9)" in crashed["detail"], crashed
    assert after["status"] == "match", after


def test_filters_select_by_family_task_and_name(capsys: pytest.CaptureFixture) -> None:
    keys = {c.key for c in zoo.select_cases(["causal-lm", "sequence-classification"], ["llama", "gpt2"], name="^gpt2/")}
    assert keys == {"gpt2/causal-lm", "gpt2/sequence-classification"}
    assert main(["zoo", "--list", "--family", "mistral", "--task", "causal-lm,token-classification"]) == 0
    assert capsys.readouterr().out.split() == ["mistral/causal-lm", "MistralForCausalLM",
                                               "mistral/token-classification", "MistralForTokenClassification"]
    assert main(["zoo", "--task", "no-such-task"]) == 2


def test_constant_matrices_get_random_values() -> None:
    """A zero router gate would tie every expert (topk's choice among ties is unspecified); vectors stay as built."""
    import torch

    from torch_pjrt.cli import zoo_catalog

    router = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(router.weight)
    torch.nn.init.zeros_(router.bias)
    norm = torch.nn.LayerNorm(8)
    model = torch.nn.Sequential(norm, router)
    assert zoo_catalog.randomize_constant_matrices(model, 0.02) == ["1.weight"]
    assert router.weight.std() > 0.005 and bool((router.bias == 0).all()) and bool((norm.weight == 1).all())


def test_outside_tolerance_judged_against_a_float64_run() -> None:
    """A value outside the fixed tolerance matches when pjrt's RMS error against float64 is within twice CPU
    float32's own; five times it is a mismatch; within tolerance the float64 run is never made."""
    import torch

    def step(values: torch.Tensor) -> zoo.Step:
        return zoo.Step({"logits": values[:4]}, values[0].float(), {"weight": values.float()}, values[1].float())

    exact = torch.randn(4000, dtype=torch.float64) * 1e4  # activations grown large: float32 rounding error ~1e-3
    cpu = step((exact + torch.randn_like(exact) * 0.1).float())
    reference = step(exact)
    close = step((exact + torch.randn_like(exact) * 0.1).float())
    verdict = zoo._judge(close, cpu, lambda: reference)
    assert verdict["status"] == "match" and verdict["float64_criterion"], verdict
    assert "rms error against float64 CPU" in verdict["detail"]
    far = step((exact + torch.randn_like(exact) * 0.5).float())
    verdict = zoo._judge(far, cpu, lambda: reference)
    assert verdict["status"] == "mismatch" and "(bound" in verdict["detail"], verdict

    def no_float64_run() -> zoo.Step:
        raise AssertionError("the float64 run is made only for a value outside the fixed tolerance")

    assert zoo._judge(cpu, cpu, no_float64_run) == {"status": "match", "detail": "", "forward_max_diff": 0.0,
                                                     "training_max_diff": 0.0, "loss": float(cpu.loss)}


def test_a_generator_among_the_inputs_gives_both_devices_the_same_noise() -> None:
    """A model that samples noise in its forward from a generator it is given (a consistency decoder) draws
    the same numbers on CPU and on pjrt: the zoo re-seeds the generator before every call."""

    class Noisy(torch.nn.Module):
        def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
            return x + torch.randn(x.shape, generator=generator).to(x.device)

    x, generator = torch.randn(4, 3), torch.Generator()
    on_cpu = zoo._call(Noisy(), {"x": x, "generator": generator})
    on_pjrt = zoo._call(Noisy(), {"x": x.to("pjrt"), "generator": generator})
    torch.testing.assert_close(on_pjrt.cpu(), on_cpu)
    assert not torch.equal(on_cpu, x)


def test_a_rerun_merges_into_a_saved_record(tmp_path: pytest.TempPathFactory) -> None:
    """`--merge`: the re-run models' rows replace theirs in the saved record, the others stay, and the report's
    header keeps the first run's command and names the re-run."""
    saved, merged, report = tmp_path / "saved.json", tmp_path / "merged.json", tmp_path / "merged.md"
    first_rows = [{"key": key, "family": "custom", "task": "custom", "model_class": key, "status": status,
                   "detail": detail} for key, status, detail in [(f"{USER_MODELS}:mlp", "error", "forward: boom"),
                                                                  ("other", "skipped", "its own reason")]]
    saved.write_text(json.dumps({"command": "torch-pjrt zoo --first", "library": "transformers", "mode": "strict",
                                 "date": "2026-12-01", "seconds": 60.0, "versions": {}, "rows": first_rows}))
    assert main(["zoo", "--model", f"{USER_MODELS}", "--name", "mlp", "--in-process", "--merge", str(saved),
                 "--json", str(merged), "--report", str(report)]) == 0
    record = json.loads(merged.read_text())
    assert [(row["key"], row["status"]) for row in record["rows"]] == [(f"{USER_MODELS}:mlp", "match"),
                                                                        ("other", "skipped")]
    assert record["summary"]["match"] == 1 and record["summary"]["skipped"] == 1 and record["summary"]["error"] == 0
    text = report.read_text()
    assert "Generated by `torch-pjrt zoo --first`" in text
    today = datetime.date.today().isoformat()
    assert f"Rows replaced by a later run: on {today}, the 1 rows of `torch-pjrt zoo --name mlp" in text
