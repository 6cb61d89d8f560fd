"""torch.compile(backend="pjrt") and export_stablehlo against PyTorch on CPU."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_pjrt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes  # noqa: E402


def cnn() -> nn.Module:
    """No conv bias before batch norm: its exact gradient is zero, and Adam would amplify rounding noise."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(6 * 4 * 4, 5),
    )


def test_inference_matches_cpu() -> None:
    torch.manual_seed(0)
    for model, x in (
        (nn.Sequential(nn.Linear(7, 9), nn.GELU(), nn.Linear(9, 3)), torch.randn(4, 7)),
        (cnn().eval(), torch.randn(2, 3, 8, 8)),
        (GPT(width=32, layers=1, heads=2, context=8).eval(), torch.randint(0, 256, (2, 8))),
    ):
        expected = model(x)
        compiled = torch.compile(copy.deepcopy(model).to("pjrt"), backend="pjrt", fullgraph=True)
        actual = compiled(x.to("pjrt"))
        assert actual.device.type == "pjrt"
        torch.testing.assert_close(actual.cpu(), expected, atol=1e-5, rtol=1e-5)


def training(model: nn.Module, data: list, loss_fn, compile_mode: str | None) -> tuple[list, nn.Module]:  # noqa: ANN001
    """Train with AdamW; compile_mode None (eager), "forward" or "step" (the whole step compiled)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    if compile_mode == "step":
        step = torch.compile(step, backend="pjrt")
    elif compile_mode == "forward":
        model.forward = torch.compile(model.forward, backend="pjrt")
    device = next(model.parameters()).device
    return [step(x.to(device), y.to(device)).item() for x, y in data], model


def assert_trains_like_cpu(model: nn.Module, data: list, loss_fn, compile_mode: str) -> None:  # noqa: ANN001
    cpu_losses, cpu_model = training(copy.deepcopy(model), data, loss_fn, None)
    pjrt_losses, pjrt_model = training(copy.deepcopy(model).to("pjrt"), data, loss_fn, compile_mode)
    torch.testing.assert_close(torch.tensor(pjrt_losses), torch.tensor(cpu_losses), atol=1e-4, rtol=1e-4)
    for (name, a), (_, b) in zip(cpu_model.state_dict().items(), pjrt_model.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4, msg=name)


def test_cnn_with_batch_norm_training_writes_back_buffers() -> None:
    torch.manual_seed(1)
    data = [(torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))) for _ in range(3)]
    assert_trains_like_cpu(cnn(), data, F.cross_entropy, "forward")


def test_whole_training_step_with_optimizer_compiles() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)]
    assert_trains_like_cpu(model, data, F.cross_entropy, "step")


def test_a_compiled_optimizer_step_keeps_its_step_counts_on_the_device_and_trains_like_cpu() -> None:
    """Dynamo makes an optimizer on pjrt capturable, as on CUDA: AdamW's step counts are pjrt tensors updated inside
    the step's program, and parameters, moments and step counts equal CPU's (default, CPU step counts) each step."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    on_device = copy.deepcopy(model).to("pjrt")
    cpu_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = torch.optim.AdamW(on_device.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(optimizer.step, backend="pjrt")
    for _ in range(3):
        grads = [torch.randn_like(p) for p in model.parameters()]
        for p, q, grad in zip(model.parameters(), on_device.parameters(), grads):
            p.grad, q.grad = grad, grad.to("pjrt")
        cpu_optimizer.step()
        compiled()
        for p, q in zip(model.parameters(), on_device.parameters()):
            torch.testing.assert_close(q.cpu(), p)
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert optimizer.state[q][name].device.type == "pjrt"
                torch.testing.assert_close(optimizer.state[q][name].cpu(), cpu_optimizer.state[p][name])
    assert optimizer.param_groups[0]["capturable"] and not cpu_optimizer.param_groups[0]["capturable"]


def test_transformer_dropout_follows_manual_seed() -> None:
    model = GPT(width=32, layers=1, heads=2, context=16)
    model.blocks[0].mlp.append(nn.Dropout(0.2))
    model = model.to("pjrt").train()
    compiled = torch.compile(model, backend="pjrt")
    tokens, _ = batches(corpus_bytes(), 2, 16, 1)[0]
    tokens = tokens.to("pjrt")
    torch.manual_seed(7)
    first = compiled(tokens).cpu()
    torch.manual_seed(7)
    again = compiled(tokens).cpu()
    other = compiled(tokens).cpu()
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    model.eval()
    with torch.no_grad():
        evaluated = torch.compile(model, backend="pjrt")(tokens).cpu()
        reference = copy.deepcopy(model).cpu()(tokens.cpu())
    torch.testing.assert_close(evaluated, reference, atol=1e-4, rtol=1e-4)


def test_graph_breaks_run_between_graphs() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2
        if y.sum().item() > -1e9:  # data-dependent: a graph break
            y = y + 1
        return y.cos()

    x = torch.randn(5, 5)
    compiled = torch.compile(fn, backend="pjrt")
    torch.testing.assert_close(compiled(x.to("pjrt")).cpu(), fn(x), atol=1e-6, rtol=1e-6)


def test_in_place_update_of_an_input() -> None:
    def fn(state: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        state.mul_(0.9).add_(update)
        return state.sum()

    state, update = torch.randn(6), torch.randn(6)
    pjrt_state = state.to("pjrt")
    total = torch.compile(fn, backend="pjrt", fullgraph=True)(pjrt_state, update.to("pjrt"))
    expected_total = fn(state, update)
    torch.testing.assert_close(pjrt_state.cpu(), state)
    torch.testing.assert_close(total.cpu(), expected_total)


def test_an_input_written_in_place_keeps_its_buffer_unless_another_holder_reads_it() -> None:
    """A mutated input's buffer is donated to the program (a KV cache written each step is not copied); an
    array held elsewhere as well is copied first, so its holder still reads the old values."""
    import numpy as np

    from torch_pjrt.storage import storage_of

    def fn(cache: torch.Tensor, rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        cache.index_put_((where,), rows)
        return cache.sum(0)

    cache, rows, where = torch.randn(64, 8), torch.randn(3, 8), torch.randperm(64)[:3]
    pjrt_cache = cache.to("pjrt")
    compiled = torch.compile(fn, backend="pjrt", fullgraph=True)
    # the first call's array is copied (the CPU client may share an array put from the host with numpy)
    compiled(pjrt_cache, rows.to("pjrt"), where.to("pjrt"))
    fn(cache, rows, where)
    for _ in range(2):
        rows = torch.randn(3, 8)
        buffer = storage_of(pjrt_cache).materialize().unsafe_buffer_pointer()
        total = compiled(pjrt_cache, rows.to("pjrt"), where.to("pjrt"))
        expected = fn(cache, rows, where)
        torch.testing.assert_close(pjrt_cache.cpu(), cache)
        torch.testing.assert_close(total.cpu(), expected)
        assert storage_of(pjrt_cache).materialize().unsafe_buffer_pointer() == buffer
    held = storage_of(pjrt_cache).materialize()
    before = cache.clone()
    compiled(pjrt_cache, rows.to("pjrt"), where.to("pjrt"))
    fn(cache, rows, where)
    torch.testing.assert_close(torch.from_numpy(np.asarray(held)).view(64, 8), before)
    torch.testing.assert_close(pjrt_cache.cpu(), cache)


def test_an_input_held_elsewhere_is_copied_for_its_graph_without_compiling_a_program() -> None:
    """The copy made of a written input that another holder still reads is a put to the same device, not a jax copy
    program traced, lowered and compiled for each new shape (a warm first training step lowered one)."""
    import numpy as np

    from torch_pjrt.compile import backend
    from torch_pjrt.storage import storage_of

    values = torch.randn(37, 3)
    array = storage_of((values.to("pjrt") * 2).reshape(-1)).materialize()
    flats = [array]
    compiles = torch_pjrt.metrics.counters()["compiles"]
    [copied] = backend._donated(flats, [0])
    assert torch_pjrt.metrics.counters()["compiles"] == compiles
    assert flats == [None]
    assert copied.unsafe_buffer_pointer() != array.unsafe_buffer_pointer()
    assert copied.sharding == array.sharding and copied.dtype == array.dtype
    np.testing.assert_array_equal(np.asarray(copied).reshape(-1), (values * 2).reshape(-1).numpy())


def test_cpu_values_in_a_graph_stay_on_the_cpu() -> None:
    """CPU inputs written in place, CPU results of CPU values and device values copied to the CPU."""

    def fn(count: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        count.add_(1)
        decay = 1 - 0.9 ** count
        return x * decay, decay * scale, (x * 2).sum().cpu() + scale

    x, scale = torch.randn(5), torch.randn(())
    count, pjrt_count = torch.tensor(3.0), torch.tensor(3.0)
    compiled = torch.compile(fn, backend="pjrt", fullgraph=True)
    for _ in range(3):
        expected = fn(count, x, scale)
        actual = compiled(pjrt_count, x.to("pjrt"), scale)
        assert [t.device.type for t in actual] == ["pjrt", "cpu", "cpu"]
        torch.testing.assert_close(pjrt_count, count)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a.cpu(), e)


def test_a_foreach_update_of_cpu_inputs_runs_in_place_on_the_host() -> None:
    """An optimizer's `_foreach_add_(state_steps, 1)` on CPU step counts comes back from AOTAutograd as the
    functional op and a copy per tensor; the host runs it as the one in-place op again, with CPU's results."""
    import gc

    from torch_pjrt.compile import backend

    def fn(steps: list[torch.Tensor], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        torch._foreach_add_(steps, 1)
        for param, grad, step in zip(params, grads, steps):
            param.add_(grad * (1 - 0.9 ** step))

    before = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph]  # held: their ids stay theirs
    compiled = torch.compile(fn, backend="pjrt", fullgraph=True)
    steps, params = [torch.tensor(float(n)) for n in range(3)], [torch.randn(4), torch.randn(2, 3), torch.randn(5)]
    pjrt_steps, pjrt_params = [s.clone() for s in steps], [p.to("pjrt") for p in params]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        fn(steps, params, grads)
        compiled(pjrt_steps, pjrt_params, [g.to("pjrt") for g in grads])
        torch.testing.assert_close(pjrt_steps, steps)
        for a, e in zip(pjrt_params, params):
            torch.testing.assert_close(a.cpu(), e)
    [graph] = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph and all(o is not b for b in before)]
    targets = [node.target for node in graph.eager_part.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.aten._foreach_add_.Scalar]


def test_cpu_inputs_of_several_dtypes_and_layouts_reach_the_program_in_order() -> None:
    """The program reads a call's CPU inputs from one array per dtype: each keeps its values, shape and order,
    a transposed one its logical order, and new values the next call (not baked into the program)."""

    def fn(x: torch.Tensor, a: torch.Tensor, n: torch.Tensor, b: torch.Tensor, mask: torch.Tensor,
           c: torch.Tensor) -> torch.Tensor:
        return x * a + n * b.to(x.device) + torch.where(mask.to(x.device), c.to(x.device), x) - a * n

    compiled = torch.compile(fn, backend="pjrt", fullgraph=True)
    for _ in range(2):
        x = torch.randn(2, 3)
        inputs = (torch.randn(()), torch.randint(-5, 5, ()), torch.randn(3), torch.rand(2, 3) > 0.5,
                  torch.randn(3, 2).t())
        torch.testing.assert_close(compiled(x.to("pjrt"), *inputs).cpu(), fn(x, *inputs))



def test_cpu_inputs_of_one_shape_reach_the_program_in_order() -> None:
    """CPU inputs of one dtype and shape (an optimizer's step counts) travel stacked: each keeps its value,
    a transposed one its logical order, and new values the next call."""

    def fn(x: torch.Tensor, s: torch.Tensor, t: torch.Tensor, u: torch.Tensor, m: torch.Tensor,
           n: torch.Tensor) -> torch.Tensor:
        return x * s - t * x + u / 3 + (m.to(x.device) @ n.to(x.device).t()).sum().float() * x

    compiled = torch.compile(fn, backend="pjrt", fullgraph=True)
    for _ in range(2):
        x = torch.randn(2, 3)
        inputs = (torch.randn(()), torch.randn(()), torch.randn(()), torch.randn(2, 3, dtype=torch.float64).t(),
                  torch.randn(3, 2, dtype=torch.float64))
        torch.testing.assert_close(compiled(x.to("pjrt"), *inputs).cpu(), fn(x, *inputs))

def test_a_repeated_signature_replays_natively_and_another_takes_the_python_path() -> None:
    """From its second call a signature replays natively (csrc/graph_call.cpp): a CPU input, an input written
    in place, a view of an input among the outputs keep CPU's results with fresh values each call. Inputs whose
    storage arrays have another shape are another signature of the same graph: that call runs the Python path
    (correct too), and either signature replays natively when it comes again."""
    import gc

    from torch_pjrt.compile import backend, native_call

    def fn(state: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state.mul_(scale).add_(x @ x.t())
        return (state * 2).sum(0), x.t(), scale * 3

    before = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph]  # held: their ids stay theirs
    compiled = torch.compile(fn, backend="pjrt", fullgraph=True)
    for flat in (False, False, True, True, False, True, False):
        state, x, scale = torch.randn(5, 5), torch.randn(5, 5), torch.randn(())
        pjrt_state = state.reshape(25).to("pjrt").view(5, 5) if flat else state.to("pjrt")
        actual = compiled(pjrt_state, x.to("pjrt"), scale)
        expected = fn(state, x, scale)
        torch.testing.assert_close(pjrt_state.cpu(), state)
        assert [a.device.type for a in actual] == ["pjrt", "pjrt", "cpu"]
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a.cpu(), e)
    [graph] = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph and all(o is not b for b in before)]
    plans = [found.native for found in graph.programs.values()]
    assert len(plans) == 2
    if native_call.module() is not None:
        assert [plan.hits for plan in plans] == [3, 2]


