"""vLLM serving on pjrt through the platform plugin (torch_pjrt.serving.vllm).

Needs vLLM (`make test-serving` builds its own environment); skipped where vLLM is not importable, as in
the main `make test` environment. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so
the test can reach the worker and switch eager modes around a call.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
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
from torch_pjrt.serving.vllm.attention import (  # noqa: E402
    PjrtAttentionMetadata,
    kernel_inputs_of,
    padded_context_length,
    padded_token_count,
)

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
    _save_character_tokenizer(folder, config.vocab_size)
    return folder


def _save_character_tokenizer(folder: Path, vocab_size: int) -> None:
    """One token per printable character (ids 3..97; 0-2 unk, bos, eos as the config says), the rest unused:
    enough text for structured outputs and bad words, built here (nothing is downloaded)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for piece in [*string.printable[:95], *(f"<unused_{i}>" for i in range(vocab_size))]:
        if len(vocab) < vocab_size:
            vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    chat = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    chat += "{% if add_generation_prompt %}[assistant] {% endif %}"
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", chat_template=chat
    ).save_pretrained(folder)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Any:
    """An engine with the platform's defaults (async scheduling among them, whatever this shell sets)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TORCH_PJRT_VLLM_ASYNC_SCHEDULING", raising=False)
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
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _hugging_face_greedy(folder: Path, new_tokens: int, prompts: list[list[int]] | None = None) -> list[list[int]]:
    """Hugging Face greedy generate() on CPU with the same weights, one prompt at a time (_prompts() by default)."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = []
    for prompt in _prompts() if prompts is None else prompts:
        ids = torch.tensor([prompt])
        # min_new_tokens bans EOS as vLLM's min_tokens does (the tiny model's EOS, 2, can win a step)
        lengths = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **lengths)
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


TEXT_PROMPTS = ("Once upon a time", "def main():")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def _hugging_face_greedy_texts(folder: Path) -> list[str]:
    """What Hugging Face's greedy generate() writes after each text prompt and after the chat, in the chat
    template (its tokenizer, its decoding)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = []
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    for prompt in (*TEXT_PROMPTS, chat):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama: Path) -> list[list[int]]:
    return _hugging_face_greedy(tiny_llama, NEW_TOKENS)


def _worker(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def test_the_plugin_picks_pjrt_and_holds_weights_and_cache_there(llm: Any) -> None:
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "PjrtPlatform" and current_platform.device_type == "pjrt"
    runner = _worker(llm).model_runner
    assert next(runner.model.parameters()).device.type == "pjrt"
    assert runner.kv_caches and all(cache.device.type == "pjrt" for cache in runner.kv_caches)


def test_kv_cache_views_share_one_buffer_of_their_own_dtype(llm: Any) -> None:
    # vLLM asks for an int8 buffer; the plugin makes it a view of one in the layers' dtype, which the
    # paged-attention kernel takes whole, unreinterpreted.
    from torch_pjrt.storage import storage_of

    caches = _worker(llm).model_runner.kv_caches
    assert len({cache.untyped_storage()._cdata for cache in caches}) == 1
    assert all(storage_of(cache).dtype == cache.dtype == torch.float32 for cache in caches)


def test_a_default_engine_schedules_asynchronously_and_gives_hugging_faces_tokens(
    llm: Any, reference_tokens: list[list[int]]
) -> None:
    """vLLM's async scheduling is the platform's default (as vLLM's on GPUs): the engine schedules step N+1
    before step N's tokens reach the host, and the tokens are Hugging Face's."""
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    assert _worker(llm).model_runner.use_async_scheduling
    assert _serve(llm, _prompts()) == reference_tokens


@pytest.mark.parametrize("variable", [None, "", "1", "0"])
@pytest.mark.parametrize("speculative", [False, True])
def test_async_scheduling_falls_back_for_speculative_decoding_warning_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, variable: str | None, speculative: bool
) -> None:
    """The platform keeps vLLM's async scheduling unless TORCH_PJRT_VLLM_ASYNC_SCHEDULING=0 or speculative
    decoding needs the synchronous scheduler; that fallback warns only when the variable asked for it."""
    from types import SimpleNamespace

    from torch_pjrt.serving.vllm import platform

    if variable is None:
        monkeypatch.delenv("TORCH_PJRT_VLLM_ASYNC_SCHEDULING", raising=False)
    else:
        monkeypatch.setenv("TORCH_PJRT_VLLM_ASYNC_SCHEDULING", variable)
    logged: list[str] = []
    monkeypatch.setattr(platform.logger, "warning", lambda *args: logged.append("warning"))
    monkeypatch.setattr(platform.logger, "info", lambda *args: logged.append("info"))
    for vllms in (True, False):  # vLLM's own choice, after its checks (a user's async_scheduling=False among them)
        logged.clear()
        config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=vllms),
                                 speculative_config=SimpleNamespace(method="draft_model") if speculative else None)
        kept = platform._async_scheduling(config)
        assert kept == (vllms and variable != "0" and not speculative)
        fell_back = vllms and variable != "0" and speculative
        assert logged == ([("warning" if variable == "1" else "info")] if fell_back else [])


def test_greedy_tokens_equal_hugging_face_on_cpu_strict(llm: Any, reference_tokens: list[list[int]]) -> None:
    # One batch holds prompts of four lengths: prefills and decodes share steps.
    assert _serve(llm, _prompts()) == reference_tokens


def test_greedy_tokens_equal_hugging_face_on_cpu_fused(llm: Any, reference_tokens: list[list[int]]) -> None:
    with torch.pjrt.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        assert _serve(llm, _prompts()) == reference_tokens


@pytest.mark.parametrize("mode", [EagerMode.DEFER_NEVER, EagerMode.DEFER_AND_FUSE])
def test_the_paged_attention_kernel_gives_hugging_faces_tokens(
    llm: Any, reference_tokens: list[list[int]], mode: EagerMode
) -> None:
    # TORCH_PJRT_PAGED_ATTENTION=1 for one call: the attention reads the cache through the Pallas kernel.
    from torch_pjrt.kernels import paged
    from torch_pjrt.runtime.metrics import op_counts

    calls = op_counts["torch_pjrt.paged_attention.default"]
    with paged.switch.scoped(True), torch.pjrt.set_eager_mode(mode):
        assert _serve(llm, _prompts()) == reference_tokens
    assert op_counts["torch_pjrt.paged_attention.default"] - calls >= 2 * NEW_TOKENS  # 2 layers a step


def test_seeded_sampling_is_reproducible(llm: Any) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=NEW_TOKENS, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts()[:2]]
    first, second = (llm.generate(prompts, params, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def _torch_greedy_without_stop(folder: Path, new_tokens: int,
                               prompts: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy tokens of Hugging Face's model on CPU, each the argmax of the last position's logits, never
    stopping at EOS (vLLM's ignore_eos); of _prompts() by default."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = []
    for prompt in _prompts() if prompts is None else prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(new_tokens):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        tokens.append(ids[0, len(prompt):].tolist())
    return tokens


def test_greedy_steps_take_the_argmax_in_one_program_and_bring_back_only_token_ids(
    llm: Any, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy requests with no logits processor acting: each step's sampled rows, lm head and argmax run in
    one program after the forward's and only the token ids come back; with logprobs asked, the sampled rows'
    logits come back instead (vLLM's sampler needs them), the same tokens either way."""
    runner = _worker(llm).model_runner
    # under async scheduling (the default) the tokens stay on the device until the engine asks for the step's
    # output (TokensCopiedLater copies just them); synchronously they come back at once
    tokens_on = "pjrt" if runner.use_async_scheduling else "cpu"
    sample_in_program = runner._sample_in_program
    kinds: list[str] = []

    def recorded(*args: Any) -> Any:
        sampled = sample_in_program(*args)
        kinds.append("none" if sampled is None else "tokens" if sampled.tokens is not None else "logits")
        if sampled is not None and sampled.tokens is not None:
            assert sampled.tokens.device.type == tokens_on and sampled.tokens.dim() == 1
            assert sampled.tokens.dtype == torch.int32
        return sampled

    monkeypatch.setattr(runner, "_sample_in_program", recorded)
    expected = _torch_greedy_without_stop(tiny_llama, NEW_TOKENS)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts()]
    for logprobs, kind in ((None, "tokens"), (2, "logits")):
        kinds.clear()
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs,
                                detokenize=False)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        assert len(kinds) >= NEW_TOKENS and set(kinds) == {kind}
        assert all((o.outputs[0].logprobs is None) == (logprobs is None) for o in outputs)


