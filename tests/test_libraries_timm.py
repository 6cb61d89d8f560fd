"""timm on pjrt: PyPI's torchvision imports on the CPU torch, and a fixed slice of `torch-pjrt zoo --library timm`
(a convolutional, a transformer and a hybrid model, random weights) matches CPU in a forward and a training step.

Runs in .venv-libs (`make test-libs`); skipped where timm is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

timm = pytest.importorskip("timm")

import torchvision  # noqa: E402

from torch_pjrt.cli import zoo, zoo_catalog  # noqa: E402

SLICE = {"test_resnet": "resnet", "test_vit": "vision_transformer", "levit_128s": "levit"}


@pytest.mark.skipif(torchvision.extension._has_ops(), reason="this torchvision's C++ ops load: a matching build")
def test_torchvision_imports_without_its_cuda_extension() -> None:
    # Without torch_pjrt (device autoload off), PyPI's CUDA build of torchvision does not import on the CPU torch.
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    bare = subprocess.run([sys.executable, "-c", "import torch, torchvision"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert bare.returncode != 0 and "operator torchvision::nms does not exist" in bare.stderr
    # With it, torchvision's Python parts work and its C++ ops raise torchvision's own error.
    frozen = torchvision.ops.misc.FrozenBatchNorm2d(4)
    with torch.no_grad():
        frozen.weight.uniform_(0.5, 1.5), frozen.bias.normal_(), frozen.running_mean.normal_()
    images = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(frozen.to("pjrt")(images.to("pjrt")).cpu(), frozen.cpu()(images))
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(torch.rand(4, 4), torch.rand(4), 0.5)


def test_the_catalog_takes_each_modules_model_with_the_fewest_parameters() -> None:
    modules = ["levit", "dla", "mobilenetv3", "inception_v3"]
    cases = zoo.select_cases(library="timm", families=modules)
    assert [c.family for c in cases] == sorted(modules) and {c.library for c in cases} == {"timm"}
    for case in cases:
        names = timm.list_models(module=case.family)
        counts = {name: zoo_catalog.timm_parameter_count(name) for name in names}
        assert counts[case.key] == min(counts.values()), (case.key, counts)
    # the count is the built model's own
    model = timm.create_model("levit_128s", pretrained=False, num_classes=zoo_catalog.LABELS)
    assert zoo_catalog.timm_parameter_count("levit_128s") == sum(p.numel() for p in model.parameters())


def test_a_net_with_a_minimum_input_size_gets_it() -> None:
    # inception_v3's stem and reductions leave a 2x2 map at 64x64, under its 3x3 kernels; 96 is the first side that runs
    assert zoo_catalog.timm_smallest_side("inception_v3", 3, 64) == 96
    assert zoo_catalog.timm_smallest_side("resnet18", 3, 64) == 64
    model, (images,) = zoo.build_case(zoo_catalog.Case("inception_v3", "inception_v3", "image-classification",
                                                           model_class="inception_v3", library="timm"))
    assert images.shape == (zoo_catalog.BATCH, 3, 96, 96)
    with torch.no_grad():
        assert model(images).shape == (zoo_catalog.BATCH, zoo_catalog.LABELS)


def test_fixed_slice_matches_cpu() -> None:
    cases = [c for c in zoo.select_cases(library="timm", families=list(SLICE.values())) if c.key in SLICE]
    rows = zoo.run_cases(cases, isolate=False)
    assert len(rows) == len(SLICE)
    for row in rows:
        assert row["status"] == "match", row
        assert row["forward_max_diff"] <= 1e-4 and row["training_max_diff"] <= 1e-3
