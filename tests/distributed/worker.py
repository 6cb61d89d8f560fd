"""One rank of a distributed test job: runs named scenarios and records each outcome.

Launched by tests/test_distributed.py with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Usage: worker.py OUT_DIR SCENARIO[,SCENARIO...].
Each rank writes OUT_DIR/rank{R}.json: {scenario: "ok" | error text}.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torch_pjrt.distributed as pjrt_dist

SEED = 1234
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT)


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def sample(shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank-dependent random values, small for integers so products stay exact."""
    generator = torch.Generator().manual_seed(SEED + 100 * rank() + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-3, 4, shape, generator=generator, dtype=dtype)


def same(actual: torch.Tensor, expected: torch.Tensor, what: str, **tolerances: Any) -> None:
    assert actual.device.type == "pjrt", f"{what}: result on {actual.device}"
    torch.testing.assert_close(actual.cpu(), expected, msg=lambda m: f"{what}: {m}", **tolerances)


# --- collectives against gloo on CPU ------------------------------------------------------------


def _gloo() -> dist.ProcessGroup:
    if "gloo" not in _GROUPS:
        _GROUPS["gloo"] = dist.new_group(backend="gloo")
    return _GROUPS["gloo"]


_GROUPS: dict[str, dist.ProcessGroup] = {}


def _reference_all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """gloo's result on CPU; AVG (which gloo lacks) as its SUM over the group size."""
    expected = tensor.clone()
    dist.all_reduce(expected, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=_gloo())
    if op != dist.ReduceOp.AVG:
        return expected
    if expected.is_floating_point():
        return expected / world()
    return torch.div(expected, world(), rounding_mode="trunc")


def scenario_all_reduce(device: torch.device) -> None:
    for dtype in DTYPES:
        for op in OPS:
            host = sample((5, 3), dtype)
            tensor = host.to(device)
            dist.all_reduce(tensor, op=op)
            same(tensor, _reference_all_reduce(host, op), f"all_reduce {op} {dtype}")


def scenario_all_reduce_views(device: torch.device) -> None:
    """Non-contiguous inputs: a transposed tensor and a slice written through its base."""
    host = sample((4, 6), torch.float32)
    transposed = host.to(device).t()
    dist.all_reduce(transposed)
    same(transposed, _reference_all_reduce(host, dist.ReduceOp.SUM).t(), "transposed")
    base = host.to(device)
    dist.all_reduce(base[:, 1:4], op=dist.ReduceOp.MAX)
    expected = host.clone()
    expected[:, 1:4] = _reference_all_reduce(host[:, 1:4].contiguous(), dist.ReduceOp.MAX)
    same(base, expected, "slice written through its base")


def scenario_async(device: torch.device) -> None:
    host = sample((8,), torch.float32)
    tensor = host.to(device)
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    same(tensor, _reference_all_reduce(host, dist.ReduceOp.SUM), "async all_reduce")
    future_value = work.get_future().value()
    assert isinstance(future_value, list) and future_value[0] is tensor, "work's future holds the tensors"


def scenario_broadcast(device: torch.device) -> None:
    for dtype in DTYPES:
        host = sample((3, 4), dtype)
        tensor = host.to(device)
        dist.broadcast(tensor, src=1)
        expected = host.clone()
        dist.broadcast(expected, src=1, group=_gloo())
        same(tensor, expected, f"broadcast {dtype}")


def scenario_all_gather(device: torch.device) -> None:
    for dtype in DTYPES:
        host = sample((2, 3), dtype)
        outputs = [torch.empty(2, 3, dtype=dtype, device=device) for _ in range(world())]
        dist.all_gather(outputs, host.to(device))
        expected = [torch.empty(2, 3, dtype=dtype) for _ in range(world())]
        dist.all_gather(expected, host, group=_gloo())
        for got, want in zip(outputs, expected):
            same(got, want, f"all_gather {dtype}")
        flat = torch.empty(2 * world(), 3, dtype=dtype, device=device)
        dist.all_gather_into_tensor(flat, host.to(device))
        same(flat, torch.cat(expected), f"all_gather_into_tensor {dtype}")
        # NCCL's other accepted output forms, which accelerate's gather uses: flat, and stacked
        for shape in ((2 * world() * 3,), (world(), 2, 3)):
            other = torch.empty(shape, dtype=dtype, device=device)
            dist.all_gather_into_tensor(other, host.to(device))
            same(other, torch.cat(expected).reshape(shape), f"all_gather_into_tensor {shape} {dtype}")