SAMPLED_IN_A_NEW_PROCESS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
from vllm.sampling_params import StructuredOutputsParams
folder, prompts = sys.argv[1], [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])]
llm = LLM(model=folder, enforce_eager=True, dtype="float32", max_model_len=128, max_num_seqs=4,
          kv_cache_memory_bytes=1 << 24)
sampled_on = set()
if current_platform.device_type == "pjrt":
    sampler = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.sampler
    forward = sampler.forward
    def recorded(logits, sampling_metadata, **kwargs):
        sampled_on.add(logits.device.type)
        return forward(logits, sampling_metadata, **kwargs)
    sampler.forward = recorded
def serve(max_tokens=8, per_prompt=None, **params):
    asked = per_prompt or SamplingParams(max_tokens=max_tokens, **params)
    outputs = llm.generate(prompts, asked, use_tqdm=False)
    def logprobs(entries):
        return [sorted((token, entry.logprob) for token, entry in step.items()) for step in entries if step]
    return [{"tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
             "logprobs": logprobs(o.outputs[0].logprobs or []), "prompt_logprobs": logprobs(o.prompt_logprobs or [])}
            for o in outputs]
def constrained(**constraint):
    return SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(**constraint))
def structured(**constraint):
    return serve(per_prompt=constrained(**constraint))
shaped = serve(temperature=0, min_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
               logit_bias={5: 3.0, 17: -2.0}, logprobs=4, prompt_logprobs=3)
allowed = serve(temperature=0, allowed_token_ids=list(range(40, 90)), min_p=0.2)
banned = serve(temperature=0, bad_words=["A", "1", ","])
choice = structured(choice=["yes", "no", "maybe"])
pattern = structured(regex=r"[0-9]{3}-[a-z]{2}")
plain = SamplingParams(max_tokens=24, temperature=0)
# the bitmask for some rows of the batch only
mixed = serve(per_prompt=[constrained(choice=["yes", "no"]), plain, constrained(regex=r"[a-z]{4}"), plain])
narrowed = serve(temperature=0.8, top_k=1, seed=3)
seeded = [serve(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=7) for _ in range(2)]
unseeded = serve(temperature=1.0, top_p=0.95)
print("RESULT " + json.dumps({"shaped": shaped, "allowed": allowed, "narrowed": narrowed, "seeded": seeded,
                              "banned": banned, "choice": choice, "pattern": pattern, "mixed": mixed,
                              "unseeded": unseeded, "greedy": serve(temperature=0), "sampled_on": sorted(sampled_on)}))
"""


def _sampled_in_a_new_process(folder: Path, **env: str) -> dict:
    command = [sys.executable, "-c", SAMPLED_IN_A_NEW_PROCESS, str(folder), json.dumps(_prompts())]
    done = subprocess.run(command, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env),
                          capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    return json.loads(results[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def sampled_on_vllms_cpu_platform(tiny_llama: Path) -> dict:
    return _sampled_in_a_new_process(tiny_llama, VLLM_PLUGINS="")  # no plugin named: vLLM's own CPU platform


def _assert_equal_logprobs(found: list, expected: list) -> None:
    assert [[token for token, _ in step] for step in found] == [[token for token, _ in step] for step in expected]
    values = [value for step in found for _, value in step]
    assert values == pytest.approx([value for step in expected for _, value in step], abs=1e-4)


@pytest.mark.parametrize("place", ["device", "host"])
def test_sampling_options_give_vllms_cpu_platforms_tokens_and_logprobs(
    tiny_llama: Path, sampled_on_vllms_cpu_platform: dict, place: str
) -> None:
    """Penalties, logit bias, min_tokens, allowed tokens, bad words, min_p, top-k, logprobs and structured
    outputs (choice, regex) through vLLM's sampler, run on the pjrt device or on the host
    (TORCH_PJRT_VLLM_SAMPLING), against vLLM's CPU platform."""
    found = _sampled_in_a_new_process(tiny_llama, TORCH_PJRT_VLLM_SAMPLING=place)
    expected = sampled_on_vllms_cpu_platform
    assert found["sampled_on"] == (["pjrt"] if place == "device" else ["cpu"])
    for name in ("shaped", "allowed", "narrowed", "banned", "choice", "pattern", "mixed"):
        assert [r["tokens"] for r in found[name]] == [r["tokens"] for r in expected[name]], name
    assert all(r["text"] in ("yes", "no", "maybe") for r in found["choice"])
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", r["text"]) for r in found["pattern"])
    assert found["mixed"][0]["text"] in ("yes", "no") and re.fullmatch("[a-z]{4}", found["mixed"][2]["text"])
    banned_ids = {string.printable.index(c) + 3 for c in "A1,"}  # the tokenizer's ids of the bad words
    assert banned_ids & {t for r in found["greedy"] for t in r["tokens"]}  # greedy picks them
    assert not banned_ids & {t for r in found["banned"] for t in r["tokens"]}
    assert [r["tokens"] for r in found["narrowed"]] == [r["tokens"] for r in found["greedy"]]  # top_k=1 is greedy
    assert [r["tokens"] for r in found["shaped"]] != [r["tokens"] for r in found["greedy"]]
    assert all(40 <= t < 90 for r in found["allowed"] for t in r["tokens"])
    for request, reference in zip(found["shaped"], expected["shaped"]):
        assert len(request["logprobs"]) == 8 and len(request["prompt_logprobs"]) == len(reference["prompt_logprobs"])
        _assert_equal_logprobs(request["logprobs"], reference["logprobs"])
        _assert_equal_logprobs(request["prompt_logprobs"], reference["prompt_logprobs"])
    first, second = found["seeded"]
    assert [r["tokens"] for r in first] == [r["tokens"] for r in second]
    # random draws (seeded or not) leave greedy's path: the tiny model's distributions are nearly flat
    assert [r["tokens"] for r in first] != [r["tokens"] for r in found["greedy"]]
    assert [r["tokens"] for r in found["unseeded"]] != [r["tokens"] for r in found["greedy"]]


