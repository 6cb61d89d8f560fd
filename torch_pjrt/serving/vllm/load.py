"""Concurrent streaming clients against vLLM's OpenAI server: is every request answered once and whole?

Each client sends `/v1/completions` requests with prompt token ids (`stream`, `return_token_ids`, greedy,
`min_tokens = max_tokens`) one after another until its time is up, and checks each stream: one response
id, chunks up to `data: [DONE]`, exactly `max_tokens` token ids, finish reason `length`. Some requests hang
up after their first chunk (a client disconnect), which the server must abort (its log shows each one with
`--enable-log-requests`; vLLM's metrics do not count client aborts).
Across all clients no response id may repeat. The server's memory is its process group's resident set
(the API server and its engine core), read after a warm-up under the same load and at the end.

    python -m torch_pjrt.serving.vllm.load http://127.0.0.1:8000 --model DIR --server-pid PID --clients 64 --seconds 90
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil


@dataclasses.dataclass
class Stream:
    """What one streamed completion gave."""

    prompt: list[int]
    ids: set[str]
    token_ids: list[int]
    finish_reason: str | None
    done: bool
    seconds: float
    first_chunk_seconds: float | None


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float,
                      hang_up_after_first_chunk: bool = False) -> Stream:
    """One streamed greedy completion; with `hang_up_after_first_chunk` the connection closes after the first
    chunk, as a client that goes away."""
    parts = urllib.parse.urlsplit(url)
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, min_tokens=max_tokens, temperature=0,
                stream=True, return_token_ids=True)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    start = time.perf_counter()
    result = Stream(prompt, set(), [], None, False, 0.0, None)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                result.done = True
                break
            chunk = json.loads(data)
            result.ids.add(chunk["id"])
            for choice in chunk["choices"]:
                result.token_ids.extend(choice.get("token_ids") or [])
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if result.first_chunk_seconds is None:
                result.first_chunk_seconds = time.perf_counter() - start
                if hang_up_after_first_chunk:
                    break
    finally:
        connection.close()
        result.seconds = time.perf_counter() - start
    return result


def whole(stream: Stream, max_tokens: int) -> bool:
    """The stream came back once and whole: one id, `[DONE]`, every token, finished by length."""
    return len(stream.ids) == 1 and stream.done and len(stream.token_ids) == max_tokens and \
        stream.finish_reason == "length"


def group_rss(pid: int) -> list[int]:
    """Resident bytes of a process and of each of its descendants (the API server, its engine core)."""
    process = psutil.Process(pid)
    sizes = []
    for member in [process, *process.children(recursive=True)]:
        try:
            sizes.append(member.memory_info().rss)
        except psutil.NoSuchProcess:
            continue
    return sizes


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus counters and gauges whose name starts with `vllm:`, labels kept in the key."""
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def summed(values: dict[str, float], name: str, label: str = "") -> float:
    """A metric summed over its label sets (those containing `label`, e.g. `finished_reason="abort"`)."""
    return sum(v for k, v in values.items() if k.partition("{")[0] == name and label in k)


@dataclasses.dataclass
class Load:
    """What `run_clients` measured."""

    streams: list[Stream]
    hung_up: list[Stream]
    seconds: float

    def report(self, max_tokens: int) -> dict:
        ids = [i for s in self.streams + self.hung_up for i in s.ids]
        firsts = sorted(s.first_chunk_seconds for s in self.streams if s.first_chunk_seconds is not None)
        return {
            "requests": len(self.streams), "hung_up": len(self.hung_up),
            "not_whole": sum(not whole(s, max_tokens) for s in self.streams),
            "repeated_ids": len(ids) - len(set(ids)),
            "output_tokens_per_s": sum(len(s.token_ids) for s in self.streams) / self.seconds,
            "first_chunk_median_s": firsts[len(firsts) // 2] if firsts else None,
            "first_chunk_max_s": firsts[-1] if firsts else None,
        }


def run_clients(url: str, model: str, prompts: list[list[int]], max_tokens: int, seconds: float,
                hang_up_every: int = 0, hang_up_tokens: int = 64, timeout: float = 300) -> Load:
    """One client per prompt, each sending its prompt again and again until `seconds` are up (each at least
    once); every `hang_up_every`-th request of a client (0: none) asks for `hang_up_tokens` and hangs up after
    its first chunk, long before the server would finish it."""
    lock = threading.Lock()
    streams: list[Stream] = []
    hung_up: list[Stream] = []
    deadline = time.monotonic() + seconds

    def client(prompt: list[int]) -> None:
        sent = 0
        while sent == 0 or time.monotonic() < deadline:
            sent += 1
            hang_up = bool(hang_up_every) and sent % hang_up_every == 0
            stream = stream_completion(url, model, prompt, hang_up_tokens if hang_up else max_tokens, timeout, hang_up)
            with lock:
                (hung_up if hang_up else streams).append(stream)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        for done in [pool.submit(client, prompt) for prompt in prompts]:
            done.result()
    return Load(streams, hung_up, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--model", required=True, help="the served model's name (its folder, as served)")
    parser.add_argument("--server-pid", type=int, help="the server's process id, to read its memory")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--warm-up-seconds", type=float, default=30,
                        help="the same load first, unmeasured: it compiles the programs of the shapes it meets")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--hang-up-every", type=int, default=4, help="every Nth request of a client hangs up")
    parser.add_argument("--hang-up-tokens", type=int, default=64, help="what a request that hangs up asks for")
    parser.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    args = parser.parse_args()
    prompts = [[(7 * i + 3 * j) % (args.vocab - 3) + 3 for j in range(8 + i % 24)] for i in range(args.clients)]
    warm = run_clients(args.url, args.model, prompts, args.new_tokens, args.warm_up_seconds, args.hang_up_every,
                       args.hang_up_tokens)
    before_rss = group_rss(args.server_pid) if args.server_pid else None
    load = run_clients(args.url, args.model, prompts, args.new_tokens, args.seconds, args.hang_up_every,
                       args.hang_up_tokens)
    time.sleep(2)  # the server notices the last hang-ups
    after = metrics(args.url)
    report = {"warm_up": warm.report(args.new_tokens), **load.report(args.new_tokens),
              "running_or_waiting_after": summed(after, "vllm:num_requests_running")
              + summed(after, "vllm:num_requests_waiting")}
    if args.server_pid:
        mib = [round(size / 2**20, 1) for size in group_rss(args.server_pid)]
        report |= {"rss_mib_per_process_before": [round(size / 2**20, 1) for size in before_rss],
                   "rss_mib_per_process_after": mib}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
