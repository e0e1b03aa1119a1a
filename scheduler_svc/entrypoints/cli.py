"""The `nanoserve` command: one entry point for every role and for offline generation."""
from __future__ import annotations

import argparse
import json
import os
import sys

from scheduler_svc.common.config import add_engine_args, engine_args_from_env, engine_config_from_args
from scheduler_svc.common.parent_watch import add_watch_parent_flag, watch_parent
from scheduler_svc.entrypoints.probe import add_probe_args, run_probe
from scheduler_svc.entrypoints.sampling_args import add_sampling_args, constraint_from_args
from scheduler_svc.frontend.server_config import add_server_args


def _cmd_generate(args: argparse.Namespace) -> int:
    from scheduler_svc.entrypoints.llm import LLM
    from scheduler_svc.frontend.sampling_params import SamplingParams
    from scheduler_svc.frontend.validation import check_sampling

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("nanoserve generate: give prompts as arguments or with --prompts-file", file=sys.stderr)
        return 2
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos, n=args.n, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        beam_width=args.beam_width, length_penalty=args.length_penalty, **constraint_from_args(args))
    try:
        check_sampling(params)  # the engine-independent checks, before the engine starts
    except ValueError as exc:
        print(f"nanoserve generate: {exc}", file=sys.stderr)
        return 2
    config = engine_config_from_args(args)
    with LLM(**vars(config)) as llm:
        inputs = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
        results = llm.generate(inputs, params, use_tqdm=not args.no_progress)
        for prompt, result in zip(prompts, results):
            for out in result.outputs:
                if args.json:
                    print(json.dumps({"prompt": prompt, "index": out.index, "text": out.text,
                                      "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                                      "num_prompt_tokens": len(result.prompt_token_ids),
                                      "num_cached_tokens": result.num_cached_tokens}))
                else:
                    print(f"=== {prompt!r} [{out.index}] ({out.finish_reason}, {len(out.token_ids)} tokens)")
                    print(out.text)
    return 0


def _setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level, format="%(asctime)s frontend %(levelname)s %(message)s")


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import functools

    from scheduler_svc.entrypoints.launcher import frontend_argv, launch_engine
    from scheduler_svc.frontend.server import run_frontend
    from scheduler_svc.frontend.server_config import server_argv, server_config_from_args
    from scheduler_svc.entrypoints.supervisor import supervise

    _setup_logging(args.log_level)
    engine_config = engine_config_from_args(args)
    server_config = server_config_from_args(args)
    server_config.model = engine_config.model
    if args.frontend_procs < 1:
        print(f"nanoserve serve: --frontend-procs must be >= 1, got {args.frontend_procs}", file=sys.stderr)
        return 2
    if args.frontend_procs > 1 and server_config.port == 0:
        print("nanoserve serve: --frontend-procs > 1 needs a fixed --port (they share it)", file=sys.stderr)
        return 2
    server_config.share_port = args.frontend_procs > 1
    procs = launch_engine(engine_config)
    try:
        if args.frontend_procs > 1:
            env = {**procs.env, **({"NANOSERVE_API_KEY": server_config.api_key} if server_config.api_key else {})}
            argvs = []
            for i in range(1, args.frontend_procs):
                extra = dataclasses.replace(server_config, metrics_port=server_config.metrics_port + i
                                            if server_config.metrics_port else 0)
                argvs.append(frontend_argv(procs, server_argv(extra) + ["--log-level", args.log_level]))
            procs.start_frontends(argvs, env)
        return asyncio.run(run_frontend(server_config, procs.frontend_addr,
                                        supervise=functools.partial(supervise, procs)))
    finally:
        procs.shutdown()


def _cmd_frontend(args: argparse.Namespace) -> int:
    import asyncio

    from scheduler_svc.frontend.server import run_frontend
    from scheduler_svc.frontend.server_config import server_config_from_args

    _setup_logging(args.log_level)
    if args.watch_parent is not None:
        watch_parent(args.watch_parent)
    return asyncio.run(run_frontend(server_config_from_args(args), args.scheduler_addr))


