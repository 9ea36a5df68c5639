"""The ``kvserve`` command: ``generate`` (offline completion), ``serve`` (OpenAI server), ``bench`` (benchmarks,
docs/benchmarking.md), ``plan`` (capacity planner, docs/planner.md) and ``proxy`` (the prefill/decode
disaggregation proxy, kvserve/disagg/proxy.py) and ``router`` (the data-parallel router, docs/distributed.md).

    kvserve generate --model smollm2-135m-instruct --prompt "The capital of France is" --max-tokens 32
    kvserve serve smollm2-135m-instruct --port 8000
    kvserve serve smollm2-135m-instruct --port 8000 --data-parallel-size 2 --num-threads 1   # replicas on Ray
    kvserve bench serve --model smollm2-135m-instruct --dataset sharegpt --sweep 1,4,16 --slo-ttft-p95 2
    kvserve plan --model smollm2-135m-instruct --memory-gib 2
    kvserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    kvserve router --replica http://127.0.0.1:8100 http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.sampling_params import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None,
                   help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    config = EngineConfig.from_cli_args(args)
    t0 = time.perf_counter()
    llm = LLM(**config.to_dict())
    load_s = time.perf_counter() - t0
    prompts = args.prompt or ["The capital of France is"]
    t0 = time.perf_counter()
    try:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        gen_s = time.perf_counter() - t0
        llm.engine.close()  # (tensor-parallel workers stop here, not at interpreter exit)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        print(f"--- prompt: {prompt!r}")
        print(prompt + c.text if not args.chat else c.text)
        print(f"--- {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    e = llm.engine
    print(f"[kvserve] model {config.model} on {e.device} ({e.dtype}, KV cache {e.kv_dtype}), load {load_s:.1f} s, "
          f"{n} tokens in {gen_s:.2f} s ({n / max(gen_s, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: an LLM inference serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline and print the text")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    EngineConfig.add_cli_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model (as vLLM's `vllm serve MODEL`); same as --model")
    EngineConfig.add_cli_args(serve)
    from kvserve.entrypoints.openai.server import add_server_args

    add_server_args(serve)
    from kvserve.distributed.data_parallel import add_data_parallel_args
    from kvserve.distributed.router_cli import add_routing_args

    add_data_parallel_args(serve)
    add_routing_args(serve)
    # --model defaults to None here, so that cmd_serve can tell `--model DEFAULT` (a conflict with MODEL) from no
    # --model; cmd_serve puts the default in
    serve.set_defaults(func=cmd_serve, model=None)
    from kvserve.bench.cli import add_bench_parser
    from kvserve.disagg.proxy_cli import add_proxy_parser
    from kvserve.distributed.router_cli import add_router_parser
    from kvserve.planner.cli import add_plan_parser

    add_bench_parser(sub)
    add_plan_parser(sub)
    add_proxy_parser(sub)
    add_router_parser(sub)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.server import run_server

    if args.model_tag is not None:
        if args.model not in (None, args.model_tag):
            raise InvalidRequestError(f"model: given twice, as {args.model_tag!r} and --model {args.model!r}",
                                      param="model")
        args.model = args.model_tag
    elif args.model is None:
        args.model = EngineConfig().model
    from kvserve.distributed.data_parallel import check_data_parallel_args

    if check_data_parallel_args(args):
        from kvserve.distributed.data_parallel import run_data_parallel

        return run_data_parallel(args)
    return run_server(args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KVServeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvserve plan --json | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