def test_sampling_runs_on_the_device_but_on_the_cpu_client_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_pjrt.serving.vllm.worker import samples_on_device

    accelerator = torch.pjrt.get_device_properties(0).platform != "cpu"
    for place, expected in (("", accelerator), ("auto", accelerator), ("device", True), ("Host", False)):
        monkeypatch.setenv("TORCH_PJRT_VLLM_SAMPLING", place)
        assert samples_on_device(torch.device("pjrt", 0)) is expected
    monkeypatch.setenv("TORCH_PJRT_VLLM_SAMPLING", "gpu")
    with pytest.raises(ValueError, match="TORCH_PJRT_VLLM_SAMPLING='gpu' is not one of auto, device, host"):
        samples_on_device(torch.device("pjrt", 0))


def test_prompt_longer_than_max_model_len_gets_vllms_error_and_the_engine_keeps_serving(
    llm: Any, reference_tokens: list[list[int]]
) -> None:
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="maximum context length"):
        _serve(llm, [list(range(3, 3 + MAX_MODEL_LEN + 10))])
    assert _serve(llm, _prompts()[:1]) == reference_tokens[:1]


def test_padded_context_length_is_a_power_of_two_within_the_table() -> None:
    assert [padded_context_length(n, 16, 128) for n in (1, 16, 17, 33, 100, 128)] == [16, 16, 32, 64, 128, 128]


def test_the_kernels_int32_inputs_are_converted_once_a_step_for_all_layers() -> None:
    tokens, pages = 8, 4
    tables = torch.randint(1, 64, (tokens, pages))
    positions = torch.randint(0, pages * 16, (tokens,))
    device = torch.device("pjrt", 0)
    meta = PjrtAttentionMetadata(
        num_actual_tokens=tokens, token_ids=torch.zeros(tokens, dtype=torch.long, device=device),
        token_ids_host=None, positions_host=None, slots=positions.to(device), positions=positions.to(device),
        block_tables=tables.to(device), block_size=16, kernel=True)
    first, second = kernel_inputs_of(meta), kernel_inputs_of(meta)  # two layers of one step
    assert first[0] is second[0] and first[1] is second[1]
    assert first[0].dtype == first[1].dtype == torch.int32
    assert torch.equal(first[0].cpu(), tables.to(torch.int32))
    assert torch.equal(first[1].cpu(), (positions + 1).to(torch.int32))


def test_padded_token_count_is_a_power_of_two_from_eight() -> None:
    assert [padded_token_count(n) for n in (1, 8, 9, 33, 512)] == [8, 8, 16, 64, 512]


# Shrunk configs with random weights: 2 layers, hidden size 128, 4 query heads of head_dim 32 on 2 KV heads
# (32 is a head size vLLM's CPU attention takes too), vocabulary 256; what each architecture adds on top.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2": {},  # q/k/v biases
    "qwen3": {},  # q/k norms
    "mistral": {"sliding_window": 16},  # shorter than the longest prompt: the window masks
    "gemma": {},  # (1 + w) RMS norms, a scaled embedding, tied weights
    # alternating sliding-window and global layers, soft-capped attention and final logits
    "gemma2": {"sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 32},
    # partial rotary embedding; its defaults' special tokens (32000) are outside the vocabulary
    "phi3": {"partial_rotary_factor": 0.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},  # top-2 of 4 experts, renormalized
    # top-2 of 4 experts, not renormalized, and a gated shared expert
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 128},
}

ARCHITECTURE_IN_A_NEW_PROCESS = """
import gc, json, sys, torch, transformers
from vllm import LLM, SamplingParams
from vllm.compilation.counter import compilation_counter
from vllm.inputs import TokensPrompt
folder, model_type, overrides, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
shrunk = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
config = transformers.AutoConfig.for_model(model_type, **{**shrunk, **overrides})
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config).eval()
model.save_pretrained(folder)
expected = []
for p in prompts:
    ids = torch.tensor([p])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected.append(out[0, len(p):].tolist())
result = {"expected": expected}
params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, detokenize=False)
for mode, enforce_eager in (("strict", True), ("compiled", False)):
    traced = compilation_counter.num_graphs_seen
    llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=enforce_eager, dtype="float32",
              max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=1 << 24)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result[mode] = [list(o.outputs[0].token_ids) for o in outputs]
    result[mode + "_traced"] = compilation_counter.num_graphs_seen - traced
    llm.llm_engine.engine_core.shutdown()
    del llm, outputs
    gc.collect()
print("RESULT " + json.dumps(result))
"""


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_architecture_gives_hugging_faces_greedy_tokens_strict_and_compiled(model_type: str, tmp_path: Path) -> None:
    """One batch of four prompts (5..40 tokens) through a shrunk random model of each architecture: vLLM's
    greedy tokens with enforce_eager=True and on vLLM's compile path equal Hugging Face generate() on CPU.
    Both engines in one process of its own (one after the other), so each architecture starts vLLM once."""
    command = [sys.executable, "-c", ARCHITECTURE_IN_A_NEW_PROCESS, str(tmp_path), model_type,
               json.dumps(ARCHITECTURES[model_type]), json.dumps(_prompts())]
    done = subprocess.run(command, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                          capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT ") :])
    assert result["strict"] == result["expected"]
    assert result["compiled"] == result["expected"]
    assert result["strict_traced"] == 0 and result["compiled_traced"] == 1  # the compiled engine traced the model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _start_server(model: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """`vllm serve` through torch_pjrt's CLI entry, in a process group of its own; waits until /health answers."""
    port = _free_port()
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default engine
    command = [sys.executable, "-m", "torch_pjrt.serving.vllm.cli", "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len",
               str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(1 << 24), *extra]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return server, url
        except OSError:
            time.sleep(2)
    _stop_server(server)
    raise AssertionError(f"the server did not come up (exit code {server.returncode}):\n{log.read_text()[-4000:]}")


def _stop_server(server: Any) -> None:
    """SIGINT as from a terminal; the server and its engine process must exit within a minute."""
    group = server.pid
    if server.poll() is None:
        os.killpg(group, signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)
        raise
    for _ in range(30):
        try:
            os.killpg(group, 0)  # a process of the group (the engine core) still alive?
        except ProcessLookupError:
            return
        time.sleep(1)
    os.killpg(group, signal.SIGKILL)
    raise AssertionError("the server exited but left processes of its group running")


def test_openai_server_serves_concurrent_completions_of_tokens_and_text_equal_to_hugging_face(
    tiny_llama: Path, reference_tokens: list[list[int]], tmp_path: Path
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    log = tmp_path / "server.log"
    server, url = _start_server(tiny_llama, log)
    try:
        with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
            bodies = [
                dict(
                    model=str(tiny_llama),
                    prompt=p,
                    max_tokens=NEW_TOKENS,
                    min_tokens=NEW_TOKENS,
                    temperature=0,
                    return_token_ids=True,
                )
                for p in _prompts()
            ]
            texts = [dict(bodies[0], prompt=text) for text in TEXT_PROMPTS]
            answers = list(pool.map(lambda body: _post(url + "/v1/completions", body, 300), bodies + texts))
        chat = dict(model=str(tiny_llama), messages=CHAT, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
        reply = _post(url + "/v1/chat/completions", chat, 300)["choices"][0]["message"]["content"]
        assert [a["choices"][0]["token_ids"] for a in answers[: len(bodies)]] == reference_tokens
        texts = [a["choices"][0]["text"] for a in answers[len(bodies) :]]
        assert [*texts, reply] == _hugging_face_greedy_texts(tiny_llama)
        assert "device_config=pjrt" in log.read_text()  # the engine process's config names the device
    finally:
        _stop_server(server)
    assert server.returncode is not None


def test_the_moe_layer_refuses_routing_it_would_not_honour() -> None:
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from torch_pjrt.serving.vllm.moe import PjrtFusedMoEMethod

    layer = SimpleNamespace(use_grouped_topk=True, custom_routing_function=None, e_score_correction_bias=None,
                            expert_map=None, apply_router_weight_on_input=False, routing_sink=None,
                            scoring_func="softmax", activation=MoEActivation.RELU2)
    method = object.__new__(PjrtFusedMoEMethod)  # no vLLM config needed: the check runs before any arithmetic
    with pytest.raises(NotImplementedError, match="does not support grouped top-k routing, activation 'relu2'"):
        method.apply_monolithic(layer, torch.zeros(1, 8), torch.zeros(1, 4))


CHUNKED_AND_CACHED_IN_A_NEW_PROCESS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, prompts, sharing = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
# a step's budget of 16 tokens: the 73 prompt tokens of the first batch prefill in chunks, over several steps
llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
          max_num_seqs=4, kv_cache_memory_bytes=1 << 24, enable_chunked_prefill=True, max_num_batched_tokens=16,
          enable_prefix_caching=True)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
chunks = []
schedule = scheduler.schedule
def recorded(*args, **kwargs):
    output = schedule(*args, **kwargs)
    chunks.append(output.total_num_scheduled_tokens)
    return output
scheduler.schedule = recorded
params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, detokenize=False)
def serve(batch):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens for o in outputs]
chunked, _ = serve(prompts)
steps = len(chunks)
shared, cached = serve(sharing)
print("RESULT " + json.dumps({"chunked": chunked, "step_tokens": chunks[:steps], "shared": shared,
                              "cached": cached}))
