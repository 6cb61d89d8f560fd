"""accelerate and transformers' Trainer pick pjrt as the accelerator and train there as on CPU."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from support import fresh_accelerate_state  # noqa: E402, F401

STEPS = 3
SEQUENCE = 8
VOCAB = 64


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      **overrides)
    return transformers.LlamaForCausalLM(config)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (count, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class RecordingTrainer(transformers.Trainer):
    """Records where the parameters live at each loss and whether pjrt autocast is on inside the forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parameter_devices: set[str] = set()
        self.pjrt_autocast: set[bool] = set()
        self.model.get_input_embeddings().register_forward_pre_hook(
            lambda module, inputs: self.pjrt_autocast.add(torch.is_autocast_enabled("pjrt")))

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.parameter_devices.update(p.device.type for p in model.parameters())
        return super().compute_loss(model, inputs, *args, **kwargs)


def trainer_for(model: Any, output_dir: Path, **arguments: Any) -> RecordingTrainer:
    AcceleratorState._reset_state(reset_partial_state=True)
    options = {"max_steps": STEPS, "per_device_train_batch_size": 2, "learning_rate": 1e-2, "logging_steps": 1,
               "report_to": [], "save_strategy": "no", "seed": 0, **arguments}
    args = transformers.TrainingArguments(output_dir=str(output_dir), **options)
    return RecordingTrainer(model=model, args=args, train_dataset=TokenDataset(12))


def logged_losses(trainer: RecordingTrainer, after_step: int = 0) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and entry["step"] > after_step]


def train(model: Any, output_dir: Path, **arguments: Any) -> tuple[list[float], RecordingTrainer]:
    trainer = trainer_for(model, output_dir, **arguments)
    trainer.train()
    losses = logged_losses(trainer)
    assert len(losses) == STEPS
    return losses, trainer