def test_signatures_that_alternate_are_each_found_by_their_key_and_replayed_natively() -> None:
    """A graph's native plans are looked up by a summary of the call's inputs: an input at another storage
    offset is another signature with another key, and calls alternating between them each replay natively with
    CPU's values."""
    import gc

    from torch_pjrt.compile import backend, native_call

    before = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph]  # held: their ids stay theirs
    compiled = torch.compile(lambda a, b: a * 2 + b, backend="pjrt", fullgraph=True, dynamic=False)
    keys = {}
    for offset in (0, 1, 0, 1, 1, 0):
        base, b = torch.randn(2, 5), torch.randn(5)
        a = base.to("pjrt")[offset]
        torch.testing.assert_close(compiled(a, b.to("pjrt")).cpu(), base[offset] * 2 + b)
        if native_call.module() is not None:
            keys[offset] = native_call.call_key((a, b.to("pjrt")))
    [graph] = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph and all(o is not b for b in before)]
    assert len(graph.programs) == 2
    if native_call.module() is not None:
        assert keys[0] != keys[1]
        plans = {found.native.signature_key: found.native.hits for found in graph.programs.values()}
        assert plans == {keys[0]: 2, keys[1]: 2}


def test_the_native_replay_takes_pending_fused_results_as_inputs() -> None:
    """In DEFER_AND_FUSE a graph's inputs are often results of ops still recorded; the native replay runs their
    fused program first, as the Python path does, instead of leaving the call to it."""
    import gc

    from torch_pjrt.compile import backend, native_call

    before = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph]  # held: their ids stay theirs
    compiled = torch.compile(lambda x, w: (x @ w).relu(), backend="pjrt", fullgraph=True)
    w = torch.randn(6, 3)
    pjrt_w = w.to("pjrt")
    with torch.pjrt.set_eager_mode("defer_and_fuse"):
        for _ in range(3):
            x = torch.randn(4, 6)
            actual = compiled(x.to("pjrt") * 2 + 1, pjrt_w)
            torch.testing.assert_close(actual.cpu(), ((x * 2 + 1) @ w).relu())
    [graph] = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph and all(o is not b for b in before)]
    if native_call.module() is not None:
        assert [found.native.hits for found in graph.programs.values()] == [2]


