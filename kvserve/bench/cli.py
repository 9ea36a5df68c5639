"""The ``kvserve bench serve|throughput|latency`` commands (argument parsing and output only).

    kvserve bench serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct --dataset sharegpt \\
        --sweep 1,4,16,64 --slo-ttft-p95 2 --slo-tpot-p95 0.1 --out results/sweep.json --plot sweep.png
    kvserve bench serve --backend openai-chat --host 127.0.0.1 --port 8000 --endpoint /v1/chat/completions \\
        --model smollm2-135m-instruct --dataset-name random --num-prompts 50    (vLLM's spellings)
    kvserve bench throughput --num-prompts 64 --num-threads 1
    kvserve bench latency --input-len 512 --output-len 64 --num-threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import time
from pathlib import Path
from typing import Any

from kvserve.bench import datasets as ds

logger = logging.getLogger(__name__)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


# vLLM's ``bench serve --backend`` values that speak OpenAI's API -> our --api.
BACKENDS = {"vllm": "completions", "openai": "completions", "sglang": "completions", "lmdeploy": "completions",
            "llama.cpp": "completions", "openai-chat": "chat"}


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` with its three subcommands to the ``kvserve`` subparsers."""
    bench = sub.add_parser("bench", help="benchmark a server (serve) or the engine (throughput, latency)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    s = bsub.add_parser("serve", help="SLO-aware benchmark of an OpenAI-compatible server")
    s.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    s.add_argument("--host", default="127.0.0.1", help="server host, when --base-url is not given (as vLLM)")
    s.add_argument("--port", type=int, default=8000, help="server port, when --base-url is not given (as vLLM)")
    s.add_argument("--endpoint", default=None,
                   help="URL path, e.g. /v1/completions or /v1/chat/completions (sets --api; as vLLM)")
    s.add_argument("--model", required=True, help="model name sent in requests (and tokenizer, see --tokenizer)")
    s.add_argument("--api", default=None, choices=["completions", "chat"], help="default completions")
    s.add_argument("--backend", default=None, choices=sorted(BACKENDS),
                   help="vLLM's spelling of --api: openai-chat = chat, the others = completions")
    s.add_argument("--api-key", default=None)
    s.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=[*ds.DATASETS, *(d.replace("-", "_") for d in ds.DATASETS if "-" in d)])
    s.add_argument("--num-prompts", type=int, default=100, help="requests (multi-turn: sessions)")
    s.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals, requests/s (inf: all)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (closed loop)")
    s.add_argument("--sweep", type=_floats, default=None,
                   help="comma-separated concurrencies (or rates with --sweep-over rate), one run each")
    s.add_argument("--sweep-over", default="concurrency", choices=["concurrency", "rate"])
    s.add_argument("--sweep-prompts-per-concurrency", type=int, default=0,
                   help="a concurrency point C sends max(--num-prompts, this × C) requests")
    s.add_argument("--slo-ttft-p95", type=float, default=None, help="seconds")
    s.add_argument("--slo-tpot-p95", type=float, default=None, help="seconds")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=None, help="JSON path (default results/bench-serve-<time>.json)")
    s.add_argument("--plot", default=None, help="PNG path: latency percentiles vs throughput")
    s.add_argument("--tokenizer", default=None, help="catalog name/path for prompt lengths (default --model; "
                   "'none': 4 characters per token)")
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore it so output lengths are the dataset's)")
    s.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                   help="do not request logprobs (then coalesced chunks give one ITL sample each)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--no-progress", dest="progress", action="store_false")
    g = s.add_argument_group("datasets")
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length (tokens)")
    g.add_argument("--sharegpt-max-output-len", type=int, default=None, help="cap on the reply length (tokens)")
    g.add_argument("--sharegpt-max-input-len", type=int, default=1024, help="skip longer prompts (tokens)")
    g.add_argument("--sharegpt-max-total-len", type=int, default=2048, help="skip prompt + output over this")
    g.add_argument("--shared-prefix-words", type=int, default=600)
    g.add_argument("--question-words", type=int, default=24)
    g.add_argument("--output-len", type=int, default=64, help="shared-prefix and multi-turn output tokens")
    g.add_argument("--multi-turn-turns", type=int, default=4)
    s.set_defaults(func=cmd_bench_serve)

    from kvserve.config import EngineConfig

    t = bsub.add_parser("throughput", help="offline engine throughput on the mixed workload")
    EngineConfig.add_cli_args(t)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--workload-seed", type=int, default=0)
    t.add_argument("--out", default=None)
    t.set_defaults(func=cmd_bench_throughput)

    lat = bsub.add_parser("latency", help="single-request prefill and per-token decode time")
    EngineConfig.add_cli_args(lat)
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--output-len", type=int, default=64)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--out", default=None)
    lat.set_defaults(func=cmd_bench_latency)


