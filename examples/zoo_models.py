"""Your own models in `torch-pjrt zoo`: each factory takes no arguments and returns (model, inputs).

    torch-pjrt zoo --model examples/zoo_models.py           # every factory in ZOO_MODELS
    torch-pjrt zoo --model examples/zoo_models.py:convnet   # one factory

inputs is a dict of keyword arguments (or a tuple of positional ones) for model(...). The zoo builds
the model on CPU, copies it to pjrt, and compares the outputs, the loss (the output's `.loss` if it
has one, else the mean square of the first float output), every gradient and the loss after one SGD
step.
"""

import torch
from torch import nn


def mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    return model, (torch.randn(8, 16),)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


def convnet() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return ConvNet(), {"images": torch.randn(4, 3, 16, 16)}


ZOO_MODELS = {"mlp": mlp, "convnet": convnet}
