"""Bounded dynamism in eager: tensors marked dynamic are padded to buckets; results equal CPU's and
a new size inside a seen bucket compiles nothing."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torch_pjrt
from torch_pjrt.eager import dynamic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, loss_fn  # noqa: E402

FUSE = torch_pjrt.EagerMode.DEFER_AND_FUSE


def marked(tensor: torch.Tensor, dim: int = 1, max: int = 128) -> torch.Tensor:  # noqa: A002
    """A pjrt copy of a CPU tensor, marked dynamic along `dim` (padded on the way in)."""
    host = tensor.clone()
    torch_pjrt.mark_dynamic(host, dim, max=max)
    return host.to("pjrt")


def compiles() -> float:
    counts = torch_pjrt.metrics.counters()
    return counts["compiles"] + counts["fused_compiles"]


def test_a_marked_tensor_looks_like_its_true_size() -> None:
    x = torch.randn(3, 37, 5)
    d = marked(x)
    info = torch_pjrt.get_dynamism_info(d)
    assert info["dims"] == {1: {"size": 37, "bucket": 64}}
    assert info["storage"]["padded"] == (3, 64, 5)
    assert d.shape == x.shape and d.stride() == x.stride() and d.is_contiguous()
    assert torch.equal(d.cpu(), x)
    assert torch.equal(d[:, 2:7].cpu(), x[:, 2:7])
    assert d.tolist() == x.tolist()
    assert str(d).startswith("tensor(")


def _ops(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> list[torch.Tensor]:
    """Ops a sequence model applies to (batch, length, width) activations."""
    scores = x @ x.transpose(1, 2) / math.sqrt(x.shape[-1])
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
    attention = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ x
    return [
        (x * 2 + 1).sin(), x @ w, F.linear(x, w, w[0]), scores.softmax(-1), attention,
        F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], is_causal=True),
        x.sum(1), x.mean(1), x.amax(1), x.argmax(1), x.logsumexp(1), x.var(1), x.cumsum(1),
        F.layer_norm(x, (x.shape[-1],)), F.embedding(ids, table), F.gelu(x),
        x[:, -1], x[:, -1:], x[:, 1:], x[:, :-1], x[:, 3], x.transpose(1, 2).contiguous(),
        x.reshape(-1, x.shape[-1]).sum(0), torch.cat([x, x[:, :1]], 1), torch.cat([x, x], 1).sum(1),
        x.transpose(0, 1).reshape(x.shape[1], -1), torch.arange(x.shape[1], device=x.device) * 3,
    ]


def test_ops_on_marked_tensors_match_cpu_and_reuse_the_bucket_program() -> None:
    torch.manual_seed(0)
    w, table = torch.randn(16, 16), torch.randn(50, 16)
    seen = []
    for length in (37, 45, 60):
        x, ids = torch.randn(2, length, 16), torch.randint(0, 50, (2, length))
        before = compiles()
        results = _ops(marked(x), w.to("pjrt"), marked(ids), table.to("pjrt"))
        seen.append(compiles() - before)
        for got, want in zip(results, _ops(x, w, ids, table)):
            assert got.shape == want.shape and got.stride() == want.stride()
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    assert seen[1] == 0 and seen[2] == 0, seen
    assert torch_pjrt.metrics.counters()["dynamic_padded_ops"] > 0


def test_in_place_writes_reach_only_true_elements() -> None:
    torch.manual_seed(1)
    for length in (21, 27):
        x = torch.randn(3, length)
        d = marked(x)
        d.add_(1)
        d[:, :-1].mul_(2)
        d[:, -2:] = 7.0
        x.add_(1)
        x[:, :-1].mul_(2)
        x[:, -2:] = 7.0
        assert torch.equal(d.cpu(), x)
        assert torch_pjrt.get_dynamism_info(d)["dims"] == {1: {"size": length, "bucket": 32}}


def test_writes_at_padded_positions_into_a_static_cache() -> None:
    """A static KV cache written at marked positions (index_copy_): padded positions write nothing."""
    torch.manual_seed(9)
    cache = torch.randn(1, 2, 64, 4)
    device_cache = cache.to("pjrt")
    for length in (9, 13):
        positions, source = torch.arange(3, 3 + length), torch.randn(1, 2, length, 4)
        device_cache.index_copy_(2, marked(positions, dim=0, max=64), marked(source, dim=2, max=64))
        cache.index_copy_(2, positions, source)
        assert torch.equal(device_cache.cpu(), cache)
        filled = device_cache.index_fill(2, marked(positions, dim=0, max=64), 5.0)
        assert torch.equal(filled.cpu(), cache.index_fill(2, positions, 5.0))


def test_a_kv_cache_growing_by_one_compiles_once_per_bucket() -> None:
    torch.manual_seed(2)
    prompt = torch.randn(1, 2, 5, 8)
    cache_cpu, cache = prompt, marked(prompt, dim=2)
    per_step = []
    for _ in range(40):
        new = torch.randn(1, 2, 1, 8)
        before = compiles()
        cache = torch.cat([cache, new.to("pjrt")], dim=2)
        query = new.to("pjrt")
        out = F.scaled_dot_product_attention(query, cache, cache)
        per_step.append(compiles() - before)
        cache_cpu = torch.cat([cache_cpu, new], dim=2)
        torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(new, cache_cpu, cache_cpu))
    assert cache.shape == cache_cpu.shape == (1, 2, 45, 8)
    # the cat compiles when the length crosses into a bucket (8 -> 16) and once more inside it
    # (16 -> 16); every later length in the bucket reuses both
    assert sum(1 for n in per_step if n) <= 7, per_step
    assert sum(per_step[-10:]) == 0, per_step


def test_factories_of_a_marked_length_are_padded_but_random_ones_are_not() -> None:
    torch.manual_seed(3)
    for _ in range(2):  # the signature is installed natively while 29 is no marked length
        assert torch_pjrt.get_dynamism_info(torch.arange(29, device="pjrt"))["storage"] is None
    prompt = marked(torch.randn(2, 29))
    positions = torch.arange(29, device="pjrt")
    assert torch_pjrt.get_dynamism_info(positions)["dims"] == {0: {"size": 29, "bucket": 32}}
    assert torch.equal(positions.cpu(), torch.arange(29))
    torch.manual_seed(4)
    noise = torch.randn(29, device="pjrt")
    assert torch_pjrt.get_dynamism_info(noise)["storage"] is None
    torch.manual_seed(4)
    assert torch.equal(noise.cpu(), torch.randn(29, device="pjrt").cpu())
    # once no padded tensor of that length is left, code that comes after is not padded
    del prompt, positions
    assert torch_pjrt.get_dynamism_info(torch.arange(29, device="pjrt"))["storage"] is None


def test_a_padded_gradient_meets_plain_embedding_indices() -> None:
    """Token embeddings (plain) plus position embeddings of a live length (padded): the sum is padded
    again, so the token table's backward gets a padded gradient with plain indices."""
    torch.manual_seed(11)
    prompt = marked(torch.randn(1, 12))
    tokens = torch.randint(0, 40, (2, 12))
    tables = [torch.randn(40, 8), torch.randn(12, 8)]
    grads = {}
    for device in ("cpu", "pjrt"):
        token, position = (t.detach().to(device).requires_grad_() for t in tables)
        x = F.embedding(tokens.to(device), token) + F.embedding(torch.arange(12, device=device), position)
        x.square().sum().backward()
        grads[device] = (token.grad.cpu(), position.grad.cpu())
    del prompt
    for got, want in zip(grads["pjrt"], grads["cpu"]):
        torch.testing.assert_close(got, want)


