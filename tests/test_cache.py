"""The persistent compile cache: shared by processes, survives corrupt entries."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import torch, torch_pjrt
    x = torch.arange(12.0).reshape(3, 4).to("pjrt")
    y = (x.sin() * 2 + x.t().sum()).cos().sum()
    counters = torch_pjrt.metrics.counters()
    print(round(y.item(), 4), counters["persistent_cache_hits"], counters["persistent_cache_misses"],
          counters["compiles"], counters["op_store_hits"])
    """
)


def run(cache: Path, script: str = SCRIPT) -> list[str]:
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_second_process_loads_every_strict_op_and_lowers_none(tmp_path: Path) -> None:
    """A strict op's executable and its checks are stored beside XLA's cache: a second process loads them
    (each op's executable and checks, two hits an op) instead of tracing, lowering and asking XLA's cache.
    They are compiled without XLA's cache, which would only keep a copy no process reads."""
    value, hits, misses, compiles, loaded = run(tmp_path)
    assert int(hits) == int(misses) == 0 and int(compiles) > 0 and int(loaded) == 0
    assert any((tmp_path / "executables").iterdir())
    assert not (tmp_path / "xla").exists() or not any((tmp_path / "xla").iterdir())
    again, hits, misses, compiles, loaded = run(tmp_path)
    assert again == value
    assert int(hits) == int(misses) == int(compiles) == 0 and int(loaded) > 0


RANDOM_OPS = textwrap.dedent(
    """
    import sys, torch, torch_pjrt
    torch.manual_seed(int(sys.argv[1]))
    x, w = torch.randn(5, 7), torch.randn(7, 3)
    y = ((x.to("pjrt") @ w.to("pjrt")).tanh() * 3 - x.to("pjrt")[:, :3].exp()).cpu()
    torch.testing.assert_close(y, (x @ w).tanh() * 3 - x[:, :3].exp(), rtol=1e-5, atol=1e-5)
    counters = torch_pjrt.metrics.counters()
    print(counters["compiles"], counters["persistent_cache_hits"], counters["op_store_hits"],
          counters["op_store_writes"])
    """
)


def test_an_executable_our_store_lacks_is_compiled_not_loaded_from_xlas_cache(tmp_path: Path) -> None:
    """After our code changes, every key of our store is new while XLA's cache folder is kept: the process
    that meets them compiles and stores them (one from XLA's cache would lose its code, and none is written
    there), so the next process lowers nothing."""
    def counts(seed: int) -> list[int]:
        result = subprocess.run([sys.executable, "-c", RANDOM_OPS, str(seed)], capture_output=True, text=True,
                                timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(tmp_path)})
        assert result.returncode == 0, result.stderr[-2000:]
        return [int(count) for count in result.stdout.split()]

    compiles, _, _, writes = counts(1)
    assert compiles > 0 and writes > 0
    for kind in tmp_path.iterdir():  # our entries gone as a code change would make them, XLA's kept
        if kind.name != "xla":
            shutil.rmtree(kind)
    assert counts(2) == [compiles, 0, 0, writes]
    assert counts(3) == [0, 0, writes, 0]


