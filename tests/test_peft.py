"""A PEFT LoRA fine-tune on pjrt: the losses of CPU's run, and only the adapter weights move."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from accelerate.state import AcceleratorState  # noqa: E402
from support import fresh_accelerate_state  # noqa: E402, F401

VOCAB = 64
SEQUENCE = 8
STEPS = 3


@pytest.fixture(scope="module")
def base_model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def lora_model(base: Any) -> Any:
    """LoRA on the attention's q/v projections; no adapter dropout, so CPU and pjrt draw no random numbers."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(copy.deepcopy(base), config)


def fine_tune(base: Any, device: str) -> tuple[list[float], set[str], set[str]]:
    """Trains a few AdamW steps; returns the losses, the trainable names and the names whose values changed."""
    model = lora_model(base).to(device)
    before = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = torch.randint(0, VOCAB, (STEPS, 2, SEQUENCE), generator=torch.Generator().manual_seed(2))
    losses = []
    for ids in batches:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert {p.device.type for p in model.parameters()} == {torch.device(device).type}
    changed = {name for name, p in model.named_parameters() if not torch.equal(p.detach().cpu(), before[name])}
    return losses, trainable, changed


def test_lora_fine_tune_matches_cpu_and_moves_only_the_adapters(base_model: Any) -> None:
    cpu_losses, cpu_trainable, cpu_changed = fine_tune(base_model, "cpu")
    pjrt_losses, trainable, changed = fine_tune(base_model, "pjrt")
    assert trainable and all("lora_" in name for name in trainable)
    assert changed == trainable == cpu_trainable == cpu_changed
    torch.testing.assert_close(pjrt_losses, cpu_losses, rtol=1e-5, atol=1e-5)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        self.ids = torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def trainer_losses(base: Any, output_dir: Path, **arguments: Any) -> tuple[list[float], Any]:
    AcceleratorState._reset_state(reset_partial_state=True)
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2,
                                          learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                          seed=0, **arguments)
    trainer = transformers.Trainer(model=lora_model(base), args=args, train_dataset=TokenDataset(12))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer


def test_lora_through_trainer_matches_cpu(base_model: Any, tmp_path: Path) -> None:
    cpu_losses, _ = trainer_losses(base_model, tmp_path / "cpu", use_cpu=True)
    pjrt_losses, trainer = trainer_losses(base_model, tmp_path / "pjrt")
    assert {p.device.type for p in trainer.model.parameters()} == {"pjrt"}
    assert len(pjrt_losses) == STEPS
    torch.testing.assert_close(pjrt_losses, cpu_losses, rtol=1e-4, atol=1e-5)
