"""The whole serving path against the engine: one workload through ``LLM`` in this process and
through a ``trtllm-serve`` process driven by ``trtllm-bench``'s client, in one run.

    python benchmarks/bench_serving.py [--device cpu|cuda] [--concurrency 1,16,64]
        [--num-requests N] [--output-len 64] [--config options.yaml] [--client-processes 4]
        [--model-scale bundled|tiny|full|m3-slice] [--mlp moe|dense]

The workload is ``trtllm-bench``'s (fixed-seed GSM8K-style chat questions, greedy, ``ignore_eos``,
``max_tokens`` = ``--output-len``); the model is the README's (the bundled M3-tiny with its Eagle3
drafter, unified KV) unless ``--config`` names other ``LLM`` options, or ``--model-scale`` names
``bench_common``'s benchmark model (``full``: the published widths; ``--mlp dense``: every MLP
dense) with its Eagle3 drafter, random weights made on the device and a character tokenizer
covering its vocabulary (random drafts are rarely accepted: a measure of the serving path, not of
acceptance). Both sides get
``max_batch_size`` = the largest level and one untimed pass of each level's workload before the
timed one. At each level ``concurrency`` requests are in flight at once: HTTP streams on the server,
``LLM.submit`` calls (a new one as each ends, an output after every step) on the engine; and the
engine runs the workload through ``LLM.generate`` in batches of ``concurrency`` (no output before
a request ends), the reference the server is held to. The client runs in ``--client-processes``
processes (each one event loop, an equal share of the requests in flight, all taking the next
request from one queue), so that parsing the streams does not cap what the server is measured at.

Printed per level: output tokens/s of each and the ratios server / generate and server / submit,
TTFT p50 and TPOT p50 of the streamed two, and the cores the server's front process and its engine
core's processes kept busy (a front near one core is bound by its GIL; the per-level line gives its
busiest threads and its CPU per output token; the engine's line, the share of its submit run's steps
replayed from CUDA graphs, and of those with a prompt). Then the server's start-up time (launch to
``/health`` 200), the latency of the first request after ``/health`` answers (the client warmed
first by a request the server refuses) against the same request's steady-state latency, and the CPU
an idle server uses (its processes, over 5 s); and the same request's first and steady latency
through ``LLM.generate``, with the Triton kernels compiled after ``LLM(...)`` returned (none:
start-up compiled what a step needs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml
from bench_common import machine_name, streamed_chat_bodies, write_dummy_checkpoints

from tensorrt_llm.bench.serving import one_request, run_spread, summarize
from tensorrt_llm.bundled import bundled_eagle3
from tensorrt_llm.evaluate.deployment import running
from tensorrt_llm.llmapi import LLM, GenerationRequest
from tensorrt_llm.sampling_params import SamplingParams

FIRST_REQUESTS = 16  # requests at concurrency 1 (a latency level)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its children's threads, from /proc (every process in the
    tree rooted at ``pid``)."""
    total, pids = 0.0, [pid]
    while pids:
        p = pids.pop()
        try:
            total += _stat_cpu(Path(f"/proc/{p}/stat"))
            for task in Path(f"/proc/{p}/task").iterdir():
                children = task / "children"
                if children.exists():
                    pids += [int(c) for c in children.read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def engine_level(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int):
    """``prompts`` through ``LLM.submit`` with ``concurrency`` in flight: output tokens/s and the
    TTFT and TPOT of each request."""
    gate = threading.Semaphore(concurrency)
    done = threading.Event()
    lock = threading.Lock()
    results: list[tuple[float, float, int]] = []  # ttft, latency, tokens

    def start(prompt: list[int]) -> None:
        sent = time.perf_counter()
        first: list[float] = []

        def on_update(output) -> None:
            now = time.perf_counter()
            tokens = len(output.outputs[0].token_ids)
            if tokens and not first:
                first.append(now - sent)
            if output.finished:
                with lock:
                    results.append((first[0] if first else now - sent, now - sent, tokens))
                    if len(results) == len(prompts):
                        done.set()
                gate.release()

        llm.submit(GenerationRequest(prompt, params), on_update)

    counted = ("num_steps", "num_graph_steps", "num_mixed_graph_steps")
    before = llm.get_stats()
    begin = time.perf_counter()
    for prompt in prompts:
        gate.acquire()
        start(prompt)
    done.wait()
    wall = time.perf_counter() - begin
    after = llm.get_stats()
    steps, graphs, mixed = (after[k] - before[k] for k in counted)
    tokens = sum(r[2] for r in results)
    tpots = [(lat - ttft) / (n - 1) for ttft, lat, n in results if n > 1]
    return {
        "output_tokens_per_s": tokens / wall,
        "ttft_p50": statistics.median(r[0] for r in results),
        "tpot_p50": statistics.median(tpots) if tpots else None,
        "slots_busy": sum(r[1] for r in results) / (concurrency * wall),
        "steps": steps,
        "graph_steps": graphs / max(steps, 1),  # of them, replayed from CUDA graphs
        "mixed_graph_steps": mixed / max(steps, 1),  # (with a prompt)
    }


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU of each thread of ``pid`` (not of its children), by thread id."""
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = _stat_cpu(task / "stat")
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _stat_cpu(stat: Path) -> float:
    """User + system CPU seconds in a ``/proc`` ``stat`` file (a process's or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def generate_level(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int):
    """``prompts`` through ``LLM.generate`` in batches of ``batch``: output tokens/s."""
    begin, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[i : i + batch], params)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens_per_s": tokens / (time.perf_counter() - begin)}


def server_level(url: str, bodies: list[dict], concurrency: int, processes: int, pid: int) -> dict:
    """One level against the server; with the cores its front process (HTTP, tokenizing,
    detokenizing, streams) and its engine core's process tree kept busy meanwhile."""
    base = url.rsplit("/v1/", 1)[0]
    seen = server_means(base)
    tree, threads = cpu_seconds(pid), thread_cpu_seconds(pid)
    results, wall = run_spread(url, bodies, concurrency=concurrency, processes=processes)
    tree, after = cpu_seconds(pid) - tree, thread_cpu_seconds(pid)
    sums = {k: (v[0] - seen[k][0], v[1] - seen[k][1]) for k, v in server_means(base).items()}
    s = summarize(results, wall)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['errors']}")
    front = sorted(((t - threads.get(tid, 0.0)) / wall for tid, t in after.items()), reverse=True)
    return {
        "output_tokens_per_s": s["output_tokens_per_s"],
        "ttft_p50": s["ttft_s"]["p50"],
        "tpot_p50": s["tpot_s"]["p50"],
        "front_cores": sum(front),
        # the front's CPU per output token (bench_http_stack.py's measure, here at this level)
        "front_us_per_token": sum(front) * 1e6 / max(s["output_tokens_per_s"], 1e-9),
        "front_busiest_threads": [round(c, 2) for c in front[:3]],
        "core_cores": tree / wall - sum(front),
        "slots_busy": sum(r.latency for r in results) / (concurrency * wall),
        # where the client's mean TTFT goes: the server's own (its handler's arrival to the first
        # output there), of that the wait for admission (KV granted in the engine core), and of
        # that the handoff (the front's work and the trip to the core's process)
        "ttft_mean": statistics.fmean(r.ttft for r in results),
        "server_ttft_mean": sums["ttft"][0] / max(sums["ttft"][1], 1),
        "server_queue_mean": sums["queue"][0] / max(sums["queue"][1], 1),
        # of the queue time, the front's and the trip to the engine core's process
        "server_handoff_mean": sums["handoff"][0] / max(sums["handoff"][1], 1),
    }