def test_an_op_without_a_padding_rule_runs_at_true_sizes_with_a_warning() -> None:
    torch.manual_seed(5)
    x = torch.randn(2, 23)
    d = marked(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flipped = d.flip(1)
        split = d.view(2, 23, 1).view(46)
    assert torch.equal(flipped.cpu(), x.flip(1))
    assert torch.equal(split.cpu(), x.reshape(46))
    assert any("cannot run on padded" in str(w.message) for w in caught)
    assert torch_pjrt.metrics.counters()["dynamic_unmaskable"] >= 1


def test_mark_dynamic_on_a_device_tensor() -> None:
    x = torch.randn(4, 19)
    d = x.to("pjrt")
    torch_pjrt.mark_dynamic(d, 1, max=64)
    assert torch_pjrt.get_dynamism_info(d)["storage"]["padded"] == (4, 32)
    assert torch.equal((d * 3).cpu(), x * 3)
    with pytest.raises(ValueError, match="contiguous"):
        torch_pjrt.mark_dynamic(torch.randn(5, 6, device="pjrt").t(), 1, max=64)
    assert dynamic.bucket(19, 64) == 32 and dynamic.bucket(100, 64) is None and dynamic.bucket(1, 64) is None


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_training_over_varying_lengths_matches_cpu_with_bounded_compiles(mode: str) -> None:
    """Compiled: the backward graph takes the forward's saved tensors (held padded, reshaped by
    AOTAutograd) repacked by one program per bucket, so no length inside a seen bucket compiles."""
    torch.manual_seed(6)
    torch_pjrt.metrics.reset()
    cpu = GPT(width=32, layers=1, heads=2, context=64)
    dev = GPT(width=32, layers=1, heads=2, context=64).to("pjrt")
    dev.load_state_dict(cpu.state_dict())
    cpu_opt, dev_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, dev))
    new_programs = []
    step_loss = torch.compile(loss_fn, backend="pjrt") if mode == "compiled" else loss_fn
    with torch.pjrt.set_eager_mode(FUSE if mode == "fused" else torch_pjrt.EagerMode.DEFER_NEVER):
        for length in (20, 27, 18, 31, 24):
            tokens, targets = torch.randint(0, 256, (3, length)), torch.randint(0, 256, (3, length))
            want = loss_fn(cpu, tokens, targets)
            want.backward()
            cpu_opt.step()
            cpu_opt.zero_grad()
            before = compiles()
            got = step_loss(dev, marked(tokens), marked(targets))
            got.backward()
            dev_opt.step()
            dev_opt.zero_grad()
            torch.testing.assert_close(got.item(), want.item(), rtol=1e-5, atol=1e-5)
            new_programs.append(compiles() - before)
    assert new_programs[0] > 0 and sum(new_programs[1:]) == 0, new_programs
    assert torch_pjrt.metrics.counters()["dynamic_unmaskable"] == 0