"""


def test_chunked_prefill_and_prefix_cache_hits_give_hugging_faces_tokens(tiny_llama: Path) -> None:
    """max_num_batched_tokens=16: prompts of 5..40 tokens prefill in chunks across steps, mixed with decodes;
    then prompts that share the 40-token prompt's first 32 tokens (2 blocks) read them from the prefix cache."""
    prompts = _prompts()
    sharing = [prompts[3][:32] + suffix for suffix in ([7, 8, 9], [10] * 12)]
    command = [sys.executable, "-c", CHUNKED_AND_CACHED_IN_A_NEW_PROCESS, str(tiny_llama), json.dumps(prompts),
               json.dumps(sharing)]
    done = subprocess.run(command, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                          capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT ") :])
    # every prompt token and 7 decodes a request, at most 16 tokens a step: the 73 prompt tokens took 5+ steps
    assert sum(result["step_tokens"]) == sum(PROMPT_LENGTHS) + 4 * (NEW_TOKENS - 1)
    assert max(result["step_tokens"]) <= 16
    assert result["chunked"] == _hugging_face_greedy(tiny_llama, NEW_TOKENS)
    assert result["cached"] == [32, 32]  # the shared blocks, from the first batch's request
    assert result["shared"] == _hugging_face_greedy(tiny_llama, NEW_TOKENS, sharing)


# The tiny Llama's KV cache takes 1 KiB a token (2 layers x keys and values x 2 heads x 32 x 4 bytes): a block of
# 16 tokens is 16 KiB.
BLOCK_BYTES = 16 << 10

ENGINE_IN_A_NEW_PROCESS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, kv_bytes, new_tokens, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
try:
    llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
              max_num_seqs=4, kv_cache_memory_bytes=kv_bytes)
except ValueError as error:
    print("RESULT " + json.dumps({"error": str(error)}))
    sys.exit(0)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
preempted = []
preempt = scheduler._preempt_request
def counted(request, *args, **kwargs):
    preempted.append(request.request_id)
    return preempt(request, *args, **kwargs)
scheduler._preempt_request = counted
params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, detokenize=False)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
again = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                              "again": list(again[0].outputs[0].token_ids), "preemptions": len(preempted)}))
"""


def _engine_in_a_new_process(folder: Path, kv_bytes: int, new_tokens: int) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    command = [sys.executable, "-c", ENGINE_IN_A_NEW_PROCESS, str(folder), str(kv_bytes), str(new_tokens)]
    done = subprocess.run([*command, json.dumps(_prompts())], env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    return json.loads(results[-1][len("RESULT ") :])


def test_a_full_kv_cache_preempts_and_still_gives_hugging_faces_tokens(tiny_llama: Path) -> None:
    # 10 blocks (160 tokens) hold one request of max_model_len (8 blocks), not four requests growing to
    # 65..100 tokens (22 blocks): vLLM's scheduler preempts running requests and recomputes them later.
    new_tokens = 60
    result = _engine_in_a_new_process(tiny_llama, 10 * BLOCK_BYTES, new_tokens)
    expected = _hugging_face_greedy(tiny_llama, new_tokens)
    assert result["preemptions"] > 0
    assert result["tokens"] == expected
    assert result["again"] == expected[0]


def test_a_kv_cache_smaller_than_one_request_gets_vllms_error_at_start(tiny_llama: Path) -> None:
    result = _engine_in_a_new_process(tiny_llama, 4 * BLOCK_BYTES, NEW_TOKENS)
    assert "To serve at least one request with the model's max seq len (128)" in result["error"]


MEMORY_IN_A_NEW_PROCESS = """
import gc, json, sys, torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, sizing, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
          max_num_seqs=4, **sizing)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