def test_accelerate_and_trainer_pick_pjrt(tmp_path: Path) -> None:
    assert transformers.TrainingArguments(str(tmp_path), report_to=[]).device.type == "pjrt"
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator()
    assert accelerator.device.type == "pjrt"
    assert accelerator.distributed_type == DistributedType.NO
    assert PartialState().device.type == "pjrt"
    model, optimizer = accelerator.prepare(torch.nn.Linear(4, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    assert model.weight.device.type == "pjrt"


def test_opt_outs_keep_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Accelerator(cpu=True).device.type == "cpu"
    AcceleratorState._reset_state(reset_partial_state=True)
    assert transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True).device.type == "cpu"
    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.setenv("TORCH_PJRT_ACCELERATE", "0")
    assert PartialState().device.type == "cpu"


def test_trainer_losses_match_cpu(tmp_path: Path) -> None:
    model = tiny_llama()
    cpu_losses, _ = train(copy.deepcopy(model), tmp_path / "cpu", use_cpu=True)
    pjrt_losses, trainer = train(model, tmp_path / "pjrt")
    assert trainer.parameter_devices == {"pjrt"}
    assert next(trainer.model.parameters()).device.type == "pjrt"
    # Trainer's default optimizer, the fused AdamW (aten::_fused_adamw_), steps on pjrt
    assert trainer.args.optim == transformers.training_args.OptimizerNames.ADAMW_TORCH_FUSED
    assert trainer.optimizer.optimizer.defaults["fused"] is True
    torch.testing.assert_close(pjrt_losses, cpu_losses, rtol=1e-4, atol=1e-5)


def test_trainer_bf16_accumulation_and_clipping_match_cpu(tmp_path: Path) -> None:
    model = tiny_llama()
    options = {"bf16": True, "gradient_accumulation_steps": 2, "max_grad_norm": 0.5}
    cpu_losses, _ = train(copy.deepcopy(model), tmp_path / "cpu", use_cpu=True, **options)
    pjrt_losses, trainer = train(model, tmp_path / "pjrt", **options)
    assert trainer.pjrt_autocast == {True}
    assert trainer.accelerator.native_amp and trainer.accelerator.mixed_precision == "bf16"
    # Both runs autocast to bfloat16, CPU's policy and ours differ in a few ops' cast rules.
    torch.testing.assert_close(pjrt_losses, cpu_losses, rtol=3e-2, atol=3e-2)


def test_trainer_fp16_matches_cpu_float32(tmp_path: Path) -> None:
    """fp16=True: float16 autocast and a GradScaler on pjrt; no step overflows here, so the losses stay fp32's."""
    model = tiny_llama()
    cpu_losses, _ = train(copy.deepcopy(model), tmp_path / "cpu", use_cpu=True)
    pjrt_losses, trainer = train(model, tmp_path / "pjrt", fp16=True)
    assert trainer.pjrt_autocast == {True} and trainer.parameter_devices == {"pjrt"}
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.scaler._device == "pjrt"
    assert trainer.accelerator.scaler.get_scale() == 2.0 ** 16
    # float16 rounding of the matmuls: measured 3e-4 from CPU's float32 losses.
    torch.testing.assert_close(pjrt_losses, cpu_losses, rtol=0, atol=3e-3)


FP16_STEPS = 5


def fp16_steps_on_cpu(model: Any, batches: list[torch.Tensor], scaler_options: dict[str, float]) -> tuple[list, list]:
    """What accelerate's fp16 path does on CUDA, written out for the CPU: float16 autocast and a CPU GradScaler."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **scaler_options)
    losses, scales = [], []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales


def test_accelerator_fp16_scales_unscales_and_skips_overflow_like_cpu() -> None:
    """Accelerator(mixed_precision="fp16") with a start scale that overflows float16: the same backoffs as CPU."""
    from accelerate.utils import GradScalerKwargs

    scaler_options = {"init_scale": 2.0 ** 32, "backoff_factor": 2.0 ** -8, "growth_interval": 2}
    model = tiny_llama()
    batches = list(torch.randint(0, VOCAB, (FP16_STEPS, 2, SEQUENCE), generator=torch.Generator().manual_seed(4)))
    cpu_losses, cpu_scales = fp16_steps_on_cpu(copy.deepcopy(model), batches, scaler_options)
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**scaler_options)])
    assert accelerator.native_amp and accelerator.scaler._device == "pjrt"
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses, scales = [], []
    for ids in batches:
        ids = ids.to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(accelerator.scaler.get_scale())
    assert scales == cpu_scales
    assert scales[0] < scaler_options["init_scale"]  # the first step overflowed and was skipped
    # CPU's float16 autocast policy and CUDA's (ours) differ in a few ops' cast rules: measured 3e-5 apart.
    torch.testing.assert_close(losses, cpu_losses, rtol=0, atol=1e-3)


def test_save_state_load_state_resumes_identically(tmp_path: Path) -> None:
    accelerator = Accelerator()
    model = tiny_llama(attention_dropout=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = [torch.randint(0, VOCAB, (2, SEQUENCE), device=accelerator.device) for _ in range(3)]

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    step(batches[0])
    step(batches[1])
    accelerator.save_state(str(tmp_path / "checkpoint"))
    assert (tmp_path / "checkpoint" / "pjrt_rng_state_0.pth").is_file()
    first = [step(batches[2]), step(batches[2])]
    accelerator.load_state(str(tmp_path / "checkpoint"))
    assert next(model.parameters()).device.type == "pjrt"
    resumed = [step(batches[2]), step(batches[2])]
    assert resumed == first


def test_trainer_resume_from_checkpoint_continues_the_losses(tmp_path: Path) -> None:
    model = tiny_llama(attention_dropout=0.5)
    straight, _ = train(copy.deepcopy(model), tmp_path / "straight")
    train(copy.deepcopy(model), tmp_path / "saved", save_strategy="steps", save_steps=1)
    checkpoint = tmp_path / "saved" / "checkpoint-1"
    assert (checkpoint / "pjrt_rng_state.pth").is_file()
    trainer = trainer_for(tiny_llama(seed=5, attention_dropout=0.5), tmp_path / "resumed")
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.parameter_devices == {"pjrt"}
    assert logged_losses(trainer, after_step=1) == straight[1:]


LAUNCHED = """
import json, sys, torch
from accelerate import Accelerator
accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(3, 4, generator=torch.Generator().manual_seed(accelerator.process_index + 1))
loss = model(x.to(accelerator.device)).square().sum()
accelerator.backward(loss)
optimizer.step()
gathered = accelerator.gather(model.module.weight.detach()[None])
if accelerator.is_main_process:
    json.dump({"device": str(accelerator.device), "type": str(accelerator.distributed_type),
               "backend": torch.distributed.get_backend(), "weights": gathered.cpu().tolist()},
              open(sys.argv[1], "w"))
"""


def test_two_process_launch_trains_ddp_on_the_pjrt_backend(tmp_path: Path) -> None:
    """`accelerate launch --num_processes 2`: DDP over the c10d backend "pjrt", the same step as on CPU."""
    import json
    import os
    import subprocess
    import sys

    script, result = tmp_path / "launched.py", tmp_path / "result.json"
    script.write_text(LAUNCHED)
    env = {**os.environ, "TORCH_PJRT_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(result)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(result.read_text())
    assert (found["device"], found["type"], found["backend"]) == ("pjrt:0", "DistributedType.MULTI_GPU", "pjrt")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(rank + 1)) for rank in range(2)]
    grads = [torch.autograd.grad(model(x).square().sum(), model.weight)[0] for x in inputs]
    expected = model.weight.detach() - 0.1 * (grads[0] + grads[1]) / 2  # DDP averages the ranks' gradients
    for weights in found["weights"]:
        torch.testing.assert_close(torch.tensor(weights), expected, atol=1e-6, rtol=1e-5)


def test_an_optimizer_built_before_prepare_steps_the_moved_parameters() -> None:
    """accelerate's usual order: optimizer on the CPU parameters, then prepare moves the model to pjrt."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    assert optimizer.optimizer.param_groups[0]["params"][0] is model.weight
    x = torch.randn(4, 3)
    accelerator.backward(model(x.to(accelerator.device)).square().sum())
    optimizer.step()
    expected = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).square().sum().backward()
    expected.step()
    torch.testing.assert_close(model.weight.detach().cpu(), reference.weight.detach())