def test_a_new_float32_matmul_precision_is_another_signature_for_the_native_replay() -> None:
    """The matmul precision is part of a program's signature: called under another precision, a graph's native
    replay of the old one does not run; the Python path makes the new one's, and each replays its own calls."""
    import gc

    from torch_pjrt.compile import backend, native_call

    before = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph]  # held: their ids stay theirs
    compiled = torch.compile(lambda a, b: a @ b, backend="pjrt", fullgraph=True)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        compiled(torch.randn(8, 16).to("pjrt"), torch.randn(16, 4).to("pjrt"))
        [graph] = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph and all(o is not b for b in before)]
        for precision in ("highest", "medium", "medium", "highest"):
            torch.set_float32_matmul_precision(precision)
            a, b = torch.randn(8, 16), torch.randn(16, 4)
            [product] = graph(a.to("pjrt"), b.to("pjrt"))
            torch.testing.assert_close(product.cpu(), a @ b, atol=5e-2, rtol=5e-2)
    finally:
        torch.set_float32_matmul_precision(previous)
    hits = {found.precision: found.native and found.native.hits for found in graph.programs.values()}
    assert hits == ({"highest": 2, "medium": 1} if native_call.module() is not None else
                    {"highest": None, "medium": None})


def test_the_forward_saves_weights_not_their_transposes_and_gradients_match_cpu() -> None:
    """AOTAutograd's min-cut partition: a linear layer's forward hands its weight itself to the backward, which
    transposes it inside its program, so torch makes no view of it after each forward call."""
    import copy
    import gc

    from torch_pjrt.compile import backend

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    on_device = copy.deepcopy(net).to("pjrt")
    before = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph]  # held: their ids stay theirs
    compiled = torch.compile(lambda x: on_device(x).square().mean(), backend="pjrt", fullgraph=True)
    for _ in range(2):
        x = torch.randn(5, 8)
        net.zero_grad(set_to_none=True)
        on_device.zero_grad(set_to_none=True)
        expected = net(x).square().mean()
        expected.backward()
        actual = compiled(x.to("pjrt"))
        actual.backward()
        torch.testing.assert_close(actual.detach().cpu(), expected.detach())
        for parameter, on_pjrt in zip(net.parameters(), on_device.parameters()):
            torch.testing.assert_close(on_pjrt.grad.cpu(), parameter.grad)
    made = [o for o in gc.get_objects() if type(o) is backend.CompiledGraph and all(o is not b for b in before)]
    [forward] = [graph for graph in made if graph.eager_part is not None]
    assert [node.target for node in forward.eager_part.graph.nodes if node.op == "call_function"] == []