weights = sum(t.numel() * t.element_size() for t in [*runner.model.parameters(), *runner.model.buffers()])
started = {"allocated": torch.pjrt.memory_allocated(), "peak": torch.pjrt.max_memory_allocated()}
params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, detokenize=False)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
result = {"weights": weights, "started": started, "served": torch.pjrt.memory_allocated(),
          "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
          "buffers": sorted({cache.untyped_storage().nbytes() for cache in runner.kv_caches}),
          "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
llm.llm_engine.engine_core.shutdown()
del llm, runner, outputs
gc.collect()
print("RESULT " + json.dumps({**result, "shut_down": torch.pjrt.memory_allocated()}))
"""

# What the device holds beyond the weights and the KV cache once the engine has started and served: a few
# small tensors (the sampler's, the attention's index tensors); measured 33 KiB. A second cache would be
# the cache's size again (64 MiB in the test below).
OVERHEAD_BOUND = 1 << 20


def _memory_in_a_new_process(folder: Path, sizing: dict[str, int], **env: str) -> dict:
    command = [sys.executable, "-c", MEMORY_IN_A_NEW_PROCESS, str(folder), json.dumps(sizing), json.dumps(_prompts())]
    done = subprocess.run(command, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env),
                          capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    return json.loads(results[-1][len("RESULT ") :])


def _assert_the_cache_is_held_once(result: dict, cache_bytes: int) -> None:
    assert result["buffers"] == [cache_bytes] == [result["blocks"] * BLOCK_BYTES]
    for held in (result["started"]["allocated"], result["started"]["peak"], result["served"]):
        assert result["weights"] + cache_bytes <= held <= result["weights"] + cache_bytes + OVERHEAD_BOUND
    assert result["shut_down"] <= OVERHEAD_BOUND


def test_the_kv_cache_is_allocated_once_and_freed_at_shutdown(
    tiny_llama: Path, reference_tokens: list[list[int]]
) -> None:
    # The device holds the weights and one cache of the size asked, at start (its peak too) and after serving.
    cache_bytes = 64 << 20
    result = _memory_in_a_new_process(tiny_llama, {"kv_cache_memory_bytes": cache_bytes})
    _assert_the_cache_is_held_once(result, cache_bytes)
    assert result["tokens"] == reference_tokens


def test_with_no_memory_arguments_the_cpu_client_sizes_the_cache_by_vllm_cpu_kvcache_space(
    tiny_llama: Path, reference_tokens: list[list[int]]
) -> None:
    # LLM(model) with neither kv_cache_memory_bytes nor gpu_memory_utilization: vLLM CPU's sizing, here 1 GiB.
    if torch.pjrt.get_device_properties(0).platform != "cpu":
        pytest.skip("VLLM_CPU_KVCACHE_SPACE sizes the cache on jaxlib's CPU client only")
    result = _memory_in_a_new_process(tiny_llama, {}, VLLM_CPU_KVCACHE_SPACE="1")
    _assert_the_cache_is_held_once(result, 1 << 30)
    assert result["tokens"] == reference_tokens


COMPILED_IN_A_NEW_PROCESS = """
import json, sys, torch, torch_pjrt
from vllm import LLM, SamplingParams
from vllm.compilation.counter import compilation_counter
from vllm.inputs import TokensPrompt
from torch_pjrt.eager.modes import EagerMode
folder, prompts, others = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=False, dtype="float32", max_model_len=128,
          max_num_seqs=4, kv_cache_memory_bytes=1 << 24)
traced_at_start = compilation_counter.num_graphs_seen
before = torch_pjrt.metrics.counters()
greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], greedy, use_tqdm=False)  # the warm-up's buckets
after = torch_pjrt.metrics.counters()
first_request = {name: after[name] - before[name] for name in ("graph_compiles", "fused_compiles")}
sampled = SamplingParams(temperature=0.8, seed=0, max_tokens=4, detokenize=False)  # its logits come back
llm.generate([TokensPrompt(prompt_token_ids=prompts[0][::-1])], sampled, use_tqdm=False)
counted = torch_pjrt.metrics.counters()
first_sampled = {name: counted[name] - after[name] for name in ("graph_compiles", "fused_compiles")}
params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, detokenize=False)
def serve(batch):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
strict = serve(prompts)
with torch.pjrt.set_eager_mode(EagerMode.DEFER_AND_FUSE):
    fused = serve(prompts)
serve(others)  # the first batch of these lengths (their prefills are not cached yet)
graphs = torch_pjrt.metrics.counters()["graph_compiles"]
again = serve([[t + 1 for t in p] for p in others])  # the same lengths, new tokens
fused_programs = torch_pjrt.metrics.counters()["fused_programs"]
llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
print("RESULT " + json.dumps({"strict": strict, "fused": fused, "pieces": compilation_counter.num_piecewise_graphs_seen,
                              "greedy_fused_programs": torch_pjrt.metrics.counters()["fused_programs"] - fused_programs,
                              "dynamo": compilation_counter.num_graphs_seen, "traced_at_start": traced_at_start,
                              "new_graphs": torch_pjrt.metrics.counters()["graph_compiles"] - graphs,
                              "graphs": graphs, "first_request": first_request, "first_sampled": first_sampled,
                              "async": llm.llm_engine.vllm_config.scheduler_config.async_scheduling}))
"""


@pytest.mark.parametrize("async_scheduling", ["0", "1"])
def test_vllms_compile_path_gives_hugging_faces_tokens_with_programs_per_bucket(
    tiny_llama: Path, async_scheduling: str
) -> None:
    """enforce_eager=False: vLLM's one Dynamo trace, at start-up (the worker's warm-up), attention inside it,
    one graph compiled by the pjrt backend (strict and fused eager around it); a first short greedy request, a
    first sampled one and prompts of new lengths in seen buckets compile nothing, and greedy steps run no
    program but the step's. The same with vLLM's async scheduling kept (TORCH_PJRT_VLLM_ASYNC_SCHEDULING=1),
    where each step's ids of continuing requests are the previous step's tokens on the device, taken in the
    step's program."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_PJRT_VLLM_ASYNC_SCHEDULING=async_scheduling)
    others = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((6, 12, 19, 33))]
    done = subprocess.run([sys.executable, "-c", COMPILED_IN_A_NEW_PROCESS, str(tiny_llama),
                           json.dumps(_prompts()), json.dumps(others)],
                          env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT "):])
    expected = _hugging_face_greedy(tiny_llama, NEW_TOKENS)
    assert result["strict"] == expected
    assert result["fused"] == expected
    assert result["dynamo"] == 1 and result["pieces"] == 1  # one traced model, its attention layers inside
    assert result["traced_at_start"] == 1  # traced before the first request
    # a greedy first request in the warm-up batch's buckets compiles neither the step's nor the sampling program
    assert result["first_request"] == {"graph_compiles": 0, "fused_compiles": 0}
    # nor a first sampled one (its sampled rows' logits brought back for vLLM's sampler)
    assert result["first_sampled"] == {"graph_compiles": 0, "fused_compiles": 0}
    assert result["graphs"] > 0 and result["new_graphs"] == 0
    assert result["greedy_fused_programs"] == 0
    assert result["async"] == (async_scheduling == "1")


JOINING_IN_A_NEW_PROCESS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=False, dtype="float32", max_model_len=128,
          max_num_seqs=4, kv_cache_memory_bytes=1 << 24)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