def one_layer_llama(transformers: Any) -> tuple[Any, Any, Any]:
    """A one-layer Llama's config, the model on CPU and the same weights on pjrt (eval mode)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    cpu = transformers.LlamaForCausalLM(config).eval()
    dev = transformers.LlamaForCausalLM(config).eval()
    dev.load_state_dict(cpu.state_dict())
    return config, cpu, dev.to("pjrt")


def greedy_generates(cpu: Any, dev: Any, lengths: tuple[int, ...], new: int) -> list[int]:
    """Greedy generate() of `new` tokens after random prompts of each length, on CPU and pjrt: the tokens are
    equal, and the programs each pjrt generate compiled are returned."""
    new_programs = []
    for length in lengths:
        ids = torch.randint(1, 64, (1, length))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            want = cpu.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
            before = compiles()
            got = dev.generate(ids.to("pjrt"), attention_mask=mask.to("pjrt"), max_new_tokens=new, do_sample=False,
                               pad_token_id=0)
            new_programs.append(compiles() - before)
        assert torch.equal(got.cpu(), want)
    return new_programs


def test_hugging_face_generate_marks_the_prompt_itself() -> None:
    """generate() on pjrt marks input_ids and attention_mask (integrations.py): no user line."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    new_programs = greedy_generates(*one_layer_llama(transformers)[1:], (9, 13, 11), 4)
    # lengths 9..17 (and their 4 new tokens) stay in the bucket 64: the third prompt compiles only the pad of its inputs
    assert new_programs[2] <= 1, new_programs