def scenario_reduce_scatter(device: torch.device) -> None:
    for dtype in DTYPES:
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            host = sample((2 * world(), 3), dtype)
            output = torch.empty(2, 3, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(output, host.to(device), op=op)
            expected = _reference_all_reduce(host, op).chunk(world())[rank()]
            same(output, expected, f"reduce_scatter_tensor {op} {dtype}")
    host = [sample((3,), torch.float32, salt=i) for i in range(world())]
    output = torch.empty(3, device=device)
    dist.reduce_scatter(output, [t.to(device) for t in host])
    same(output, _reference_all_reduce(torch.stack(host), dist.ReduceOp.SUM)[rank()], "reduce_scatter")


def scenario_all_to_all(device: torch.device) -> None:
    for dtype in DTYPES:
        host = sample((2 * world(), 3), dtype)
        output = torch.empty_like(host, device=device)
        dist.all_to_all_single(output, host.to(device))
        expected = torch.empty_like(host)
        dist.all_to_all_single(expected, host, group=_gloo())
        same(output, expected, f"all_to_all_single {dtype}")
    sizes_in = [1 + rank(), 2]
    sizes_out = [1 + r if rank() == 0 else 2 for r in range(world())] if world() == 2 else sizes_in
    host = sample((sum(sizes_in),), torch.float32)
    output = torch.empty(sum(sizes_out), device=device)
    dist.all_to_all_single(output, host.to(device), sizes_out, sizes_in)
    expected = torch.empty(sum(sizes_out))
    dist.all_to_all_single(expected, host, sizes_out, sizes_in, group=_gloo())
    same(output, expected, "all_to_all_single uneven")


def scenario_reduce_gather_scatter(device: torch.device) -> None:
    for dtype in (torch.float32, torch.int64):
        host = sample((4,), dtype)
        tensor = host.to(device)
        dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
        expected = host.clone()
        dist.reduce(expected, dst=0, op=dist.ReduceOp.SUM, group=_gloo())
        same(tensor, expected if rank() == 0 else host, f"reduce {dtype}")

        gathered = [torch.empty(4, dtype=dtype, device=device) for _ in range(world())] if rank() == 0 else None
        dist.gather(host.to(device), gathered, dst=0)
        reference = [torch.empty(4, dtype=dtype) for _ in range(world())] if rank() == 0 else None
        dist.gather(host, reference, dst=0, group=_gloo())
        for got, want in zip(gathered or [], reference or []):
            same(got, want, f"gather {dtype}")

        pieces = [sample((4,), dtype, salt=i) for i in range(world())]
        received = torch.empty(4, dtype=dtype, device=device)
        dist.scatter(received, [p.to(device) for p in pieces] if rank() == 0 else None, src=0)
        want = torch.empty(4, dtype=dtype)
        dist.scatter(want, pieces if rank() == 0 else None, src=0, group=_gloo())
        same(received, want, f"scatter {dtype}")


def scenario_send_recv(device: torch.device) -> None:
    payload = torch.arange(6, dtype=torch.float64).reshape(2, 3) * 1.5
    if rank() == 0:
        dist.send(payload.to(device), dst=1)
        reply = torch.empty(2, 3, dtype=torch.float64, device=device)
        dist.recv(reply, src=1)
        same(reply, payload * 2, "recv")
    elif rank() == 1:
        received = torch.empty(2, 3, dtype=torch.float64, device=device)
        dist.recv(received, src=0)
        same(received, payload, "recv")
        dist.send(received * 2, dst=0)
    dist.barrier()


def scenario_coalescing(device: torch.device) -> None:
    """all_reduce_coalesced and the coalescing manager, mixed shapes and dtypes."""
    hosts = [sample((3,), torch.float32), sample((2, 2), torch.float64, salt=1), sample((5,), torch.float32, salt=2)]
    tensors = [h.to(device) for h in hosts]
    with dist._coalescing_manager(async_ops=True) as manager:
        for t in tensors:
            dist.all_reduce(t)
    manager.wait()
    for got, host in zip(tensors, hosts):
        same(got, _reference_all_reduce(host, dist.ReduceOp.SUM), "coalesced all_reduce")
    inputs = [sample((2,), torch.float32, salt=3), sample((3,), torch.float32, salt=4)]
    outputs = [torch.empty(2 * world(), device=device), torch.empty(3 * world(), device=device)]
    with dist._coalescing_manager():
        for output, host in zip(outputs, inputs):
            dist.all_gather_into_tensor(output, host.to(device))
    for output, host in zip(outputs, inputs):
        expected = torch.empty(host.numel() * world())
        dist.all_gather_into_tensor(expected, host, group=_gloo())
        same(output, expected, "coalesced all_gather_into_tensor")


def scenario_functional(device: torch.device) -> None:
    """torch.distributed._functional_collectives, eagerly on pjrt tensors."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    host = sample((4, 2), torch.float32)
    same(funcol.all_reduce(host.to(device), "sum", group), _reference_all_reduce(host, dist.ReduceOp.SUM), "funcol")
    gathered = torch.empty(4 * world(), 2)
    dist.all_gather_into_tensor(gathered, host, group=_gloo())
    same(funcol.all_gather_tensor(host.to(device), 0, group), gathered, "funcol all_gather")
    scattered = funcol.reduce_scatter_tensor(host.to(device), "sum", 0, group)
    same(scattered, _reference_all_reduce(host, dist.ReduceOp.SUM).chunk(world())[rank()], "funcol reduce_scatter")


def scenario_compiled(device: torch.device) -> None:
    """Functional collectives inside torch.compile(backend="pjrt", fullgraph=True) equal eager ones."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        summed = funcol.all_reduce(x * 2, "sum", group)
        gathered = funcol.all_gather_tensor(summed, 0, group)
        scattered = funcol.reduce_scatter_tensor(gathered, "avg", 0, group)
        return scattered + 1, gathered, funcol.all_to_all_single(x, None, None, group)

    from torch_pjrt import metrics

    compiled = torch.compile(step, backend="pjrt", fullgraph=True)
    for salt in range(2):
        host = sample((4, 3), torch.float32, salt=salt)
        metrics.reset()
        results = compiled(host.to(device))
        inside = metrics.counters()["collectives_host"] == 0
        for got, want in zip(results, step(host.to(device))):
            same(got, want.cpu(), "compiled functional collectives", atol=1e-6, rtol=1e-6)
        expected = os.environ.get("EXPECT_ENGINE", "xla") == "xla"
        assert inside == expected, f"collectives inside the program: {inside}, expected {expected}"


def scenario_cpu_tensors(device: torch.device) -> None:
    """The default group also serves CPU tensors (cpu:gloo through the same group)."""
    host = sample((3,), torch.float32)
    tensor = host.clone()
    dist.all_reduce(tensor)
    torch.testing.assert_close(tensor, _reference_all_reduce(host, dist.ReduceOp.SUM))


# --- training -----------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(steps)]


def _train(model: nn.Module, batches: list, device: torch.device | str, shard: bool) -> list[float]:
    """SGD on MSE; with `shard` each rank takes its slice of every batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for inputs, targets in batches:
        if shard:
            inputs, targets = inputs.chunk(world())[rank()], targets.chunk(world())[rank()]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _reference_parameters() -> dict[str, torch.Tensor]:
    model = _model()
    _train(model, _batches(), "cpu", shard=False)
    return {name: p.detach() for name, p in model.named_parameters()}


def scenario_ddp(device: torch.device) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model().to(device), bucket_cap_mb=0.0005)
    _train(model, _batches(), device, shard=True)
    for name, expected in _reference_parameters().items():
        same(dict(model.module.named_parameters())[name].detach(), expected, f"DDP {name}", atol=1e-5, rtol=1e-4)


def _fsdp_parameters(device: torch.device, **policy: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model().to(device)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
    _train(model, _batches(), device, shard=True)
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def scenario_fsdp(device: torch.device) -> None:
    for name, actual in _fsdp_parameters(device).items():
        same(actual, _reference_parameters()[name], f"FSDP2 {name}", atol=1e-5, rtol=1e-4)


def scenario_fsdp_mixed_precision(device: torch.device) -> None:
    """bfloat16 compute, float32 reduction: close to the float32 run, not equal."""
    parameters = _fsdp_parameters(device, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name, actual in parameters.items():
        assert actual.dtype == torch.float32, f"{name} kept in {actual.dtype}"
        same(actual, _reference_parameters()[name], f"FSDP2 bf16 {name}", atol=3e-2, rtol=3e-2)


# --- DTensor ------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        split = [t.view(batch, length, -1, x.shape[-1] // self.heads).transpose(1, 2) for t in (
            self.q(x), self.k(x), self.v(x))]
        mixed = nn.functional.scaled_dot_product_attention(*split, is_causal=True)
        return self.o(mixed.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def scenario_dtensor(device: torch.device) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world(),))
    torch.manual_seed(SEED)
    full = torch.randn(6, 4)
    for placement in (Shard(0), Shard(1), Replicate()):
        sharded = distribute_tensor(full.to(device), mesh, [placement])
        assert sharded.to_local().device.type == "pjrt"
        same(sharded.full_tensor(), full, f"distribute_tensor {placement}")
        same((sharded * 2 + 1).sum(0).full_tensor(), (full * 2 + 1).sum(0), f"DTensor ops {placement}", atol=1e-5,
             rtol=1e-5)
    resharded = distribute_tensor(full.to(device), mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
    same(resharded.to_local(), full.chunk(world(), 1)[rank()], "redistribute Shard(0)->Shard(1)")


def _tensor_parallel(module: nn.Module, plan: dict, device: torch.device, what: str) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world(),))
    reference = copy.deepcopy(module)
    parallel = parallelize_module(copy.deepcopy(module).to(device), mesh, plan)
    torch.manual_seed(SEED + 1)
    inputs = torch.randn(2, 5, 16)
    expected = reference(inputs)
    expected.sum().backward()
    actual = parallel(inputs.to(device))
    actual.sum().backward()
    same(actual, expected.detach(), f"{what} output", atol=1e-5, rtol=1e-4)
    for name, p in parallel.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        same(grad, dict(reference.named_parameters())[name].grad, f"{what} grad {name}", atol=1e-5, rtol=1e-4)


def scenario_tensor_parallel(device: torch.device) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(SEED)
    _tensor_parallel(MLP(), {"up": ColwiseParallel(), "down": RowwiseParallel()}, device, "TP MLP")
    torch.manual_seed(SEED)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    _tensor_parallel(Attention(), plan, device, "TP attention")


# --- checkpoints --------------------------------------------------------------------------------


def _checkpoint_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def scenario_checkpoint_save(device: torch.device) -> None:
    """FSDP2-sharded state saved by every rank; rank 0 also keeps the full reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    folder = os.environ["CHECKPOINT_DIR"]
    model = _checkpoint_model().to(device)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world(),))
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(folder, "sharded"))
    full = {name: t.full_tensor().cpu() for name, t in model.state_dict().items()}
    if rank() == 0:
        torch.save(full, os.path.join(folder, "reference.pt"))


