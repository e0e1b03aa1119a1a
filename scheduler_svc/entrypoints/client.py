"""`nanoserve client`: call a running server from the terminal; generations stream as they come."""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2, generation_pb2_grpc
from scheduler_svc.entrypoints.sampling_args import constraint_from_args

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in generation_pb2.FinishReason.items()}


def add_client_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("connection")
    g.add_argument("--addr", default=os.environ.get("NANOSERVE_ADDR", "localhost:50051"), help="host:port")
    g.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"), help="sent as `authorization: Bearer`")
    g.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify the server; enables TLS")
    g.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS)")
    g.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if args.tls_ca:
        def read(path):
            with open(path, "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key) if args.tls_key else None,
                                             read(args.tls_cert) if args.tls_cert else None)
        return grpc.secure_channel(args.addr, creds)
    return grpc.insecure_channel(args.addr)


def sampling_from_args(args: argparse.Namespace) -> generation_pb2.SamplingParams:
    sp = generation_pb2.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
        n=args.n, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        beam_width=args.beam_width, length_penalty=args.length_penalty)
    if args.sampling_seed is not None:
        sp.seed = args.sampling_seed
    for kind, value in constraint_from_args(args).items():
        if kind == "choice":
            sp.choice.choices.extend(value)
        else:
            setattr(sp, kind, value)
    return sp


def _generate(stub, request: generation_pb2.GenerateRequest, args, metadata) -> int:
    if args.no_stream:
        response = stub.Generate(request, timeout=args.timeout, metadata=metadata)
        for out in response.outputs:
            if len(response.outputs) > 1:
                print(f"=== [{out.index}]")
            print(out.text)
            print(f"[{FINISH_NAMES[out.finish_reason]}, {len(out.token_ids)} tokens]", file=sys.stderr)
        return 0
    texts, n = {}, request.sampling.n or 1
    for response in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
        for out in response.outputs:
            if n == 1:  # one completion: print as it comes
                sys.stdout.write(out.text)
                sys.stdout.flush()
            else:  # several: print each whole, when it ends
                texts[out.index] = texts.get(out.index, "") + out.text
            if out.finish_reason:
                if n > 1:
                    print(f"=== [{out.index}]\n{texts[out.index]}", end="")
                print()
                print(f"[{FINISH_NAMES[out.finish_reason]}]", file=sys.stderr)
        if response.HasField("usage"):
            u = response.usage
            print(f"[prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {u.cached_prompt_tokens}]",
                  file=sys.stderr)
    return 0


def _health(channel: grpc.Channel, args, metadata) -> int:
    response = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout or 5, metadata=metadata)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


def run_client(args: argparse.Namespace) -> int:
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    with open_channel(args) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            if args.client_command == "health":
                return _health(channel, args, metadata)
            if args.client_command in ("generate", "chat"):
                request = generation_pb2.GenerateRequest(sampling=sampling_from_args(args), priority=args.priority)
                if args.client_command == "generate":
                    request.prompt = args.prompt
                else:
                    messages = [generation_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
                    messages.append(generation_pb2.ChatMessage(role="user", content=args.message))
                    request.messages.messages.extend(messages)
                return _generate(stub, request, args, metadata)
            if args.client_command == "tokenize":
                response = stub.Tokenize(generation_pb2.TokenizeRequest(text=args.text), timeout=args.timeout,
                                         metadata=metadata)
            elif args.client_command == "info":
                response = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=args.timeout,
                                             metadata=metadata)
            else:
                response = stub.GetStats(generation_pb2.GetStatsRequest(), timeout=args.timeout, metadata=metadata)
            print(json_format.MessageToJson(response, always_print_fields_with_no_presence=True))
            return 0
        except grpc.RpcError as exc:
            print(f"nanoserve client: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