prompts, engine, done = json.loads(sys.argv[2]), llm.llm_engine, {}
waiting = list(range(len(prompts)))
while waiting or engine.has_unfinished_requests():
    if waiting:
        index = waiting.pop(0)
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=prompts[index]), params)
    done.update({int(o.request_id): list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
print("RESULT " + json.dumps([done[index] for index in range(len(prompts))]))
"""


@pytest.mark.parametrize("async_scheduling", ["0", "1"])
def test_requests_joining_one_a_step_on_the_compile_path_give_hugging_faces_tokens(
    tiny_llama: Path, async_scheduling: str
) -> None:
    """One request joins each step, as on a server: the graph is traced at the first step, a 5-token prompt
    alone (a block table one page wide, were it not padded to two), and later steps mix wider tables,
    prefills and decodes; greedy with no logits processor acting, so each step's argmax is taken in its
    program. With vLLM's async scheduling kept, the continuing requests' ids come from the previous step's
    tokens on the device while the batch grows and shrinks."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_PJRT_VLLM_ASYNC_SCHEDULING=async_scheduling)
    done = subprocess.run([sys.executable, "-c", JOINING_IN_A_NEW_PROCESS, str(tiny_llama), json.dumps(_prompts())],
                          env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    assert json.loads(results[-1][len("RESULT "):]) == _torch_greedy_without_stop(tiny_llama, NEW_TOKENS)


STEP_PROGRAM_IN_A_NEW_PROCESS = """
import json, sys, torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from torch_pjrt.serving.vllm.worker import StepProgram
made = []
make = StepProgram.__init__
def recorded_init(self, *args, **kwargs):
    made.append(self)
    make(self, *args, **kwargs)
StepProgram.__init__ = recorded_init
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=False, dtype="float32", max_model_len=128,
          max_num_seqs=4, kv_cache_memory_bytes=1 << 24)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
step, sampled, fused = runner._run_step, runner._sampled, runner._sampled_rows_program
calls = {"steps": 0, "fused": 0, "back": []}
import torch._dynamo.eval_frame as eval_frame
set_eval_frame = eval_frame.set_eval_frame
def counted_set_eval_frame(callback):
    calls["frame_evaluation_sets"] += 1
    return set_eval_frame(callback)
def counted_step(*args, **kwargs):
    calls["steps"] += 1
    eval_frame.set_eval_frame = counted_set_eval_frame
    try:
        return step(*args, **kwargs)
    finally:
        eval_frame.set_eval_frame = set_eval_frame
def recorded(logits, tokens, rows):
    result = sampled(logits, tokens, rows)
    back = result.tokens if result.tokens is not None else result.logits
    calls["back"].append([("tokens" if result.tokens is not None else "logits"), back.device.type,
                          back.dtype == torch.int32, list(back.shape)])
    return result
def fused_program(*args, **kwargs):
    calls["fused"] += 1
    return fused(*args, **kwargs)
runner._run_step, runner._sampled, runner._sampled_rows_program = counted_step, recorded, fused_program
from torch_pjrt.runtime import programs
launch = programs.Program.call
def counted_launch(self, *args):
    calls["programs"] += 1
    return launch(self, *args)
programs.Program.call = counted_launch
(program,) = made
through_torch_compile = program._compiled_callable
def counted_compiled_callable(*args, **kwargs):
    calls["through_torch_compile"] += 1
    return through_torch_compile(*args, **kwargs)
program._compiled_callable = counted_compiled_callable
prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])]
results = {"dynamo_code_of": getattr(getattr(program, "_compiled_bytecode", None), "co_name", None),
           "async": runner.use_async_scheduling}
for logprobs in (None, 2):
    calls.update(steps=0, fused=0, back=[], through_torch_compile=0, programs=0, frame_evaluation_sets=0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=logprobs, detokenize=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    results[str(logprobs)] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], **calls,
                              "logprobs": [o.outputs[0].logprobs is not None for o in outputs]}
print("RESULT " + json.dumps(results))
"""


def test_greedy_steps_on_the_compile_path_run_one_program_and_bring_back_only_token_ids(tiny_llama: Path) -> None:
    """enforce_eager=False, one rank: each step is the runner's one step program (forward, sampled rows, lm
    head, argmax) and no fused program runs after it; greedy steps bring back only the sampled rows' int32
    token ids, one per request; with logprobs asked, the sampled rows' logits come back for vLLM's sampler;
    Hugging Face's greedy tokens either way. The step runs the code Dynamo made of StepProgram.forward's own
    frame directly (vLLM's bytecode hook), never through torch.compile's call after the warm-up's trace, and
    without Dynamo's `disable` wrappers around that code's helpers and graph call: the one pair of frame
    evaluation resets left a step is vLLM's, around its graph piece (the wrappers made 14 pairs). Under
    async scheduling (the default) the greedy tokens stay on the device until the engine asks for them; a
    greedy step launches one program, its own (its tokens' rows are read from the padded tokens whole)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([sys.executable, "-c", STEP_PROGRAM_IN_A_NEW_PROCESS, str(tiny_llama),
                           json.dumps(_prompts())], env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT "):])
    expected = _torch_greedy_without_stop(tiny_llama, NEW_TOKENS)
    assert result["dynamo_code_of"] == "forward"
    for logprobs, kind in (("None", "tokens"), ("2", "logits")):
        run = result[logprobs]
        assert run["tokens"] == expected
        assert run["steps"] >= NEW_TOKENS and run["fused"] == 0 and run["through_torch_compile"] == 0
        assert run["frame_evaluation_sets"] == 2 * run["steps"]
        assert len(run["back"]) == run["steps"]
        on = "pjrt" if result["async"] and kind == "tokens" else "cpu"
        assert {(what, device) for what, device, _, _ in run["back"]} == {(kind, on)}
        assert run["logprobs"] == [logprobs != "None"] * len(expected)
    # a greedy step launches its program and nothing else (no program to read its tokens' rows, async or not)
    assert result["None"]["programs"] == result["None"]["steps"]
    # one int32 token per request a greedy step (a step's requests: at most the prompts')
    assert all(is_int32 and len(shape) == 1 and 1 <= shape[0] <= len(expected)
               for _, _, is_int32, shape in result["None"]["back"])


ASYNC_TOKEN_READS_IN_A_NEW_PROCESS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from torch_pjrt.eager import kernels
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=False, dtype="float32", max_model_len=128,
          max_num_seqs=8, kv_cache_memory_bytes=1 << 24)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
sampled, to_cpu = runner._sampled, kernels.to_cpu
steps, reads = [], []
def recorded(logits, tokens, rows):
    result = sampled(logits, tokens, rows)
    steps.append([rows, tokens.shape[0], result.tokens is result.padded_tokens])
    return result
def counted_to_cpu(tensor):
    reads.append(list(tensor.shape))
    return to_cpu(tensor)
copied_later, host_tensors = runner._tokens_copied_later, []
def made(*args, **kwargs):
    output = copied_later(*args, **kwargs)
    host_tensors.append(output.sampled_token_ids_cpu is not None)
    return output
runner._sampled, kernels.to_cpu, runner._tokens_copied_later = recorded, counted_to_cpu, made
prompts = json.loads(sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
results = {"async": runner.use_async_scheduling}
for count in (8, 5):
    steps.clear(), reads.clear(), host_tensors.clear()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:count]], params, use_tqdm=False)
    results[count] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "steps": list(steps),
                      "host_tensor_reads": list(reads), "host_tensors_made": list(host_tensors)}
print("RESULT " + json.dumps(results))
"""


def test_async_greedy_token_reads_padded_or_not_give_hugging_faces_tokens(tiny_llama: Path) -> None:
    """Under async scheduling on the compile path, a greedy step hands vLLM its program's padded tokens
    themselves where its requests fill the bucket (8 requests: no view of their rows made) and a view of their
    first rows where they do not (5 of 8); either way the engine reads them with no host tensor made
    (TokensCopiedLater reads the padded tokens whole into a host array, and makes vLLM's host tensor of them
    only where a logits processor reads output ids: none here), and the tokens are Hugging Face's."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_PJRT_VLLM_ASYNC_SCHEDULING="1")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 9, 13, 6, 21, 7, 16, 11)]
    done = subprocess.run([sys.executable, "-c", ASYNC_TOKEN_READS_IN_A_NEW_PROCESS, str(tiny_llama),
                           json.dumps(prompts)], env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT "):])
    assert result["async"]
    expected = _torch_greedy_without_stop(tiny_llama, NEW_TOKENS, prompts)
    for count in ("8", "5"):
        run = result[count]
        assert run["tokens"] == expected[: int(count)]
        assert run["host_tensor_reads"] == []
        assert run["host_tensors_made"] and not any(run["host_tensors_made"])
        assert run["steps"] and all(whole == (rows == padded) for rows, padded, whole in run["steps"])
    assert [8, 8, True] in result["8"]["steps"] and [5, 8, False] in result["5"]["steps"]


BATCH_SIZES_IN_A_NEW_PROCESS = """
import json, sys, torch, torch_pjrt
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=False, dtype="float32", max_model_len=128,
          max_num_seqs=8, kv_cache_memory_bytes=1 << 24)
params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, detokenize=False)
generator = torch.Generator().manual_seed(int(sys.argv[2]))
def serve(requests):
    prompts = [torch.randint(3, 256, (6,), generator=generator).tolist() for _ in range(requests)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return {"prompts": prompts, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
seen = [serve(n) for n in (1, 2, 5, 8)]
compiles = torch_pjrt.metrics.counters()["compiles"]
others = [serve(n) for n in (3, 4, 6, 7)]
print("RESULT " + json.dumps({"served": seen + others,
                              "new_compiles": torch_pjrt.metrics.counters()["compiles"] - compiles}))
"""


def test_batches_of_new_request_counts_in_seen_buckets_compile_no_program(tiny_llama: Path) -> None:
    """The 64-client server grew by programs compiled for request counts first met: batches of 1, 2, 5 and 8
    requests (6-token prompts: 8, 16, 32 and 64 prefill rows, 8 decode rows) compile every bucket; then 3, 4,
    6 and 7 requests compile nothing, and every batch gives Hugging Face's greedy tokens."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    seed = int(torch.randint(0, 1 << 30, ()).item())
    done = subprocess.run([sys.executable, "-c", BATCH_SIZES_IN_A_NEW_PROCESS, str(tiny_llama), str(seed)],
                          env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT "):])
    assert [len(batch["prompts"]) for batch in result["served"]] == [1, 2, 5, 8, 3, 4, 6, 7]
    for batch in result["served"]:
        assert batch["tokens"] == _hugging_face_greedy(tiny_llama, 4, batch["prompts"])
    assert result["new_compiles"] == 0


# tests/fixtures/vllm_plugin registers LlamaCountingUniqueTokens in every process vLLM starts (a vLLM general plugin).
VLLM_PLUGIN_FOLDER = Path(__file__).parent / "fixtures" / "vllm_plugin"
UNLOWERED_OP_ERROR = "torch_pjrt has no lowering for aten::_unique.default"

UNLOWERED_OP_IN_A_NEW_PROCESS = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
              max_num_seqs=4, kv_cache_memory_bytes=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])]
    results = []
    for _ in range(int(sys.argv[3])):
        start = time.monotonic()
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.append({"tokens": [list(o.outputs[0].token_ids) for o in outputs]})
        except Exception as error:
            results.append({"type": type(error).__name__, "error": str(error)})
        results[-1]["seconds"] = time.monotonic() - start
    print("RESULT " + json.dumps(results))

if __name__ == "__main__":  # the engine process is spawned: it imports this script without running it
    main()
"""


def _unlowered_op_model(tiny_llama: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaCountingUniqueTokens"]}))
    return folder


def _plugin_env(in_process: bool, **env: str) -> dict[str, str]:
    """The environment of a vLLM process that sees the test plugin; in_process=False: vLLM's default engine."""
    base = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    path = os.pathsep.join(filter(None, [str(VLLM_PLUGIN_FOLDER), os.environ.get("PYTHONPATH")]))
    return dict(base, PYTHONPATH=path, VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else "1", **env)


def _serve_unlowered_op_model(
    tiny_llama: Path, tmp_path: Path, *, in_process: bool = True, calls: int = 1, **env: str
) -> tuple[list[dict], str]:
    """The results of `calls` generate() calls of the unlowered-op model in a new process, and its output."""
    folder = _unlowered_op_model(tiny_llama, tmp_path)
    command = [sys.executable, "-c", UNLOWERED_OP_IN_A_NEW_PROCESS, str(folder), json.dumps(_prompts()), str(calls)]
    done = subprocess.run(command, env=_plugin_env(in_process, **env), capture_output=True, text=True, timeout=600)
    results = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    return results[-1], done.stdout + done.stderr  # vLLM's processes log to both


def test_a_model_with_an_op_torch_pjrt_lacks_gets_torch_pjrts_error(tiny_llama: Path, tmp_path: Path) -> None:
    # vLLM's CPU runner runs no warm-up forward in eager (enforce_eager=True): the first request meets the op.
    (result,), _ = _serve_unlowered_op_model(tiny_llama, tmp_path)
    assert result.get("type") == "NotImplementedError", result
    assert UNLOWERED_OP_ERROR in result["error"]
    assert "TORCH_PJRT_CPU_FALLBACK=1" in result["error"]


def test_after_a_failed_model_step_vllms_default_engine_is_dead_at_once_not_hung(
    tiny_llama: Path, tmp_path: Path
) -> None:
    # vLLM treats a failed model step as fatal: its engine process logs the error and exits, and every call
    # after it raises EngineDeadError at once (as on vLLM's CPU platform; docs/serving.md).
    results, log = _serve_unlowered_op_model(tiny_llama, tmp_path, in_process=False, calls=2)
    assert [r.get("type") for r in results] == ["EngineDeadError", "EngineDeadError"], results
    assert results[1]["seconds"] < 10
    assert UNLOWERED_OP_ERROR in log and "TORCH_PJRT_CPU_FALLBACK=1" in log


def test_after_a_failed_model_step_the_server_answers_500_and_exits_cleanly(tiny_llama: Path, tmp_path: Path) -> None:
    # eager, so the engine starts (no warm-up forward, as on vLLM's CPU platform) and the first step fails
    log = tmp_path / "server.log"
    folder = _unlowered_op_model(tiny_llama, tmp_path)
    server, url = _start_server(folder, log, "--enforce-eager", env=_plugin_env(in_process=False))
    try:
        body = dict(model=str(folder), prompt=_prompts()[0], max_tokens=NEW_TOKENS, temperature=0)
        with pytest.raises(urllib.error.HTTPError) as answer:
            _post(url + "/v1/completions", body, 300)
        assert answer.value.code == 500
        assert "EngineCore encountered an issue" in answer.value.read().decode()
        assert server.wait(timeout=120) == 0  # vLLM's API server shuts down when its engine dies
    finally:
        _stop_server(server)
    assert UNLOWERED_OP_ERROR in log.read_text()


def test_a_server_on_the_compile_path_whose_model_cannot_run_a_step_fails_at_start_naming_the_op(
    tiny_llama: Path, tmp_path: Path
) -> None:
    # The compile path's warm-up runs a step of the model at start, as vLLM's CPU platform's (its profile run
    # in determine_available_memory) and GPU platforms' do: the server exits there with torch-pjrt's error
    # rather than coming up to fail every request.
    log = tmp_path / "server.log"
    folder = _unlowered_op_model(tiny_llama, tmp_path)
    with pytest.raises(AssertionError, match=r"did not come up \(exit code [1-9]"):
        _start_server(folder, log, env=_plugin_env(in_process=False))
    text = log.read_text()
    assert UNLOWERED_OP_ERROR in text and "TORCH_PJRT_CPU_FALLBACK=1" in text
    assert "Engine core initialization failed" in text


def test_the_cpu_fallback_the_error_names_serves_that_model(
    tiny_llama: Path, tmp_path: Path, reference_tokens: list[list[int]]
) -> None:
    (result,), _ = _serve_unlowered_op_model(tiny_llama, tmp_path, TORCH_PJRT_CPU_FALLBACK="1")
    assert result.get("tokens") == reference_tokens, result


NGRAM_IN_A_NEW_PROCESS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, prompts, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
          max_num_seqs=4, kv_cache_memory_bytes=1 << 24, speculative_config=speculative)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