def token_counter(name: str | None) -> tuple[ds.TokenCounter, str]:
    """(text -> token count, its source): the model's tokenizer through kvserve's catalog, or a 4-chars estimate."""
    if name and name != "none":
        try:
            from kvserve.models.catalog import resolve_model_path
            from kvserve.models.loader import load_hf_tokenizer

            tok = load_hf_tokenizer(resolve_model_path(name))
            return (lambda text: len(tok.encode(text, add_special_tokens=False))), f"tokenizer:{name}"
        except Exception as e:  # noqa: BLE001 - any failure falls back to the documented estimate
            logger.warning("no tokenizer for %r (%s); estimating 4 characters per token", name, e)
    return ds.estimate_tokens, "estimate:4-chars-per-token"


def build_requests(args: argparse.Namespace, n: int) -> tuple[list[ds.SampleRequest], dict[str, Any]]:
    """The workload's first ``n`` requests (multi-turn: sessions) and a description for the JSON."""
    info: dict[str, Any] = {"name": args.dataset, "seed": args.seed}
    if args.dataset == "random":
        reqs = ds.sample_random(n, args.seed, args.random_input_len, args.random_output_len, args.random_range_ratio)
        info["length_source"] = "exact (token ids)"
        return reqs, info
    count, info["length_source"] = token_counter(args.tokenizer or args.model)
    if args.dataset == "sharegpt":
        path = ds.sharegpt_path()
        records = ds.read_json_records(path)
        info.update(file=str(path), complete_records=len(records))
        reqs = ds.sample_sharegpt(records, n, args.seed, count, args.sharegpt_output_len,
                                  args.sharegpt_max_output_len, args.sharegpt_max_input_len,
                                  args.sharegpt_max_total_len)
    elif args.dataset == "shared-prefix":
        reqs = ds.sample_shared_prefix(n, args.seed, args.shared_prefix_words, args.question_words,
                                       args.output_len, count)
    else:
        reqs = ds.sample_multi_turn(n, args.seed, args.multi_turn_turns, args.question_words, args.output_len,
                                    count)
    return reqs, info


