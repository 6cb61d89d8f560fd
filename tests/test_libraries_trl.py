"""TRL's SFTTrainer on pjrt: a tiny Llama fine-tuned on pjrt with the losses of the same run on CPU.

Runs in .venv-libs (`make test-libs`); skipped where trl is not installed. The tokenizer is a word-level one built
in memory and the model comes from a config: nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

trl = pytest.importorskip("trl")

import datasets  # noqa: E402
import transformers  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

VOCAB = 64
STEPS = 3


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")


def texts() -> datasets.Dataset:
    rng = random.Random(1)
    lines = [" ".join(f"w{rng.randrange(VOCAB - 3)}" for _ in range(rng.randrange(4, 12))) for _ in range(12)]
    return datasets.Dataset.from_dict({"text": lines})


def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, eos_token_id=1)
    return transformers.LlamaForCausalLM(config)


def fine_tune(output_dir: Path, use_cpu: bool, bf16: bool) -> tuple[list[float], set[str]]:
    AcceleratorState._reset_state(reset_partial_state=True)
    # Batches padded to 16 tokens: one shape, so pjrt compiles each program once rather than per length.
    args = trl.SFTConfig(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2, optim="sgd",
                         learning_rate=0.5, pad_to_multiple_of=16, max_length=16, logging_steps=1, report_to=[],
                         save_strategy="no", seed=0, use_cpu=use_cpu, bf16=bf16)
    trainer = trl.SFTTrainer(model=tiny_llama(), args=args, train_dataset=texts(), processing_class=tokenizer())
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {p.device.type for p in trainer.model.parameters()}


# TRL turns bf16 autocast on by default (on pjrt as on CPU); float32 gives CPU's losses to rounding.
@pytest.mark.parametrize(("bf16", "rtol"), [(False, 1e-6), (True, 1e-4)], ids=["float32", "bf16-autocast"])
def test_sft_trainer_trains_on_pjrt_with_cpu_losses(tmp_path: Path, bf16: bool, rtol: float) -> None:
    expected, cpu_devices = fine_tune(tmp_path / "cpu", use_cpu=True, bf16=bf16)
    actual, devices = fine_tune(tmp_path / "pjrt", use_cpu=False, bf16=bf16)
    assert devices == {"pjrt"} and cpu_devices == {"cpu"}
    assert len(actual) == STEPS
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0)


def preferences() -> datasets.Dataset:
    """Prompts with a chosen and a rejected continuation, drawn from the tiny vocabulary."""
    rng = random.Random(2)

    def words(low: int, high: int) -> str:
        return " ".join(f"w{rng.randrange(VOCAB - 3)}" for _ in range(rng.randrange(low, high)))

    # Continuations start with a space: TRL joins prompt and continuation as text.
    rows = [(words(3, 6), " " + words(2, 5), " " + words(2, 5)) for _ in range(8)]
    return datasets.Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                                       "rejected": [r[2] for r in rows]})


def train_dpo(output_dir: Path, use_cpu: bool) -> tuple[list[dict[str, float]], set[str]]:
    AcceleratorState._reset_state(reset_partial_state=True)
    args = trl.DPOConfig(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2, optim="sgd",
                         learning_rate=0.5, max_length=16, pad_to_multiple_of=16, logging_steps=1, report_to=[],
                         save_strategy="no", seed=0, use_cpu=use_cpu, bf16=False)
    # The frozen reference is a second copy of the seeded policy (without one, TRL loads the policy's hub id).
    trainer = trl.DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=args, train_dataset=preferences(),
                             processing_class=tokenizer())
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, {p.device.type for p in trainer.model.parameters()}


def test_dpo_trainer_trains_on_pjrt_with_cpu_losses(tmp_path: Path) -> None:
    expected, _ = train_dpo(tmp_path / "cpu", use_cpu=True)
    actual, devices = train_dpo(tmp_path / "pjrt", use_cpu=False)
    assert devices == {"pjrt"} and len(actual) == STEPS
    for logged in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        torch.testing.assert_close([e[logged] for e in actual], [e[logged] for e in expected], rtol=1e-5, atol=1e-6)
    # The first step's loss is DPO's log(2) (policy equal to its reference); later steps moved away from it.
    assert abs(actual[0]["loss"] - 0.6931472) < 1e-5 and actual[-1]["loss"] != actual[0]["loss"]


def low_word_share(completions: list[str], **_: Any) -> list[float]:
    """GRPO's reward: the share of a completion's words from the lower half of the vocabulary."""
    counts = [[int(w[1:]) < VOCAB // 2 for w in text.split() if w[1:].isdigit()] for text in completions]
    return [sum(c) / len(c) if c else 0.0 for c in counts]


def sample_from_cpu_stream(seed: int) -> Any:
    """torch.multinomial drawing from one seeded CPU generator whatever the device of the probabilities."""
    generator, original = torch.Generator().manual_seed(seed), torch.multinomial

    def multinomial(probs: torch.Tensor, num_samples: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        drawn = original(probs.cpu(), num_samples, *args, generator=generator, **kwargs)
        return drawn.to(probs.device)

    return multinomial


def train_grpo(output_dir: Path, use_cpu: bool) -> tuple[list[dict[str, float]], list[torch.Tensor], set[str]]:
    AcceleratorState._reset_state(reset_partial_state=True)
    args = trl.GRPOConfig(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=6, temperature=1.0, optim="sgd", learning_rate=0.5,
                          logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=use_cpu, bf16=False)
    prompts = datasets.Dataset.from_dict({"prompt": list(preferences()["prompt"])})
    trainer = trl.GRPOTrainer(model=tiny_llama(), reward_funcs=low_word_share, args=args, train_dataset=prompts,
                              processing_class=tokenizer())
    # Sampling inside generate() draws from one CPU stream on both devices: pjrt's generator is another stream.
    with mock.patch.object(torch, "multinomial", sample_from_cpu_stream(3)):
        trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    weights = [p.detach().cpu() for p in trainer.model.parameters()]
    return logs, weights, {p.device.type for p in trainer.model.parameters()}


def test_grpo_trainer_generates_and_trains_on_pjrt_with_cpu_losses(tmp_path: Path) -> None:
    expected, expected_weights, _ = train_grpo(tmp_path / "cpu", use_cpu=True)
    actual, weights, devices = train_grpo(tmp_path / "pjrt", use_cpu=False)
    assert devices == {"pjrt"} and len(actual) == STEPS
    for logged in ("loss", "reward", "reward_std", "completions/mean_length", "entropy"):
        torch.testing.assert_close([e[logged] for e in actual], [e[logged] for e in expected], rtol=1e-5, atol=1e-6)
    # The completions differ within groups (rewards spread) and training moved the weights, equally on both.
    assert any(e["reward_std"] > 0 for e in actual)
    for trained, reference in zip(weights, expected_weights):
        torch.testing.assert_close(trained, reference, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(t, i.detach()) for t, i in zip(weights, tiny_llama().parameters()))