def scenario_checkpoint_load(device: torch.device) -> None:
    """Load the sharded checkpoint into a model on however many ranks run now."""
    import torch.distributed.checkpoint as dcp

    folder = os.environ["CHECKPOINT_DIR"]
    model = _checkpoint_model().to(device)
    if world() > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=torch.distributed.device_mesh.init_device_mesh(device.type, (world(),)))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, "sharded"))
    model.load_state_dict(state["model"])
    reference = torch.load(os.path.join(folder, "reference.pt"))
    for name, tensor in model.state_dict().items():
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        same(tensor, reference[name], f"checkpoint {name}")


# --- engines ------------------------------------------------------------------------------------


def scenario_engine(device: torch.device) -> None:
    """The engine EXPECT_ENGINE runs pjrt collectives: XLA programs with no host copies, or gloo over them."""
    from torch_pjrt import metrics

    expected = os.environ.get("EXPECT_ENGINE", "xla")
    assert pjrt_dist.engine()["engine"] == expected, f"engine {pjrt_dist.engine()}, expected {expected}"
    tensor = sample((1024,), torch.float32).to(device)
    torch.pjrt.synchronize()
    metrics.reset()
    for _ in range(3):
        dist.all_reduce(tensor)
        dist.all_gather_into_tensor(torch.empty(2048, device=device), tensor)
    torch.pjrt.synchronize()
    counts = metrics.counters()
    if expected == "xla":
        assert counts["collectives_xla"] == 6 and counts["collectives_host"] == 0, counts
        assert counts["transfers_to_host"] == 0 and counts["transfers_to_device"] == 0, counts
    else:
        assert counts["collectives_host"] == 6 and counts["collectives_xla"] == 0, counts
        assert counts["transfers_to_host"] >= 6, counts