def server_means(base: str) -> dict[str, tuple[float, float]]:
    """The server's TTFT, queue-time and handoff histograms' (sum, count) from ``/metrics``."""
    names = {
        "ttft": "trtllm_time_to_first_token_seconds",
        "queue": "trtllm_request_queue_time_seconds",
        "handoff": "trtllm_request_handoff_time_seconds",
    }
    text = httpx.get(base + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and name.endswith(("_sum", "_count")):
            values[name] = float(value)
    return {
        k: (values.get(f"{n}_sum", 0.0), values.get(f"{n}_count", 0.0)) for k, n in names.items()
    }


async def _latency(url: str, body: dict) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        result = await one_request(client, url, body)
    if not result.ok:
        raise RuntimeError(f"request failed: {result.error}")
    return result.latency


async def _warm_client(url: str) -> None:
    """This process's first streamed request costs its client 25 to 30 ms of one-time setup
    (found on the CPU: a fresh client's first request to a warm server is that much slower, and
    not after this). A request the server refuses before the engine pays it here."""
    async with httpx.AsyncClient(timeout=600) as client:
        result = await one_request(client, url, {"messages": [], "stream": True})
    if result.ok or "HTTP 400" not in result.error:
        raise RuntimeError(f"the client's warm-up was not refused as expected: {result}")


def measure_server(args, options: dict, bodies: list[dict], levels: list[int]) -> dict:
    out: dict = {"levels": {}}
    with running() as deployment:
        config = deployment.write_yaml("options.yaml", options)
        launched = time.perf_counter()
        deployment.start("server", ["--config", str(config), "--device", args.device])
        try:
            deployment.wait_healthy("server")
        except (RuntimeError, TimeoutError):
            print(deployment.log("server"), file=sys.stderr)
            raise
        out["startup_s"] = time.perf_counter() - launched
        print(f"  server start-up (launch to /health): {out['startup_s']:.1f} s", flush=True)
        url = deployment.urls["server"] + "/v1/chat/completions"
        asyncio.run(_warm_client(url))  # (the client's own first-request costs)
        out["first_s"] = asyncio.run(_latency(url, bodies[0]))
        out["steady_s"] = statistics.median(asyncio.run(_latency(url, bodies[0])) for _ in range(5))
        pid = deployment.procs["server"].pid
        time.sleep(1.0)
        before, t0 = cpu_seconds(pid), time.perf_counter()
        time.sleep(5.0)
        out["idle_cores"] = (cpu_seconds(pid) - before) / (time.perf_counter() - t0)
        for level in levels:
            work = bodies[:FIRST_REQUESTS] if level == 1 else bodies
            server_level(url, work, level, args.client_processes, pid)  # the untimed pass
            out["levels"][level] = server_level(url, work, level, args.client_processes, pid)
            print(f"  server, concurrency {level}: {out['levels'][level]}", flush=True)
    return out


def triton_kernels_compiled() -> int:
    """Triton kernels compiled in this process so far (the binaries in every ``@triton.jit``
    function's cache); 0 without Triton."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return 0
    return sum(
        len(cache[0])
        for fn in gc.get_objects()
        if isinstance(fn, JITFunction)
        for cache in fn.device_caches.values()
    )


def _timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def measure_engine(options: dict, bodies: list[dict], levels: list[int], output_len: int) -> dict:
    out: dict = {}
    llm = LLM(**options)
    try:
        template = llm.tokenizer.apply_chat_template
        prompts = [llm.tokenizer.encode(template(b["messages"])) for b in bodies]
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        compiled = triton_kernels_compiled()
        out["first_s"] = _timed(lambda: llm.generate([prompts[0]], params))
        out["steady_s"] = statistics.median(
            _timed(lambda: llm.generate([prompts[0]], params)) for _ in range(5)
        )
        out["compiled_after_start"] = triton_kernels_compiled() - compiled
        for level in levels:
            work = prompts[:FIRST_REQUESTS] if level == 1 else prompts
            generate_level(llm, work, params, level)  # the untimed passes
            engine_level(llm, work, params, level)
            out[level] = engine_level(llm, work, params, level)
            out[level]["generate"] = generate_level(llm, work, params, level)
            print(f"  engine, concurrency {level}: {out[level]}", flush=True)
    finally:
        llm.shutdown()
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level; default max(192, 10 x the largest level): ten rounds of every "
        "slot, so that a level is not decided by its first and last round",
    )
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--config", type=Path, default=None, help="YAML file of LLM options")
    p.add_argument(
        "--model-scale",
        default="bundled",
        choices=["bundled", "tiny", "full", "m3-slice"],
        help="bundled: the README's model; else bench_common's benchmark model of that scale "
        "with its Eagle3 drafter, random weights made on the device (load_format dummy)",
    )
    p.add_argument("--mlp", default="moe", choices=["moe", "dense"], help="with --model-scale")
    p.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="client processes sharing a level (at most one per request in flight)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as folder:
        run(args, Path(folder))


def model_options(args, folder: Path) -> dict:
    """The LLM options of the model measured: ``--config``'s, the README's model by default,
    or with ``--model-scale`` the benchmark model written (configs and tokenizer) to ``folder``."""
    options = yaml.safe_load(args.config.read_text()) if args.config else {}
    if args.model_scale != "bundled":
        target, draft = write_dummy_checkpoints(folder, args.model_scale, args.mlp)
        spec = {**bundled_eagle3(), "speculative_model": str(draft)}
        options = {"model": str(target), "load_format": "dummy", "speculative_config": spec}
        options |= yaml.safe_load(args.config.read_text()) if args.config else {}
    if "model" not in options:
        options.setdefault("speculative_config", bundled_eagle3())
    return options


def run(args, folder: Path) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    options = {**model_options(args, folder), "max_batch_size": max(levels), "device": args.device}
    num_requests = args.num_requests or max(192, 10 * max(levels))
    bodies = streamed_chat_bodies(num_requests, args.output_len)
    print(f"machine: {machine_name(args.device)}", flush=True)
    server = measure_server(args, options, bodies, levels)
    engine = measure_engine(options, bodies, levels, args.output_len)
    print(
        "\n| concurrency | generate tok/s | submit tok/s | server tok/s | server / generate "
        "| server / submit | submit TTFT p50 ms | server TTFT p50 ms | submit TPOT p50 ms "
        "| server TPOT p50 ms | server front cores | server core cores |\n|" + " --- |" * 12
    )
    for level in levels:
        e, s = engine[level], server["levels"][level]
        g = e["generate"]["output_tokens_per_s"]
        tok = s["output_tokens_per_s"]
        print(
            f"| {level} | {g:.0f} | {e['output_tokens_per_s']:.0f} | {tok:.0f} "
            f"| {tok / g:.2f} | {tok / e['output_tokens_per_s']:.2f} | {_ms(e['ttft_p50'])} | {_ms(s['ttft_p50'])} | {_ms(e['tpot_p50'])} "
            f"| {_ms(s['tpot_p50'])} | {s['front_cores']:.2f} | {s['core_cores']:.2f} |"
        )
    print(
        f"\nserver start-up (launch to /health): {server['startup_s']:.1f} s; first request after "
        f"/health {server['first_s']:.3f} s, steady state {server['steady_s']:.3f} s "
        f"(ratio {server['first_s'] / server['steady_s']:.2f}); idle server "
        f"{100 * server['idle_cores']:.1f}% of a core"
    )
    print(
        f"LLM.generate, the same request first after LLM(...) returned: {engine['first_s']:.3f} s, "
        f"steady state {engine['steady_s']:.3f} s (ratio {engine['first_s'] / engine['steady_s']:.2f}); "
        f"Triton kernels compiled after start-up: {engine['compiled_after_start']}"
    )


if __name__ == "__main__":
    sys.exit(main())