drafted = []
schedule = scheduler.schedule
def recorded(*args, **kwargs):
    output = schedule(*args, **kwargs)
    drafted.append(sum(len(draft) for draft in output.scheduled_spec_decode_tokens.values()))
    return output
scheduler.schedule = recorded
params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, detokenize=False)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "steps": len(drafted),
                              "drafted": sum(drafted)}))
"""


@pytest.mark.parametrize("sampling", ["auto", "device"])
def test_ngram_speculative_decoding_gives_hugging_faces_greedy_tokens_in_fewer_steps(
    tiny_llama: Path, sampling: str
) -> None:
    """vLLM's n-gram drafter proposes tokens from the prompt and output so far; greedy verification keeps the
    tokens Hugging Face's greedy generate() gives, and accepted drafts save steps. Asked to sample on the
    device, the runner samples on the host (vLLM's rejection sampler is C++ CPU kernels reading host memory)."""
    new_tokens = 24
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_PJRT_VLLM_SAMPLING=sampling)
    command = [sys.executable, "-c", NGRAM_IN_A_NEW_PROCESS, str(tiny_llama), json.dumps(_prompts()), str(new_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT ") :])
    assert result["tokens"] == _hugging_face_greedy(tiny_llama, new_tokens)
    # without drafts: one step for the prompts and the first token, then one a token
    assert result["drafted"] > 0
    assert result["steps"] < new_tokens


def test_the_server_under_16_streaming_clients_answers_each_request_once_cancels_hang_ups_and_keeps_its_memory(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """16 clients stream greedy completions at once, again and again for 20 s; every third request of a client
    hangs up after its first chunk. Each whole stream has one response id and Hugging Face's tokens, no id
    repeats, the server aborts hung-up requests (its log, `--enable-log-requests`) and no other, each hung-up
    request it did not abort finished at its length (its counters), nothing is
    left running, and its memory (its process and its engine core) grows by less than 128 MiB over the 20 s,
    measured after 45 s of the same load. That load keeps meeting new shapes (token and context buckets) whose
    programs compile: by hand, the engine's resident memory grew 268, 204, 68 MiB in the first three 10 s
    spells and 4, 5, 26 MiB in the next three; after a 30 s warm-up, 20 s grew 78 MiB once in four runs on
    the shared machine. A leak of 64 KiB a request (about 2,000 requests in 20 s) fails it."""
    from torch_pjrt.serving.vllm import load

    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (5 + 2 * i,), generator=generator).tolist() for i in range(16)]
    expected = _hugging_face_greedy(tiny_llama, NEW_TOKENS, prompts)
    log = tmp_path / "server.log"
    server, url = _start_server(tiny_llama, log, "--max-num-seqs", "16", "--enable-log-requests")
    try:
        model = str(tiny_llama)
        first = load.run_clients(url, model, prompts, NEW_TOKENS, 45, hang_up_every=3, timeout=120)
        rss_before = sum(load.group_rss(server.pid))
        loaded = load.run_clients(url, model, prompts, NEW_TOKENS, 20, hang_up_every=3, timeout=120)
        time.sleep(2)  # the server notices the last hang-ups
        rss_after, after = sum(load.group_rss(server.pid)), load.metrics(url)
    finally:
        _stop_server(server)
    for stream in first.streams + loaded.streams:
        assert load.whole(stream, NEW_TOKENS), stream
        assert stream.token_ids == expected[prompts.index(stream.prompt)]
    assert len(loaded.streams) >= 32 and len(loaded.hung_up) >= 16
    ids = [i for stream in first.streams + first.hung_up + loaded.streams + loaded.hung_up for i in stream.ids]
    assert len(ids) == len(set(ids))
    # the engine's request ids: the response's id, then the prompt's index and a suffix of its own
    aborted = {i.rsplit("-", 2)[0] for line in log.read_text().splitlines() if "Aborted request(s)" in line
               for i in line.rpartition("Aborted request(s) ")[2].rstrip(".").split(",")}
    hung_up = {i for stream in first.hung_up + loaded.hung_up for i in stream.ids}
    # a hung-up request is aborted, unless the engine finished it before the server saw the hang-up (on a starved
    # machine: its 64 tokens take ~0.2 s); then it finished at its length like the whole streams, never lost. The
    # server may also log an abort for one the engine was finishing at that moment (counted finished and aborted:
    # seen at load 4-6 beside a make test run, 2 of 997 aborts): every whole stream and un-aborted hang-up
    # finished, and no request beyond the hang-ups did
    assert aborted and aborted <= hung_up
    finished = load.summed(after, "vllm:request_success_total", 'finished_reason="length"')
    whole = len(first.streams) + len(loaded.streams)
    assert whole + len(hung_up - aborted) <= finished <= whole + len(hung_up), (finished, len(aborted), len(hung_up))
    assert load.summed(after, "vllm:num_requests_running") == load.summed(after, "vllm:num_requests_waiting") == 0
    assert rss_after - rss_before < 128 << 20, (rss_before, rss_after)


TENSOR_PARALLEL_IN_A_NEW_PROCESS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def first_qkv_weight(worker):
    weight = worker.model_runner.model.model.layers[0].self_attn.qkv_proj.weight
    return [str(weight.device), list(weight.shape)]

if __name__ == "__main__":
    folder, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
              max_num_seqs=4, kv_cache_memory_bytes=1 << 24, tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                  "shards": llm.collective_rpc(first_qkv_weight)}))
"""


def test_tensor_parallel_over_two_pjrt_devices_gives_hugging_faces_greedy_tokens(tiny_llama: Path) -> None:
    """`tensor_parallel_size=2` with two pjrt devices (TORCH_PJRT_CPU_DEVICES=2): vLLM spawns a worker process
    per rank, joined by the `pjrt` c10d backend; each holds half of every layer's heads on its own device
    (rank r on pjrt:r) and the all-reduces between them give the one-device tokens (Hugging Face's)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # workers are processes
    env.update(TORCH_PJRT_CPU_DEVICES="2", VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # the latter: collective_rpc(fn)
    command = [sys.executable, "-c", TENSOR_PARALLEL_IN_A_NEW_PROCESS, str(tiny_llama), json.dumps(_prompts())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    result = json.loads(results[-1][len("RESULT ") :])
    # the q, k and v rows of 4 query and 2 key/value heads of 32, split in two: 4 * 32 / 2 + 2 * (2 * 32 / 2)
    assert result["shards"] == [["pjrt:0", [128, 128]], ["pjrt:1", [128, 128]]]
    assert "backend=pjrt" in done.stdout + done.stderr
    assert result["tokens"] == _hugging_face_greedy(tiny_llama, NEW_TOKENS)
