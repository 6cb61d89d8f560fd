"""vLLM's sampler on the pjrt device against the same sampler on the host, for one batch of logits.

What TORCH_PJRT_VLLM_SAMPLING chooses between: the logits of N requests sit on the pjrt device after
the forward; "host" copies them to the host and runs vLLM's `Sampler` there, "device" runs it on the
device (strict eager, or DEFER_AND_FUSE: one program) and reads back only the token ids. Greedy
(argmax) and random sampling with top-k and top-p (vLLM's sort-based torch path), at each vocabulary
size. Rows run interleaved, best of `--rounds`. Needs the vLLM environment (`make test-serving`).
Run: .venv-vllm/bin/python bench/sampling.py [--requests N] [--vocab V ...] [--rounds K]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

import torch_pjrt  # noqa: F401  (the pjrt device)
from torch_pjrt.eager.modes import EagerMode


def _metadata(requests: int, greedy: bool, device: torch.device) -> SamplingMetadata:
    def filled(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((requests,), value, dtype=dtype, device=device)

    return SamplingMetadata(
        temperature=None if greedy else filled(0.8), all_greedy=greedy, all_random=not greedy,
        top_p=None if greedy else filled(0.9), top_k=None if greedy else filled(50, torch.int32), generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=filled(0.0),
        presence_penalties=filled(0.0), repetition_penalties=filled(1.0), output_token_ids=[],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )  # fmt: skip


def _rows(sampler: Sampler, logits: torch.Tensor, on_host: SamplingMetadata,
          on_device: SamplingMetadata) -> dict[str, Callable[[], object]]:
    """Each row samples the device's logits and returns the token ids as a list (the sampler writes into
    the logits it is given: the device rows give it a copy)."""

    def host() -> object:
        return sampler(logits.cpu(), on_host).sampled_token_ids.tolist()

    def strict() -> object:
        return sampler(logits.clone(), on_device).sampled_token_ids.tolist()

    def fused() -> object:
        with torch.pjrt.set_eager_mode(EagerMode.DEFER_AND_FUSE):
            return sampler(logits.clone(), on_device).sampled_token_ids.tolist()

    return {"host": host, "strict": strict, "fused": fused}


def _best_interleaved(rows: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for run in rows.values():  # compiles
        run()
        run()
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(rounds):
        for name, run in rows.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sampler = Sampler()
    pjrt = torch.device("pjrt")
    print(f"{args.requests} requests; ms per batch, best of {args.rounds} interleaved rounds; sampler "
          f"{type(sampler.topk_topp_sampler).__name__}.{sampler.topk_topp_sampler.forward.__name__}")
    print("| vocab | sampling | host (logits copied back) | device, strict | device, DEFER_AND_FUSE | host / fused |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        logits = torch.randn(args.requests, vocab, device=pjrt)
        for greedy in (True, False):
            rows = _rows(sampler, logits, _metadata(args.requests, greedy, torch.device("cpu")),
                         _metadata(args.requests, greedy, pjrt))
            if greedy:
                assert len({str(run()) for run in rows.values()}) == 1, "greedy tokens differ between host and device"
            best = _best_interleaved(rows, args.rounds)
            ms = {name: seconds * 1e3 for name, seconds in best.items()}
            kind = "greedy" if greedy else "top-k 50, top-p 0.9"
            print(f"| {vocab} | {kind} | {ms['host']:.2f} | {ms['strict']:.2f} | {ms['fused']:.2f} | "
                  f"{ms['host'] / ms['fused']:.2f}x |")


if __name__ == "__main__":
    main()