def scenario_fused_collective(device: torch.device) -> None:
    """In DEFER_AND_FUSE a collective of the XLA engine ends the fused program that computes its input, which is
    dispatched without a host sync; the ops after it fuse into the next program."""
    from torch_pjrt import metrics

    host = sample((6, 4), torch.float32)
    with torch.pjrt.set_eager_mode("defer_and_fuse"):
        torch.pjrt.synchronize()
        metrics.reset()
        tensor = host.to(device) * 2
        work = dist.all_reduce(tensor, async_op=True)
        work.wait()
        before_read = metrics.counters()
        result = (tensor + 1).cpu()
        counts = metrics.counters()
    expected = _reference_all_reduce(host * 2, dist.ReduceOp.SUM) + 1
    torch.testing.assert_close(result, expected)
    if os.environ.get("EXPECT_ENGINE", "xla") == "xla":
        assert before_read["transfers_to_host"] == 0 and before_read["collectives_xla"] == 1, before_read
        assert counts["fused_programs"] == 2 and counts["transfers_to_host"] == 1, counts


def scenario_subgroups(device: torch.device) -> None:
    """Collectives over each dimension of a 2-D DeviceMesh and over a new_group equal gloo's on the same groups
    (CPU tensors through the same groups), eager and compiled, and run as XLA programs."""
    import torch.distributed._functional_collectives as funcol

    from torch_pjrt import metrics

    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (2, world() // 2), mesh_dim_names=("dp", "tp"))
    groups = [mesh.get_group("dp"), mesh.get_group("tp"), dist.new_group([0, world() - 1])]
    for index, group in enumerate(groups):
        if group is None or rank() not in dist.get_process_group_ranks(group):
            continue
        host = sample((3, 5), torch.float32, salt=index)
        metrics.reset()
        tensor = host.to(device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        expected = host.clone()
        dist.all_reduce(expected, op=dist.ReduceOp.MAX, group=group)
        same(tensor, expected, f"all_reduce over {dist.get_process_group_ranks(group)}")
        size = dist.get_world_size(group)
        gathered = torch.empty(3 * size, 5, device=device)
        dist.all_gather_into_tensor(gathered, host.to(device), group=group)
        reference = torch.empty(3 * size, 5)
        dist.all_gather_into_tensor(reference, host, group=group)
        same(gathered, reference, f"all_gather over {dist.get_process_group_ranks(group)}")
        assert metrics.counters()["collectives_xla"] == 2, metrics.counters()

        compiled = torch.compile(lambda x, g=group: funcol.all_reduce(x * 3, "sum", g) + 1, backend="pjrt",
                                 fullgraph=True)
        want = host * 3
        dist.all_reduce(want, group=group)
        metrics.reset()
        same(compiled(host.to(device)), want + 1, f"compiled all_reduce over {dist.get_process_group_ranks(group)}",
             atol=1e-5, rtol=1e-5)
        assert metrics.counters()["collectives_host"] == 0, metrics.counters()


def scenario_mismatched_shapes(device: torch.device) -> None:
    """Ranks passing tensors of different shapes to one collective get an error naming both, not a hang."""
    tensor = torch.ones(4 + rank(), device=device)
    try:
        dist.all_reduce(tensor)
    except (RuntimeError, ValueError) as error:
        assert "shape" in str(error), error
        return
    raise AssertionError("all_reduce of float32[4] and float32[5] completed")


# --- failures -----------------------------------------------------------------------------------


def scenario_timeout(device: torch.device) -> None:
    """Rank 1 skips a collective; rank 0's all_reduce fails after the group's timeout, not later."""
    limit = float(os.environ["DIST_TIMEOUT"])
    if rank() == 1:
        time.sleep(limit + 4)
        return
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4, device=device))
    except RuntimeError:
        elapsed = time.monotonic() - start
        assert elapsed < limit + 3, f"the collective failed only after {elapsed:.1f}s (timeout {limit}s)"
        return
    raise AssertionError("all_reduce completed without its peer")


def scenario_fail(device: torch.device) -> None:
    """Rank 1 dies before the collective; rank 0 must get an error, not a hang."""
    if rank() == 1:
        os._exit(3)
    tensor = torch.ones(4, device=device)
    dist.all_reduce(tensor)


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


if __name__ == "__main__":
    from ranks import run_scenarios

    run_scenarios(SCENARIOS, sys.argv[1], sys.argv[2])
