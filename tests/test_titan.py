"""TorchTitan's llama3 debug model trained on pjrt against the same run on the CPU (make test-titan).

Every run starts from one seed checkpoint (written once on the CPU by TorchTitan's own
`--checkpoint.create_seed_checkpoint`) and reads the same offline data in the same order, so the
per-step losses TorchTitan logs must agree to float32 rounding. docs/torchtitan.md has the recipe.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="TorchTitan lives in .venv-titan: run `make test-titan`")

REPO = Path(__file__).resolve().parents[1]
CPU_LAUNCHER = REPO / "tests" / "fixtures" / "titan" / "train_cpu.py"
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "titan"))
sys.path.insert(0, str(REPO / "tests" / "distributed"))
import assets  # noqa: E402
import ranks  # noqa: E402 (tests/distributed/ranks.py: free_port)

STEPS = 6
# Float32 on two backends sums in different orders (XLA's dots and reductions against ATen's): the first
# loss, on the seed weights, differed by up to 8e-5 (8.12683 with TP 2 against 8.12691), and Adam, which divides each
# gradient element by its own magnitude, turns such rounding into lr-sized differences in small entries:
# 2.3e-4 at step 5 (measured). A wrong gradient or a rank's missing data moves the loss by 1e-2 and more.
FIRST_LOSS_TOLERANCE = 2e-4
LOSS_TOLERANCE = 1e-3
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+).*?tps:\s*([0-9,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _common_args(folder: Path, run: str) -> list[str]:
    tokenizer, dataset = folder / "assets" / "tokenizer", folder / "assets" / "c4_test"
    return [
        "--module", "pjrt_config", "--config", "llama3_debugmodel",
        "--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(dataset),
        "--dump_folder", str(folder / run),
        "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--optimizer.implementation", "foreach", "--debug.seed", "0", "--metrics.log_freq", "1",
        # CUDA graphs are CUDA's (TorchTitan runs eagerly elsewhere) and refuse pipeline parallelism
        "--training.disable_cuda_graphs",
    ]


def launch(folder: Path, run: str, device: str, ranks: int, extra: list[str], log_rank: int = 0,
           timeout: float = 900) -> list[tuple]:
    """Runs torchtitan.train under torchrun; returns the (step, loss, grad_norm, tps) that `log_rank` logs."""
    # One intra-op thread per rank, as torchrun sets for several ranks: on a shared 2-core machine the
    # 1-rank CPU run with 2 threads took 10-15 s a step, the 2-rank CPU FSDP run (1 thread each) 1.5 s.
    env = dict(os.environ, PYTHONPATH=str(REPO / "examples" / "titan"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    if device == "cpu":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        entry = [str(CPU_LAUNCHER)]
    else:
        env["TORCH_PJRT_CPU_DEVICES"] = str(ranks)
        entry = ["-m", "torchtitan.train"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(ranks.free_port()), "--local-ranks-filter", str(log_rank),
        "--tee", "3", *entry, *_common_args(folder, run), *extra,
    ]
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=timeout)
    log = ANSI.sub("", done.stdout + done.stderr)
    (folder / f"{run}.log").write_text(log)
    assert done.returncode == 0, f"{run} failed (exit {done.returncode}):\n{log[-6000:]}"
    steps = [(int(step), float(loss), float(norm), int(tps.replace(",", "")))
             for step, loss, norm, tps in STEP_LINE.findall(log)]
    assert [s[0] for s in steps] == list(range(1, STEPS + 1)), f"{run} logged steps {steps}:\n{log[-3000:]}"
    return steps


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Offline assets and the seed checkpoint every run loads."""
    folder = tmp_path_factory.mktemp("titan")
    assets.build(folder / "assets")
    env = dict(os.environ, PYTHONPATH=str(REPO / "examples" / "titan"), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(ranks.free_port()),
        str(CPU_LAUNCHER), *_common_args(folder, "seed"),
        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--checkpoint.folder", "checkpoint",
    ]
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert (folder / "seed" / "checkpoint" / "step-0").is_dir()
    return folder


def seeded(folder: Path) -> list[str]:
    """Loads the seed checkpoint's model and never saves."""
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(folder / "seed" / "checkpoint" / "step-0"),
            "--checkpoint.load_only"]


@pytest.fixture(scope="module")
def cpu_one_rank(workdir) -> list[tuple]:
    return launch(workdir, "cpu-1", "cpu", 1, seeded(workdir))


def assert_same_losses(got: list[tuple], want: list[tuple]) -> None:
    table = "\n".join(f"step {g[0]}: {g[1]:.5f} vs {w[1]:.5f}" for g, w in zip(got, want))
    assert abs(got[0][1] - want[0][1]) <= FIRST_LOSS_TOLERANCE, table
    assert all(abs(g[1] - w[1]) <= LOSS_TOLERANCE for g, w in zip(got, want)), table
    # the model learns: the last loss is below the first (the check is not vacuous)
    assert got[-1][1] < got[0][1] - 0.05, table


def test_one_rank_matches_cpu(workdir, cpu_one_rank):
    pjrt = launch(workdir, "pjrt-1", "pjrt", 1, seeded(workdir))
    assert_same_losses(pjrt, cpu_one_rank)


# TorchTitan 0.3.0's default SPMD backend ("spmd_types") hands FSDP2 `dp_mesh_dims`, which torch 2.13.0's
# fully_shard accepts only for parameters already DTensors on the whole mesh; it fails so on the CPU as on
# pjrt. "partial_dtensor" is PyTorch's DTensor for the model-parallel dimensions, as in earlier releases.
DTENSOR = ["--parallelism.spmd_backend", "partial_dtensor"]
# run: (ranks, arguments, the rank that logs the loss, whether the reference is the same run on the CPU
# rather than the 1-rank CPU run). FSDP2 splits the batch by rank (other documents than one rank reads);
# tensor and pipeline parallelism and compilation train on the 1-rank run's data.
PARALLEL_RUNS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2", *DTENSOR], 0, True),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", *DTENSOR], 0, False),
    # The last stage computes the loss; two microbatches of one sequence each.
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
                "--parallelism.pipeline_parallel_microbatch_size", "1", *DTENSOR], 1, False),
    "compile": (1, ["--compile.enable", "--compile.backend", "pjrt"], 0, False),
}


@pytest.mark.parametrize("name", list(PARALLEL_RUNS))
def test_parallel_run_matches_cpu(workdir, cpu_one_rank, name):
    ranks, extra, log_rank, own_reference = PARALLEL_RUNS[name]
    pjrt = launch(workdir, f"pjrt-{name}", "pjrt", ranks, [*seeded(workdir), *extra], log_rank)
    if own_reference:
        reference = launch(workdir, f"cpu-{name}", "cpu", ranks, [*seeded(workdir), *extra], log_rank)
    else:
        reference = cpu_one_rank
    assert_same_losses(pjrt, reference)