def test_views_of_inputs_alias_them_and_a_graph_of_views_runs_no_program() -> None:
    weight, x = torch.randn(6, 4), torch.randn(3, 4)
    linear = torch.compile(lambda w, x: x @ w.t(), backend="pjrt")
    pjrt_weight = weight.to("pjrt").requires_grad_()
    out = linear(pjrt_weight, x.to("pjrt"))
    out.sum().backward()
    expected_weight = weight.clone().requires_grad_()
    (x @ expected_weight.t()).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), x @ weight.t())
    torch.testing.assert_close(pjrt_weight.grad.cpu(), expected_weight.grad)

    before = torch_pjrt.metrics.counters()["graph_compiles"]
    views = torch.compile(lambda a: (a.detach().t(), a[1:].unsqueeze(0)), backend="pjrt", fullgraph=True)
    a = torch.randn(5, 3).to("pjrt")
    transposed, sliced = views(a)
    assert torch_pjrt.metrics.counters()["graph_compiles"] == before
    assert transposed.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    torch.testing.assert_close(transposed.cpu(), a.cpu().t())
    torch.testing.assert_close(sliced.cpu(), a.cpu()[1:].unsqueeze(0))


def test_export_stablehlo() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    text = torch_pjrt.export_stablehlo(model, (torch.randn(3, 4),))
    assert "func.func public @main" in text and "stablehlo.dot_general" in text
    assert "tensor<3x4xf32>" in text
    exported = torch.export.export(model, (torch.randn(3, 4),))
    assert "stablehlo." in torch_pjrt.export_stablehlo(exported)
    assert "stablehlo.sine" in torch_pjrt.export_stablehlo(lambda x: torch.sin(x) + 1, (torch.randn(2),))