def _write_json(result: dict[str, Any], out: str | None, name: str) -> Path:
    path = Path(out) if out else Path("results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def resolve_target(args: argparse.Namespace) -> tuple[str, str, str | None]:
    """(base URL, api, endpoint) from our flags and vLLM's (``--host/--port``, ``--backend``, ``--endpoint``).

    Raises:
        ValueError: flags that contradict each other (e.g. ``--api completions --endpoint /v1/chat/completions``).
    """
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    apis = {name: api for name, api in (
        ("--api", args.api), ("--backend", BACKENDS.get(args.backend or "")),
        ("--endpoint", None if args.endpoint is None else
         "chat" if args.endpoint.rstrip("/").endswith("chat/completions") else "completions")) if api}
    if len(set(apis.values())) > 1:
        raise ValueError("flags disagree on the API: " + ", ".join(f"{k} -> {v}" for k, v in apis.items()))
    endpoint = args.endpoint if args.endpoint is None or args.endpoint.startswith("/") else "/" + args.endpoint
    return base_url.rstrip("/"), next(iter(apis.values()), "completions"), endpoint


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import sys

    from kvserve.bench.metrics import SLO, loadavg
    from kvserve.bench.report import make_console, plot_sweep, print_report
    from kvserve.bench.serve import ClientConfig, LoadSpec, sweep, warmup

    console = make_console()
    try:
        args.base_url, args.api, endpoint = resolve_target(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.dataset = args.dataset.replace("_", "-")
    slo = SLO(args.slo_ttft_p95, args.slo_tpot_p95)
    if args.sweep is None:
        loads = [LoadSpec(args.request_rate, args.max_concurrency)]
    elif args.sweep_over == "concurrency":
        loads = [LoadSpec(args.request_rate, int(c)) for c in args.sweep]
    else:
        loads = [LoadSpec(r, args.max_concurrency) for r in args.sweep]
    sizes = [max(args.num_prompts, args.sweep_prompts_per_concurrency * (ld.max_concurrency or 0)) for ld in loads]
    requests, info = build_requests(args, max(sizes))
    cfg = ClientConfig(args.base_url, args.model, args.api, args.api_key, args.ignore_eos, args.logprobs,
                       args.temperature, endpoint=endpoint)
    info.update(mean_prompt_len=sum(r.prompt_len for r in requests) / len(requests),
                mean_output_len=sum(r.output_len for r in requests) / len(requests))
    console.print(f"dataset {args.dataset}: {len(requests)} requests, mean prompt {info['mean_prompt_len']:.0f} "
                  f"tokens ({info['length_source']}), mean output {info['mean_output_len']:.0f}; load "
                  f"{loadavg()}")
    try:
        warmup(cfg, requests[0])
    except RuntimeError as e:  # server down, wrong model or endpoint: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2

    def on_point(p: dict[str, Any]) -> None:
        s = p["summary"]

        def ms(value: float | None) -> str:  # same unit as the table
            return "n/a" if value is None else f"{value * 1000:.0f} ms"

        verdict = f", meets SLO: {p['meets_slo']}" if slo.given else ""
        console.print(f"{p['label']}: {s['completed']}/{s['num_requests']} ok, {s['output_throughput']:.1f} "
                      f"tok/s, TTFT p95 {ms(s['ttft_s']['p95'])}, TPOT p95 {ms(s['tpot_s']['p95'])}{verdict}")

    result = sweep(cfg, requests, loads, sizes, slo, args.seed, args.progress, on_point)
    result = {"benchmark": "serve", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "base_url": args.base_url,
              "model": args.model, "api": args.api, "dataset": info, "slo": slo.as_dict(),
              "machine": {"node": platform.node(), "python": platform.python_version()},
              "args": {k: v for k, v in vars(args).items() if k != "func"}, **result}
    print_report(result, slo, console)
    path = _write_json(result, args.out, "bench-serve")
    console.print(f"wrote {path}")
    if args.plot:
        console.print(f"plot {plot_sweep(result, slo, Path(args.plot), f'{args.model}, {args.dataset}')}")
    return 0 if all(p["summary"]["failed"] == 0 for p in result["points"]) else 1


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from kvserve.bench.offline import run_throughput, set_threads
    from kvserve.config import EngineConfig

    set_threads(args.num_threads)
    res = run_throughput(EngineConfig.from_cli_args(args).to_dict(), args.num_prompts, args.workload_seed)
    print(f"mixed workload: {res['num_prompts']} requests, {res['prompt_tokens']} prompt tokens, "
          f"{res['requested_output_tokens']} output tokens in {res['duration_s']:.1f} s: "
          f"{res['output_throughput']:.1f} output tok/s, {res['request_throughput']:.2f} req/s, "
          f"{res['preemptions']} preemptions; load {res['loadavg_before']} -> {res['loadavg_after']}")
    print(f"wrote {_write_json(res, args.out, 'bench-throughput')}")
    return 0 if res["exact_token_counts"] else 1


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from kvserve.bench.offline import run_latency, set_threads
    from kvserve.config import EngineConfig

    set_threads(args.num_threads)
    res = run_latency(EngineConfig.from_cli_args(args).to_dict(), args.input_len, args.output_len, args.num_iters,
                      args.num_iters_warmup, args.seed)
    p, d = res["prefill_s"], res["decode_s_per_token"]
    print(f"prompt {args.input_len} tokens, output {args.output_len}: prefill mean {p['mean']:.3f} s "
          f"(p50 {p['p50']:.3f}, {res['prefill_tokens_per_s']:.0f} tok/s), decode mean {d['mean'] * 1000:.1f} "
          f"ms/token (p50 {d['p50'] * 1000:.1f}); load {res['loadavg_before']} -> {res['loadavg_after']}")
    print(f"wrote {_write_json(res, args.out, 'bench-latency')}")
    return 0
