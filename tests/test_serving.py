"""vLLM serving on pjrt through the platform plugin (torch_pjrt.serving.vllm).

Needs vLLM (`make test-serving` builds its own environment); skipped where vLLM is not importable, as in
the main `make test` environment. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so
the test can reach the worker and switch eager modes around a call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", exc_type=ImportError)
transformers = pytest.importorskip("transformers")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from torch_pjrt.eager.modes import EagerMode  # noqa: E402
from torch_pjrt.serving.vllm.attention import padded_context_length, padded_token_count  # noqa: E402

MAX_MODEL_LEN = 128
NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 11, 17, 40)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with random weights (head_dim 32, grouped-query attention), saved locally."""
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Any:
    return LLM(
        model=str(tiny_llama),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 24,
    )


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _serve(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama: Path) -> list[list[int]]:
    """Hugging Face greedy generate() on CPU with the same weights, one prompt at a time."""
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokens = []
    for prompt in _prompts():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def _worker(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def test_the_plugin_picks_pjrt_and_holds_weights_and_cache_there(llm: Any) -> None:
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "PjrtPlatform" and current_platform.device_type == "pjrt"
    runner = _worker(llm).model_runner
    assert next(runner.model.parameters()).device.type == "pjrt"
    assert runner.kv_caches and all(cache.device.type == "pjrt" for cache in runner.kv_caches)


def test_kv_cache_views_share_one_buffer_of_their_own_dtype(llm: Any) -> None:
    # vLLM allocates an int8 buffer; torch-pjrt writes into a view in place only when the dtypes match.
    from torch_pjrt.storage import storage_of

    caches = _worker(llm).model_runner.kv_caches
    assert len({cache.untyped_storage()._cdata for cache in caches}) == 1
    assert all(storage_of(cache).dtype == cache.dtype == torch.float32 for cache in caches)


def test_greedy_tokens_equal_hugging_face_on_cpu_strict(llm: Any, reference_tokens: list[list[int]]) -> None:
    # One batch holds prompts of four lengths: prefills and decodes share steps.
    assert _serve(llm, _prompts()) == reference_tokens


def test_greedy_tokens_equal_hugging_face_on_cpu_fused(llm: Any, reference_tokens: list[list[int]]) -> None:
    with torch.pjrt.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        assert _serve(llm, _prompts()) == reference_tokens


def test_seeded_sampling_is_reproducible(llm: Any) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=NEW_TOKENS, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts()[:2]]
    first, second = (llm.generate(prompts, params, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_prompt_longer_than_max_model_len_gets_vllms_error_and_the_engine_keeps_serving(
    llm: Any, reference_tokens: list[list[int]]
) -> None:
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="maximum context length"):
        _serve(llm, [list(range(3, 3 + MAX_MODEL_LEN + 10))])
    assert _serve(llm, _prompts()[:1]) == reference_tokens[:1]


def test_padded_context_length_is_a_power_of_two_within_the_table() -> None:
    assert [padded_context_length(n, 16, 128) for n in (1, 16, 17, 33, 100, 128)] == [16, 16, 32, 64, 128, 128]


def test_padded_token_count_is_a_power_of_two_from_eight() -> None:
    assert [padded_token_count(n) for n in (1, 8, 9, 33, 512)] == [8, 8, 16, 64, 512]


QWEN3_IN_A_NEW_PROCESS = """
import sys, torch, transformers
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder = sys.argv[1]
config = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
torch.manual_seed(0)
model = transformers.Qwen3ForCausalLM(config).eval()
model.save_pretrained(folder)
prompts = [[(5 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 13, 30))]
expected = []
for p in prompts:
    ids = torch.tensor([p])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected.append(out[0, len(p):].tolist())
llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
          max_num_seqs=4, kv_cache_memory_bytes=1 << 24)
params = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
print("EQUAL", [list(o.outputs[0].token_ids) for o in outputs] == expected)
"""


def test_qwen3_greedy_tokens_equal_hugging_face_on_cpu(tmp_path: Path) -> None:
    # A second architecture (q/k norms), in a process of its own: one vLLM engine per process here.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", QWEN3_IN_A_NEW_PROCESS, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert "EQUAL True" in done.stdout, done.stderr[-3000:]