def test_changing_shapes_stay_correct_and_warn_past_the_budget() -> None:
    """Dynamo turns a changing length dynamic; each length is still exact, and past the budget a warning
    names the input, the dimension and the user's line."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).sum(-1)

    compiled = torch.compile(fn, backend="pjrt")
    with pytest.warns(UserWarning, match=r"dim 1 \(9 sizes\).*test_compile.py.*in fn"):
        for length in range(1, 12):
            x = torch.randn(3, length)
            torch.testing.assert_close(compiled(x.to("pjrt")).cpu(), fn(x), atol=1e-5, rtol=1e-5)


def test_recompile_budget_option_and_unknown_options() -> None:
    """options={"recompile_budget": N} moves the warning to N compiles; an option the backend lacks raises."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.cos() + 1

    compiled = torch.compile(fn, backend="pjrt", options={"recompile_budget": 2})
    with pytest.warns(UserWarning, match=r"compiled for 3 input shapes \(budget 2"):
        for length in range(2, 7):
            x = torch.randn(length)
            torch.testing.assert_close(compiled(x.to("pjrt")).cpu(), fn(x))
    with pytest.raises(Exception, match="has no option 'donate'.*recompile_budget"):
        torch.compile(fn, backend="pjrt", options={"donate": True})(torch.randn(3).to("pjrt"))
    with pytest.raises(Exception, match="recompile_budget must be a positive int"):
        torch.compile(fn, backend="pjrt", options={"recompile_budget": 0})(torch.randn(3).to("pjrt"))


