"""TRL's SFTTrainer on pjrt: a tiny Llama fine-tuned on pjrt with the losses of the same run on CPU.

Runs in .venv-libs (`make test-libs`); skipped where trl is not installed. The tokenizer is a word-level one built
in memory and the model comes from a config: nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

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
