"""``trtllm-serve [MODEL] [--config options.yaml] [--host 127.0.0.1] [--port 8000]``.

Serves an OpenAI-compatible API. With no MODEL, the bundled M3-tiny checkpoint is served with
one-model Eagle3 (its bundled drafter) and the unified KV cache; ``--config`` is a YAML file of
``LLM`` options (``kv_cache_config``, ``speculative_config``, ``max_batch_size`` ...), which
replaces those defaults.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path

from tensorrt_llm import envs
from tensorrt_llm._torch.disaggregation.binding import bind_ucx_to
from tensorrt_llm.bundled import bundled_eagle3, bundled_target
from tensorrt_llm.llmapi.llm_args import load_yaml_options
from tensorrt_llm.serve.connections import HEADER_TIMEOUT_S, ConnectionLimits

# Every trtllm-serve process (servers and router) keeps an idle HTTP connection open this long, well
# past the 5 s after which HTTP clients (httpx, the OpenAI client, the router's ROUTER_KEEPALIVE_S)
# drop theirs: a client then never sends on a connection the server is closing at that moment
# (with both at 5 s, about 1 in 40 requests sent at the edge failed with a read error, a 502 at
# the router).
SERVER_KEEP_ALIVE_S = 30
# upstream's flags for the common LLM options: flag -> where it goes in the options
FLAG_OPTIONS: dict[str, tuple[str, ...]] = {
    "tp_size": ("tensor_parallel_size",),
    "ep_size": ("moe_expert_parallel_size",),
    "max_batch_size": ("max_batch_size",),
    "max_num_tokens": ("max_num_tokens",),
    "max_seq_len": ("max_seq_len",),
    "kv_cache_free_gpu_memory_fraction": ("kv_cache_config", "free_gpu_memory_fraction"),
    "kv_cache_dtype": ("kv_cache_config", "dtype"),
    "chat_template": ("chat_template",),
    "guided_decoding_backend": ("guided_decoding_backend",),
}
_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]")  # a name, an IPv4 or [IPv6] address


def apply_flags(options: dict, flags: dict[str, object], config: Path | None) -> None:
    """``options`` (from ``config``) with each flag given (not None) set where it goes; a
    ``ValueError`` for an option that both set."""
    for flag, value in flags.items():
        if value is None:
            continue
        *parents, key = FLAG_OPTIONS[flag]
        where = options
        for parent in parents:
            where = where.setdefault(parent, {})
        if key in where:
            name = ".".join(FLAG_OPTIONS[flag])
            raise ValueError(f"--{flag} {value} and {name} in {config}: give one of them")
        where[key] = value


def build_server(
    model: str | None,
    config: Path | None,
    device: str = "auto",
    served_model_name: str | None = None,
    api_key: str | None = None,
    tp_size: int | None = None,
    *,
    allowed_local_media_path: Path | None = None,
    allowed_media_domains: list[str] | None = None,
    max_request_tokens: int | None = None,
    reasoning_parser: str | None = None,
    tool_parser: str | None = None,
    flags: dict[str, object] | None = None,
):
    """The server for ``model`` (default: the bundled one) with the LLM options of ``config``
    and of ``flags`` (``FLAG_OPTIONS``' names; ``tp_size`` too); an option given both ways is a
    ``ValueError``."""
    from tensorrt_llm.llmapi import LLM
    from tensorrt_llm.llmapi.reasoning_parser import ReasoningParserFactory
    from tensorrt_llm.serve.guards import ServeLimits
    from tensorrt_llm.serve.media import MediaOptions
    from tensorrt_llm.serve.openai_server import OpenAIServer
    from tensorrt_llm.serve.tool_parser import ToolParserFactory

    options = load_yaml_options(config) if config else {}
    model = model or options.pop("model", None)
    if model is None:
        model = bundled_target()
        options.setdefault("speculative_config", bundled_eagle3())
    options.setdefault("device", device)
    options.setdefault("engine_process", True)  # the engine core in a process of its own
    apply_flags(options, {**(flags or {}), "tp_size": tp_size}, config)
    bad_hosts = [h for h in allowed_media_domains or () if not _HOST.fullmatch(h)]
    if bad_hosts:
        raise ValueError(
            f"--allowed-media-domains {bad_hosts}: not host names (give MODEL before the flag: "
            "it takes every word after it)"
        )
    if allowed_local_media_path is not None and not allowed_local_media_path.is_dir():
        raise ValueError(f"--allowed-local-media-path {allowed_local_media_path}: not a directory")
    media = MediaOptions(
        allowed_local_media_path=allowed_local_media_path,
        allowed_media_domains=frozenset(allowed_media_domains or ()),
    )
    if max_request_tokens is not None and max_request_tokens < 1:
        raise ValueError(f"--max-request-tokens {max_request_tokens}: must be at least 1")
    for flag, name, known in (
        ("--reasoning_parser", reasoning_parser, ReasoningParserFactory.parsers),
        ("--tool_parser", tool_parser, ToolParserFactory.parsers),
    ):
        if name is not None and name not in known:
            raise ValueError(f"{flag} {name}: expected one of {sorted(known)}")
    llm = LLM(model, **options)
    limits = ServeLimits(max_request_tokens=max_request_tokens)
    name = served_model_name or Path(model).name
    return OpenAIServer(llm, name, api_key, media, limits, reasoning_parser, tool_parser)


def serve_disaggregated(argv: list[str]) -> int:
    """``trtllm-serve disaggregated -c disagg.yaml``: the router in front of context and generation
    servers (each a ``trtllm-serve`` whose options hold ``cache_transceiver_config``)."""
    from tensorrt_llm.serve.router import CONTEXT_TIMEOUT_S, DisaggRouter, load_disagg_config

    parser = argparse.ArgumentParser(
        prog="trtllm-serve disaggregated", description=serve_disaggregated.__doc__.splitlines()[0]
    )
    parser.add_argument("-c", "--config", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        config = load_disagg_config(args.config)
    except ValueError as exc:
        print(f"trtllm-serve: {exc}", file=sys.stderr)
        return 2
    try:
        router = DisaggRouter(
            config["context_servers"]["urls"],
            config["generation_servers"]["urls"],
            context_timeout_s=float(config.get("context_timeout_s", CONTEXT_TIMEOUT_S)),
        )
    except ValueError as exc:  # TRTLLM_DISAGG_SECRET unset or short
        print(f"trtllm-serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(
        router.app,
        host=config.get("hostname", "127.0.0.1"),
        port=int(config.get("port", 8000)),
        log_level="warning",
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        http=ConnectionLimits().protocol(),
    )
    return 0


SHUTDOWN_GRACE_S = 10


def _exit_after_graceful_shutdown(signum, frame) -> None:
    raise SystemExit(0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtllm-serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "model", nargs="?", default=None, help="checkpoint directory (default: the bundled one)"
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML file of LLM options")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to serve on; KV transfers (UCX) use only its interface and RDMA devices",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--tp_size",
        type=int,
        default=None,
        help="ranks (GPUs) the model runs on, one process each (tensor_parallel_size; with "
        "enable_attention_dp: true in --config, each rank runs its own requests)",
    )
    parser.add_argument("--ep_size", type=int, default=None, help="moe_expert_parallel_size")
    parser.add_argument("--max_batch_size", type=int, default=None, help="requests per step")
    parser.add_argument("--max_num_tokens", type=int, default=None, help="tokens per step")
    parser.add_argument("--max_seq_len", type=int, default=None, help="prompt + output tokens")
    parser.add_argument(
        "--kv_cache_free_gpu_memory_fraction",
        type=float,
        default=None,
        help="the share of the free GPU memory the KV cache takes (kv_cache_config)",
    )
    parser.add_argument(
        "--kv_cache_dtype",
        default=None,
        choices=["auto", "float32", "float16", "bfloat16", "fp8"],
        help="the KV cache's dtype (kv_cache_config.dtype); fp8: float8_e4m3fn rows with scales",
    )
    parser.add_argument(
        "--reasoning_parser",
        default=None,
        help="split a chat reply's reasoning into reasoning_content (minimax_m3)",
    )
    parser.add_argument(
        "--tool_parser",
        default=None,
        help="read a chat reply's tool calls into tool_calls (minimax_m3)",
    )
    parser.add_argument(
        "--guided_decoding_backend",
        default=None,
        choices=["xgrammar"],
        help="hold replies to response_format and tool_choice required/named (guided decoding)",
    )
    parser.add_argument(
        "--chat_template",
        default=None,
        help="a Jinja chat template file, in place of the checkpoint's chat_template.jinja",
    )
    _add_guard_flags(parser)
    return parser


def _add_guard_flags(parser: argparse.ArgumentParser) -> None:
    """What a client may ask of the server: its key, where images may come from, how many
    connections and how much work."""
    parser.add_argument(
        "--api-key",
        default=envs.TRTLLM_API_KEY.get() or None,
        help="require 'Authorization: Bearer <key>' on every path but /health "
        "(default: TRTLLM_API_KEY)",
    )
    parser.add_argument(
        "--allowed-local-media-path",
        type=Path,
        default=None,
        help="a directory whose files chat requests may name as image_url file:// (default: none)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="the only hosts image URLs may name (exact names); they may resolve to private "
        "addresses (default: any host that resolves only to global addresses)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="HTTP connections held at once; the one past it gets a 503 (default: 4096, or "
        "fewer where the open-file limit is lower)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=HEADER_TIMEOUT_S,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    parser.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="the completion tokens one request may ask for, all its choices together (n x "
        "max_tokens); default max(2 x max_seq_len, 16384)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["disaggregated"]:
        return serve_disaggregated(argv[1:])
    args = _parser().parse_args(argv)
    try:
        bind_ucx_to(args.host)  # KV transfers listen where the HTTP server does
        server = build_server(
            args.model,
            args.config,
            args.device,
            args.served_model_name,
            args.api_key,
            args.tp_size,
            allowed_local_media_path=args.allowed_local_media_path,
            allowed_media_domains=args.allowed_media_domains,
            max_request_tokens=args.max_request_tokens,
            reasoning_parser=args.reasoning_parser,
            tool_parser=args.tool_parser,
            flags={flag: getattr(args, flag) for flag in FLAG_OPTIONS if flag != "tp_size"},
        )
    except ValueError as exc:
        print(f"trtllm-serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from tensorrt_llm.llmapi.workers import freeze_startup_heap

    freeze_startup_heap()
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again; this handler turns
    # that into an ordinary exit, so the cleanup below runs (stopping the other ranks first).
    signal.signal(signal.SIGTERM, _exit_after_graceful_shutdown)
    try:
        uvicorn.run(  # on SIGTERM, in-flight requests get SHUTDOWN_GRACE_S to finish
            server.app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,
            http=ConnectionLimits(args.max_connections, args.header_timeout_s).protocol(),
        )
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