def _bounded(tensor: torch.Tensor, dim: int = 1, **bounds) -> torch.Tensor:
    tensor = tensor.to("pjrt")
    torch_pjrt.mark_dynamic(tensor, dim, **bounds)
    return tensor


def test_bounded_length_pads_to_buckets_with_exact_results_and_gradients() -> None:
    """A transformer's loss and every gradient at each length equal CPU's unpadded ones, while the
    graphs compile once per power-of-two bucket, not once per length."""
    torch.manual_seed(0)
    model = GPT(width=32, layers=1, heads=2, context=16)
    on_device = copy.deepcopy(model).to("pjrt")

    def loss(m: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = m(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    compiled = torch.compile(lambda t, y: loss(on_device, t, y), backend="pjrt")
    before = torch_pjrt.metrics.counters()["graph_compiles"]
    for length in (5, 7, 3, 12, 16, 9):
        tokens, targets = torch.randint(0, 256, (3, length)), torch.randint(0, 256, (3, length))
        got = compiled(_bounded(tokens, min=2, max=16), _bounded(targets, min=2, max=16))
        want = loss(model, tokens, targets)
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
        got.backward()
        want.backward()
        for (name, p), q in zip(on_device.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, atol=2e-5, rtol=1e-4, msg=name)
            p.grad = q.grad = None
    # buckets 8, 4 and 16 were used: a forward and a backward graph each
    assert torch_pjrt.metrics.counters()["graph_compiles"] - before == 6


def test_padding_rules_for_reductions_slices_and_concatenation() -> None:
    """Ops that would see the padding (means, softmax over the padded dim, max, var, slices from the
    end, concatenation along it) give the unpadded result at every length."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        attention = torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x
        tail = torch.cat([x[:, 1:], x[:, -1:]], dim=1) - x
        stats = torch.stack([x.mean(1), x.amax(1), x.sum(1)])
        return attention.sum(1) + tail.sum(1) + stats.sum(0) + x[:, -1]

    compiled = torch.compile(fn, backend="pjrt")
    before = torch_pjrt.metrics.counters()["graph_compiles"]
    for length in (3, 6, 7, 8):
        x = torch.randn(2, length, 4)
        torch.testing.assert_close(compiled(_bounded(x, min=3, max=8)).cpu(), fn(x), atol=1e-5, rtol=1e-5)
    assert torch_pjrt.metrics.counters()["graph_compiles"] - before == 2


def test_custom_buckets_and_an_unpaddable_op_falls_back_to_exact_sizes() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * 3).sum(1)

    compiled = torch.compile(fn, backend="pjrt")
    before = torch_pjrt.metrics.counters()["graph_compiles"]
    for length in (3, 5, 9):
        x = torch.randn(2, length)
        got = compiled(_bounded(x, min=2, max=24, buckets=[12, 24]))
        torch.testing.assert_close(got.cpu(), fn(x), atol=1e-5, rtol=1e-5)
    assert torch_pjrt.metrics.counters()["graph_compiles"] - before == 1

    def flipped(x: torch.Tensor) -> torch.Tensor:
        return x.flip(1).cumsum(1)

    compiled = torch.compile(flipped, backend="pjrt")
    with pytest.warns(UserWarning, match="cannot run padded.*flip"):
        for length in (3, 5):
            x = torch.randn(2, length)
            torch.testing.assert_close(compiled(_bounded(x, min=2, max=32)).cpu(), flipped(x))


def test_training_through_a_dynamic_length_returns_sizes_to_the_backward() -> None:
    """Without bounds each length compiles, and the sizes the forward saves for the backward are ints."""
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    on_device = copy.deepcopy(model).to("pjrt")
    compiled = torch.compile(on_device, backend="pjrt")
    for length in (3, 4, 5):
        x = torch.randn(2, length, 4)
        compiled(x.to("pjrt")).sum().backward()
        model(x).sum().backward()
    for p, q in zip(on_device.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5)


def test_views_inside_a_graph_lower_as_their_copies() -> None:
    """select/slice/diagonal in the middle of a graph (not only as aliased outputs)."""
    torch.manual_seed(12)
    x = torch.randn(3, 4, 4)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t[0] * 2 + t[:, 1].sum() + t[1].diagonal().unsqueeze(0) + t.narrow(2, 1, 2).sum(-1, keepdim=True)

    compiled = torch.compile(fn, backend="pjrt", fullgraph=True)
    torch.testing.assert_close(compiled(x.to("pjrt")).cpu(), fn(x))


def test_runtime_asserts_on_symbolic_sizes_compile_and_hold() -> None:
    # torch._check on a dynamic size leaves aten._assert_scalar in the graph (vLLM's logprob ranks do this)
    @torch.compile(backend="pjrt", dynamic=True)
    def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[0] >= 1)
        torch._check(x.shape[0] == values.shape[0])
        return (x >= values).sum(-1)

    for rows in (3, 7):
        x = torch.randn(rows, 50)
        values = x[:, 4:5]
        assert torch.equal(count_at_least(x.to("pjrt"), values.to("pjrt")).cpu(), (x >= values).sum(-1))
    with pytest.raises(RuntimeError, match="Expected cond to be True"):  # Dynamo checks it while tracing, as on CPU
        count_at_least(torch.randn(4, 50, device="pjrt"), torch.randn(3, 1, device="pjrt"))


def test_the_default_backend_compiles_pjrt_graphs_with_pjrt_and_leaves_cpu_graphs_to_inductor() -> None:
    # torch.compile(model) with no backend: Inductor has no pjrt code generator, so pjrt graphs go to backend="pjrt"
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w).sum(-1) * 2

    x, w = torch.randn(5, 8), torch.randn(8, 3)
    compiled = torch.compile(fn)
    graphs = torch_pjrt.metrics.counters()["graph_compiles"]
    torch.testing.assert_close(compiled(x.to("pjrt"), w.to("pjrt")).cpu(), fn(x, w))
    assert torch_pjrt.metrics.counters()["graph_compiles"] == graphs + 1
    torch.testing.assert_close(torch.compile(fn)(x, w), fn(x, w))  # CPU tensors: Inductor, as before
    assert torch_pjrt.metrics.counters()["graph_compiles"] == graphs + 1
    with pytest.warns(UserWarning, match="Inductor's settings do not apply"):
        tuned = torch.compile(fn, mode="max-autotune-no-cudagraphs")
        torch.testing.assert_close(tuned(x.to("pjrt"), w.to("pjrt")).cpu(), fn(x, w))


def test_an_op_with_no_lowering_inside_a_compiled_graph_is_named_with_what_to_do() -> None:
    """Inside one graph's program the eager CPU fallback cannot run the op: the error names it and the remedy
    (that code outside torch.compile), not a bare MissingLowering from the trace."""
    torch._dynamo.reset()

    def distinct_doubled(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._unique(x * 2)[0].sum() + 1

    x = torch.randint(0, 5, (16,)).float()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(distinct_doubled, backend="pjrt", fullgraph=True)
        with pytest.raises(NotImplementedError, match=r"no lowering for aten::_unique\.default .*inside a "
                                                      r"torch\.compile graph.*TORCH_PJRT_CPU_FALLBACK=1"):
            compiled(x.to("pjrt"))
    torch._dynamo.reset()
    with torch_pjrt.cpu_fallback():  # the remedy it names: the same code eagerly
        torch.testing.assert_close(distinct_doubled(x.to("pjrt")).cpu(), distinct_doubled(x))


def test_an_event_recorded_after_a_compiled_graph_waits_for_its_program() -> None:
    from torch_pjrt import storage

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = torch.tanh(x @ x)
        return x

    graph = torch.compile(chain, backend="pjrt")
    x = torch.randn(600, 600) / 30
    graph(x.to("pjrt")).cpu()
    start, end = torch.pjrt.Event(enable_timing=True), torch.pjrt.Event(enable_timing=True)
    start.record()
    out = graph(x.to("pjrt"))
    end.record()
    end.synchronize()
    # the event waited for the graph's program, not for the newest eager op before it
    assert storage.storage_of(out).array.is_ready()
    assert start.elapsed_time(end) > 0.0
    torch.testing.assert_close(out.cpu(), chain(x), rtol=1e-4, atol=1e-5)