def test_corrupt_entries_are_recompiled(tmp_path: Path) -> None:
    value, *_ = run(tmp_path)
    for entry in tmp_path.rglob("*"):
        if entry.is_file():
            entry.write_bytes(entry.read_bytes()[: max(1, entry.stat().st_size // 3)])
    again, *_ = run(tmp_path)
    assert again == value


COMPILED = textwrap.dedent(
    """
    import torch, torch_pjrt
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).to("pjrt")
    x = torch.randn(4, 6).to("pjrt")
    loss = torch.compile(lambda x: model(x).square().mean(), backend="pjrt")(x)
    loss.backward()
    values = round(loss.item(), 6), round(model[0].weight.grad.sum().item(), 6)
    counters = torch_pjrt.metrics.counters()
    print(*values, counters["disk_store_hits"], counters["disk_store_writes"], counters["disk_store_damaged"])
    """
)


def test_traced_graphs_are_stored_for_the_next_process_and_damage_is_survived(tmp_path: Path) -> None:
    loss, grad, hits, writes, damaged = run(tmp_path, COMPILED)
    # the forward and the backward graph, each traced and its executable
    assert (int(hits), int(writes), int(damaged)) == (0, 4, 0)
    assert len(list((tmp_path / "graphs").iterdir())) == 2
    assert run(tmp_path, COMPILED) == [loss, grad, "4", "0", "0"]
    stored = sorted((tmp_path / "graphs").iterdir())
    stored[0].write_bytes(stored[0].read_bytes()[:100])
    # the damaged graph is traced again; its executable still loads
    assert run(tmp_path, COMPILED) == [loss, grad, "3", "1", "1"]
    assert run(tmp_path, COMPILED) == [loss, grad, "4", "0", "0"]
    executables = sorted((tmp_path / "executables").iterdir())  # the graphs' and strict eager's ops'
    for executable in executables:
        executable.write_bytes(executable.read_bytes()[:-50])
    # compiled again, not loaded from XLA's cache (such an executable loses its code), and stored again
    assert run(tmp_path, COMPILED) == [loss, grad, "2", "2", str(len(executables))]
    assert run(tmp_path, COMPILED) == [loss, grad, "4", "0", "0"]


RESHAPED = textwrap.dedent(
    """
    import sys, torch, torch_pjrt
    torch.manual_seed(0)
    # the same (4, 8) view either way; its storage's array has the shape its producer gave it
    x = torch.randn(8, 4).to("pjrt").view(4, 8) if sys.argv[1] == "tall" else torch.randn(4, 8).to("pjrt")
    y = torch.compile(lambda t: (t * 2).sum(0), backend="pjrt")(x)
    torch.testing.assert_close(y.cpu(), (x.cpu() * 2).sum(0))
    print(torch_pjrt.metrics.counters()["disk_store_hits"])
    """
)


def test_a_stored_graph_is_keyed_by_its_storage_arrays_shapes(tmp_path: Path) -> None:
    """A storage array of another shape behind the same view is another program, never the stored one."""
    def run_as(shape: str) -> str:
        result = subprocess.run([sys.executable, "-c", RESHAPED, shape], capture_output=True, text=True,
                                timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(tmp_path)})
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.split()[-1]

    assert run_as("wide") == "0"
    assert run_as("tall") == "0"
    assert (run_as("wide"), run_as("tall")) == ("2", "2")  # each its graph and its executable


MANY = textwrap.dedent(
    """
    import sys, torch, torch_pjrt
    torch.manual_seed(int(sys.argv[1]))
    values = []
    for rows in range(1, 21):  # 20 programs of their own shapes, each written to the shared folder
        x = torch.randn(rows, 3)
        values.append(torch.allclose((x.to("pjrt") * 3).exp().sum(1).cpu(), (x * 3).exp().sum(1), rtol=1e-5))
    counters = torch_pjrt.metrics.counters()
    print(all(values), counters["compiles"], counters["op_store_hits"], counters["disk_store_damaged"])
    """
)


def test_two_processes_filling_one_folder_at_once_leave_no_damaged_entry(tmp_path: Path) -> None:
    """Two ranks of one job compile the same 20 programs at the same moment into one empty folder: every
    entry either process wrote loads in a third process (nothing lowered, nothing damaged), and no partial
    file is left."""
    env = {**os.environ, "TORCH_PJRT_CACHE_DIR": str(tmp_path)}
    racers = [subprocess.Popen([sys.executable, "-c", MANY, str(seed)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        assert racer.returncode == 0, err[-2000:]
        assert out.split()[0] == "True"
    close, compiles, loaded, damaged = run(tmp_path, MANY.replace("sys.argv[1]", "3"))
    assert close == "True" and int(compiles) == int(damaged) == 0 and int(loaded) >= 20
    assert not list(tmp_path.rglob(".partial-*"))


def cache_command(folder: Path, *args: str) -> str:
    """`torch-pjrt cache ARGS` on `folder`: its output."""
    result = subprocess.run([sys.executable, "-m", "torch_pjrt", "cache", *args], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(folder)})
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_cache_command_shows_prunes_and_clears(tmp_path: Path) -> None:
    run(tmp_path)
    cache = functools.partial(cache_command, tmp_path)

    shown = json.loads(cache("--format", "json"))
    entries = shown["kinds"]["executables"]["entries"]
    assert entries > 0 and shown["kinds"]["executables"]["bytes"] > 0
    assert "executables/" in cache() and f"{entries} entries" in cache()
    assert shown["kinds"]["op_checks"]["entries"] > 0 and shown["kinds"]["preload"]["entries"] == 1
    everything = sum(kind["entries"] for kind in shown["kinds"].values())  # strict ops' executables and checks too
    assert f"removed {everything} entries" in cache("prune", "--max-bytes", "0")
    assert json.loads(cache("--format", "json"))["kinds"]["executables"]["entries"] == 0
    run(tmp_path)
    assert "cleared" in cache("clear") and not any(tmp_path.iterdir())


def test_the_cache_command_counts_aotautograd_and_dynamo_entries_and_prunes_other_code_versions(
        tmp_path: Path) -> None:
    run(tmp_path, COMPILED)
    stale = [tmp_path / kind / "0123456789abcdef" / "key" for kind in ("aotautograd", "dynamo")]
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / "entry").write_bytes(os.urandom(64))
    cache = functools.partial(cache_command, tmp_path)

    def entries() -> dict[str, int]:
        kinds = json.loads(cache("--format", "json"))["kinds"]
        return {kind: kinds[kind]["entries"] for kind in ("aotautograd", "dynamo")}

    before = entries()
    assert before["aotautograd"] >= 2 and before["dynamo"] >= 1 and "aotautograd/" in cache() and "dynamo/" in cache()
    assert "removed 2 entries (128 B)" in cache("prune", "--older-than-days", "1000")
    assert not any(folder.parent.exists() for folder in stale)
    assert entries() == {kind: count - 1 for kind, count in before.items()}
    assert "cleared" in cache("clear")
    assert not (tmp_path / "aotautograd").exists() and not (tmp_path / "dynamo").exists()


OPTIONS_SEEN = textwrap.dedent(
    """
    import sys, torch, torch_pjrt
    from jax._src import compiler
    torch_pjrt.runtime.client.jax_module()
    seen = []
    compile_and_load = compiler.backend_compile_and_load

    def recording(backend, module, devices, options, callbacks):
        seen.append(dict(options.env_option_overrides))
        return compile_and_load(backend, module, devices, options, callbacks)

    compiler.backend_compile_and_load = recording
    if sys.argv[1] == "fused":
        torch_pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
    torch.manual_seed(int(sys.argv[2]))
    x, w = torch.randn(5, 7), torch.randn(7, 3)
    y = ((x.to("pjrt") @ w.to("pjrt")).tanh() * 3 - x.to("pjrt")[:, :3].exp()).cpu()
    torch.testing.assert_close(y, (x @ w).tanh() * 3 - x[:, :3].exp(), rtol=1e-5, atol=1e-5)
    wanted = torch_pjrt.runtime.client.one_op_options()
    print(len(seen), sum(all(options.get(k) == str(v) or options.get(k) == v for k, v in wanted.items())
                         for options in seen), int(bool(wanted)))
    """
)


def test_one_op_programs_are_compiled_with_their_xla_options_and_fused_ones_without(tmp_path: Path) -> None:
    """Strict eager's one-op programs get XLA's options for small programs (client.one_op_options) at the
    compile itself, with a cache folder or without one; a fused program, run every decode step, keeps XLA's
    defaults."""
    seed = str(int.from_bytes(os.urandom(2), "little"))
    for mode, folder, share in (("strict", str(tmp_path / "strict"), "all"), ("strict", "0", "all"),
                                ("fused", str(tmp_path / "fused"), "none")):
        result = subprocess.run([sys.executable, "-c", OPTIONS_SEEN, mode, seed], capture_output=True, text=True,
                                timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": folder})
        assert result.returncode == 0, result.stderr[-2000:]
        compiles, with_options, options_exist = map(int, result.stdout.split())
        assert compiles > 0 and options_exist == 1
        assert with_options == (compiles if share == "all" else 0), (mode, folder, compiles, with_options)