def _add_client_parsers(client: argparse.ArgumentParser) -> None:
    from scheduler_svc.entrypoints.client import add_client_args

    sub = client.add_subparsers(dest="client_command", required=True)
    for name, help_text in [("generate", "generate from a text prompt"), ("chat", "one chat turn, templated"),
                            ("tokenize", "text to tokens"), ("info", "the model and the engine"),
                            ("stats", "scheduler counters"), ("health", "exit 0 when SERVING")]:
        p = sub.add_parser(name, help=help_text)
        add_client_args(p)
        if name in ("generate", "chat"):
            p.add_argument("message" if name == "chat" else "prompt")
            if name == "chat":
                p.add_argument("--system", default="", help="a system message first")
            p.add_argument("--no-stream", action="store_true", help="one unary Generate call")
            p.add_argument("--priority", type=int, default=0)
            add_sampling_args(p)
        elif name == "tokenize":
            p.add_argument("text")
        elif name == "health":
            p.add_argument("--service", default="", help='"" (the server) or nanoserve.v1.Generation')


def _cmd_executor(argv: list[str]) -> int:
    # exec, so that this process (part of scheduler_svc) never imports torch itself
    os.execv(sys.executable, [sys.executable, "-m", "executor_svc", *argv])
    return 1


def _cmd_scheduler(argv: list[str]) -> int:
    from scheduler_svc.core.scheduler_process import main

    return main(argv)


# The commands that take engine flags, and so also read them from $NANOSERVE_ENGINE_ARGS.
ENGINE_COMMANDS = ("executor", "scheduler", "serve", "generate")


def build_parser() -> argparse.ArgumentParser:
    """The `nanoserve` parser with its generate, serve, frontend, client subcommands (the scheduler and the
    executor parse their own flags); torch-free, so the README's flag tables are checked against it."""
    parser = argparse.ArgumentParser("nanoserve", description="nanoserve: an LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for prompts")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_args(gen)
    add_sampling_args(gen)
    serve = sub.add_parser("serve", help="serve gRPC with every role on this machine")
    add_engine_args(serve)
    add_server_args(serve, with_model=False)
    serve.add_argument("--log-level", default=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"))
    serve.add_argument("--frontend-procs", type=int, default=int(os.environ.get("NANOSERVE_FRONTEND_PROCS", 1)),
                       help="gRPC front-end processes sharing --port (the kernel spreads connections over "
                            "them); extra ones serve metrics on --metrics-port + i")
    frontend = sub.add_parser("frontend", help="serve gRPC in front of a separately running scheduler")
    frontend.add_argument("--scheduler-addr",
                          default=os.environ.get("NANOSERVE_SCHEDULER_ADDR", "tcp://127.0.0.1:5559"),
                          help="the scheduler's frontend socket (its --frontend-addr)")
    add_server_args(frontend)
    frontend.add_argument("--log-level", default=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"))
    add_watch_parent_flag(frontend, hidden=True)  # serve's own front ends
    _add_client_parsers(sub.add_parser("client", help="call a running server"))
    add_probe_args(sub.add_parser("probe", help="a container health check: exit 0 when the given TCP ports "
                                                "listen or are connected to"))
    sub.add_parser("scheduler", help="run the scheduler process (see nanoserve scheduler --help)")
    sub.add_parser("executor", help="run one executor rank (see nanoserve executor --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ENGINE_COMMANDS:  # flags on the command line come last: they win
        argv = [argv[0], *engine_args_from_env(), *argv[1:]]
    # roles that parse their own flags
    if argv and argv[0] == "executor":
        return _cmd_executor(argv[1:])
    if argv and argv[0] == "scheduler":
        return _cmd_scheduler(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _cmd_generate(args)
    if args.command == "serve":
        return _cmd_serve(args)
    if args.command == "frontend":
        return _cmd_frontend(args)
    if args.command == "probe":
        return run_probe(args)
    if args.command == "client":
        from scheduler_svc.entrypoints.client import run_client

        return run_client(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