def test_hugging_face_generate_starts_in_the_bucket_that_holds_its_new_tokens() -> None:
    """A prompt of 62 and 6 new tokens would cross from bucket 64 into 128 halfway; it starts in 128, so a
    later 100-token prompt finds every program of that bucket (it compiled 50 when the first one crossed)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(8)
    new_programs = greedy_generates(*one_layer_llama(transformers)[1:], (62, 100), 6)
    assert new_programs[1] <= 1, new_programs


def test_pads_of_a_marked_tensor_match_cpu_and_a_pad_up_to_a_bucket_size_is_one_program() -> None:
    torch.manual_seed(12)
    per_length = []
    for length in (19, 23, 21, 26):
        x = torch.randn(2, length)
        d = marked(x)
        before = compiles()
        for pad, fixed in (((0, 64 - length), True), ((2, 3), False), ((1, 1, 0, 2), False)):
            got, want = F.pad(d, pad, value=1.5), F.pad(x, pad, value=1.5)
            assert torch.equal(got.cpu(), want), pad
            assert (torch_pjrt.get_dynamism_info(got)["storage"] is None) == fixed, pad
            torch.testing.assert_close(got.sum(1).cpu(), want.sum(1))
        per_length.append(compiles() - before)
    # lengths 17..32 share bucket 32: after the first, no length compiles a pad or a sum
    assert per_length[1:] == [0, 0, 0], per_length


def test_a_slice_of_a_static_cache_by_a_marked_length_is_read_padded() -> None:
    torch.manual_seed(13)
    cache = torch.randn(2, 64, 8)
    device_cache = cache.to("pjrt")
    per_length = []
    for length in (10, 14, 12):
        q = torch.randn(2, length, 8)
        dq = marked(q)
        before = compiles()
        keys = device_cache[:, :length]  # what transformers' SDPA does with a static cache in prefill
        got = (dq @ keys.transpose(1, 2)).softmax(-1) @ keys
        want = (q @ cache[:, :length].transpose(1, 2)).softmax(-1) @ cache[:, :length]
        torch.testing.assert_close(got.cpu(), want)
        assert torch_pjrt.get_dynamism_info(got)["dims"] == {1: {"size": length, "bucket": 16}}
        per_length.append(compiles() - before)
    assert per_length[2] == 0, per_length


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_window_from_a_marked_length_to_the_end_runs_at_the_rows_size(mode: str) -> None:
    """`mask[:, T:]` of a mask padded to a fixed length (transformers' static-cache check that the
    cache's future slots are masked): the window is read from a traced start, so a new length in a
    seen bucket compiles nothing, and its size E - T is dynamic, bucketed at E."""
    torch.manual_seed(15)
    per_length = []
    with torch.pjrt.set_eager_mode(FUSE if mode == "fused" else torch_pjrt.EagerMode.DEFER_NEVER):
        for length in (21, 27, 24):
            per_length.append(_window_to_the_end(length))
    assert per_length[1:] == [0, 0], per_length


def _window_to_the_end(length: int) -> float:
    """Ops on windows from `length` to the end of a padded mask and of a fixed tensor, checked against
    CPU; the programs they compiled."""
    mask, x = torch.rand(2, length) > 0.4, torch.randn(2, 64, 3)
    dmask, dx = marked(mask, max=64), x.to("pjrt")
    before = compiles()
    padded, want_padded = F.pad(dmask, (0, 64 - length)), F.pad(mask, (0, 64 - length))
    tail, want_tail = ~padded[:, length:], ~want_padded[:, length:]
    assert torch.equal(tail.cpu(), want_tail)
    assert torch_pjrt.get_dynamism_info(tail)["dims"] == {1: {"size": 64 - length, "bucket": 64}}
    assert tail.sum().item() == want_tail.sum().item()
    assert torch.equal((padded[:, length:] | padded[:, :length].any(1, keepdim=True)).cpu(),
                       want_padded[:, length:] | want_padded[:, :length].any(1, keepdim=True))
    got = dx[:, length:] * 2 + 1  # a float tensor, three dims: the window of the middle dim
    torch.testing.assert_close(got.cpu(), x[:, length:] * 2 + 1)
    torch.testing.assert_close(got.softmax(1).cpu(), (x[:, length:] * 2 + 1).softmax(1))
    return compiles() - before


def test_a_window_from_a_marked_length_that_stops_short_of_the_end_stays_exact() -> None:
    torch.manual_seed(16)
    for length in (21, 27):
        mask = torch.rand(2, length) > 0.4
        padded = F.pad(marked(mask, max=64), (0, 64 - length))
        want = F.pad(mask, (0, 64 - length))
        window = padded[:, length:length + 5]
        assert torch_pjrt.get_dynamism_info(window)["storage"] is None
        assert torch.equal((~window).cpu(), ~want[:, length:length + 5])


def test_a_plain_view_that_cannot_be_read_padded_adds_no_length_to_the_call() -> None:
    """A plain tensor whose size is a live length but whose storage ends there is read as it is; the
    length it was checked for must not join the call's traced sizes (a new program per such call)."""
    torch.manual_seed(17)
    x, plain = torch.randn(2, 20), torch.randn(2, 27)
    dplain = plain.to("pjrt")
    torch.testing.assert_close(torch.cat([marked(x), dplain], 1).cpu(), torch.cat([x, plain], 1))
    other = marked(torch.randn(2, 27))  # 27 is now a live length too
    x = torch.randn(2, 21)  # a new length in the same bucket: not replayed natively, no new program
    before = compiles()
    torch.testing.assert_close(torch.cat([marked(x), dplain], 1).cpu(), torch.cat([x, plain], 1))
    assert compiles() == before
    del other


def test_hugging_face_generate_with_a_static_cache_compiles_little_per_new_length() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(14)
    config, cpu, dev = one_layer_llama(transformers)
    new_programs = []
    for length in (9, 13, 11, 12):
        ids = torch.randint(1, 64, (1, length))
        options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            want = cpu.generate(ids, attention_mask=torch.ones_like(ids), **options,
                                past_key_values=transformers.StaticCache(config=config, max_cache_len=64))
            before = compiles()
            got = dev.generate(ids.to("pjrt"), attention_mask=torch.ones_like(ids).to("pjrt"), **options,
                               past_key_values=transformers.StaticCache(config=config, max_cache_len=64))
            new_programs.append(compiles() - before)
        assert torch.equal(got.cpu(), want)
    # the mask padded up to the cache length, its windows before and after the length, and the
    # prefill's slice of the cache run their bucket's program: a new length compiles nothing
    assert new_programs[2:] == [0, 0], new_programs


def test_a_compiled_graph_takes_and_returns_padded_tensors_without_per_length_programs() -> None:
    torch.manual_seed(8)
    weight = torch.randn(8, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x @ weight.to(x.device)).softmax(1) * 2

    compiled = torch.compile(fn, backend="pjrt")
    new_programs = []
    for length in (20, 27, 23, 30):
        x = torch.randn(3, length, 8)
        torch_pjrt.mark_dynamic(x, 1, min=2, max=64)
        before = torch_pjrt.metrics.counters()["compiles"]
        got = compiled(x.to("pjrt"))
        assert torch_pjrt.get_dynamism_info(got)["dims"] == {1: {"size": length, "bucket": 32}}
        torch.testing.assert_close(got.cpu(), fn(x))
        new_programs.append(torch_pjrt.metrics.counters()["compiles"] - before)
    assert sum(new_programs[1:]) == 0, new_programs


STORED_FORMS = """
import sys, torch, torch_pjrt
sys.path.insert(0, {tests!r})
from test_dynamic import _ops, marked
mode, seed = sys.argv[1], int(sys.argv[2])
if mode == "fused":
    torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
torch.manual_seed(seed)
w, table = torch.randn(16, 16), torch.randn(50, 16)
for length in (37, 45):
    x, ids = torch.randn(2, length, 16), torch.randint(0, 50, (2, length))
    d = marked(x)
    d.add_(1)
    d[:, -2:] = 7.0
    x.add_(1)
    x[:, -2:] = 7.0
    for got, want in zip(_ops(d, w.to("pjrt"), marked(ids), table.to("pjrt")), _ops(x, w, ids, table)):
        assert got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
counts = torch_pjrt.metrics.counters()
print(counts["form_store_hits"], counts["form_store_writes"], counts["compiles"] + counts["fused_compiles"])
"""


def _stored_forms_run(folder: Path, mode: str, seed: int) -> list[int]:
    script = STORED_FORMS.format(tests=str(Path(__file__).resolve().parent))
    result = subprocess.run([sys.executable, "-c", script, mode, str(seed)], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(folder)})
    assert result.returncode == 0, result.stderr[-3000:]
    return [int(float(n)) for n in result.stdout.split()[-3:]]


def test_padded_forms_stored_in_the_cache_folder_serve_later_processes(tmp_path: Path) -> None:
    """A padded op's form (its results' sizes as functions of the lengths) is stored: a later process reads it
    instead of running the meta kernels on symbolic sizes; where the op must be traced anyway (its executable
    gone, or fused into a new program) the graph is made then from the same call pattern, results still CPU's."""
    hits, writes, _ = _stored_forms_run(tmp_path, "strict", 1)
    assert hits == 0 and writes > 0
    stored = len(list((tmp_path / "forms").iterdir()))
    assert stored == writes
    hits, writes, compiles = _stored_forms_run(tmp_path, "strict", 2)
    assert hits == stored and writes == 0 and compiles == 0
    for kind in ("xla", "executables", "op_checks", "preload"):
        shutil.rmtree(tmp_path / kind, ignore_errors=True)
    hits, writes, compiles = _stored_forms_run(tmp_path, "fused", 3)
    assert hits > 0 and writes == 0 and compiles > 0


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_attention_whose_mask_alone_is_padded_pads_queries_and_keys_to_it_with_cpus_values(mask_dtype) -> None:
    """A marked (padded) attention mask against queries and keys of a fixed length (TRL's GRPO generation
    met it): they are padded to the mask's bucket (no warning that the op runs at its true sizes), and the
    output and every gradient, the float mask's included, equal CPU's."""
    q, k, v = (torch.randn(2, 4, 10, 8, requires_grad=True) for _ in range(3))
    if mask_dtype == torch.bool:
        mask = torch.rand(2, 1, 10, 10) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(2, 1, 10, 10, requires_grad=True)
    marked = mask.detach().to("pjrt").requires_grad_(mask.requires_grad)
    torch_pjrt.mark_dynamic(marked, 2, min=2, max=64)
    torch_pjrt.mark_dynamic(marked, 3, min=2, max=64)
    on_device = [t.detach().to("pjrt").requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = F.scaled_dot_product_attention(*on_device, attn_mask=marked)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(found.cpu(), want)
    grad = torch.randn_like(want)
    found.backward(grad.to("pjrt"))
    want.backward(grad)
    pairs = list(zip(on_device, (q, k, v))) + ([(marked, mask)] if mask.requires_grad else [])
    for got, expected in pairs:
        torch.testing.assert_close(got.grad.cpu(), expected.grad, atol=1e-5, rtol=1e-4)
