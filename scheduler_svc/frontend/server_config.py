"""Front-end flags: where to listen, who may call, and the request limits. Safe defaults."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from scheduler_svc.core.message_checks import MAX_BEAM_WIDTH, MAX_LOGPROBS


@dataclass
class RequestLimits:
    max_n: int = 16  # completions per request
    max_logprobs: int = 20  # top candidates per token
    max_beam_width: int = 16  # beams per beam search
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    default_max_tokens: int = 256  # when the request leaves max_tokens unset
    max_prompt_bytes: int = 2**20  # UTF-8 bytes of a prompt, or of a chat's roles and contents


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0  # Prometheus /metrics; 0 turns it off
    model: str = ""  # tokenizer and chat template directory; empty means the embedded model
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    max_pending_requests: int = 1024  # engine sequences this front end has running in the engine
    max_stream_buffered_outputs: int = 64  # engine outputs a completion queues for a slow client; more are merged
    stream_stall_timeout_s: float = 60.0  # a stream whose client reads nothing this long ends (RESOURCE_EXHAUSTED)
    max_receive_message_mb: int = 0  # 0: room for a prompt of max_prompt_bytes and 1 MiB more
    tokenizer_threads: int = 2  # prompts tokenized at once, off the event loop
    api_key: str | None = None  # required as `authorization: Bearer <key>` when set
    tls_cert: str | None = None  # PEM server certificate chain; with tls_key, serve TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM CA bundle; when set, clients must present a certificate (mTLS)
    drain_grace_s: float = 30.0  # on SIGTERM, how long in-flight requests may finish
    scheduler_timeout_s: float = 10.0  # no stats reply for this long means the scheduler is lost
    share_port: bool = False  # SO_REUSEPORT: serve's --frontend-procs front ends listen on one port

    def receive_limit_bytes(self) -> int:
        """The largest request gRPC reads: a larger one is refused before it is held in memory."""
        if self.max_receive_message_mb:
            return self.max_receive_message_mb * 2**20
        return self.limits.max_prompt_bytes + 2**20  # the 1 MiB: sampling, stop strings, a chat's framing

    def validate(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        at_least_one = {"max_pending_requests": self.max_pending_requests, "max_n": self.limits.max_n,
                        "max_stream_buffered_outputs": self.max_stream_buffered_outputs,
                        "max_stop_string_length": self.limits.max_stop_string_length,
                        "default_max_tokens": self.limits.default_max_tokens,
                        "max_prompt_bytes": self.limits.max_prompt_bytes, "tokenizer_threads": self.tokenizer_threads}
        for name, value in at_least_one.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.limits.max_logprobs < 0 or self.limits.max_stop_strings < 0 or self.limits.max_beam_width < 0:
            raise ValueError("--max-logprobs, --max-stop-strings and --max-beam-width must be >= 0")
        # past the scheduler's own limits, a request the front end accepts would be refused there (INTERNAL)
        for flag, value, engine_limit in (("--max-logprobs", self.limits.max_logprobs, MAX_LOGPROBS),
                                          ("--max-beam-width", self.limits.max_beam_width, MAX_BEAM_WIDTH)):
            if value > engine_limit:
                raise ValueError(f"{flag} must be <= {engine_limit} (the scheduler's limit), got {value}")
        if not self.stream_stall_timeout_s > 0:
            raise ValueError(f"--stream-stall-timeout-s must be > 0, got {self.stream_stall_timeout_s}")
        if self.max_receive_message_mb < 0:
            raise ValueError(f"--max-receive-message-mb must be >= 0, got {self.max_receive_message_mb}")


def add_server_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    d, limits = ServerConfig(), RequestLimits()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=os.environ.get("NANOSERVE_HOST", d.host), help="address to bind")
    g.add_argument("--port", type=int, default=int(os.environ.get("NANOSERVE_PORT", d.port)))
    g.add_argument("--metrics-port", type=int, default=int(os.environ.get("NANOSERVE_METRICS_PORT", d.metrics_port)),
                   help="serve Prometheus metrics on this port (0: off)")
    if with_model:
        g.add_argument("--model", default="", help="tokenizer directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                   help="require `authorization: Bearer <key>` (or set NANOSERVE_API_KEY)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain; serve TLS")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, help="PEM CA bundle; require client certificates (mTLS)")
    g.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s,
                   help="on SIGTERM, let in-flight requests finish for this long")
    g.add_argument("--scheduler-timeout-s", type=float, default=d.scheduler_timeout_s)
    g.add_argument("--tokenizer-threads", type=int, default=d.tokenizer_threads,
                   help="prompts tokenized at once, off the event loop")
    g.add_argument("--share-port", type=int, choices=[0, 1], default=0, help=argparse.SUPPRESS)  # set by serve
    g = parser.add_argument_group("limits")
    g.add_argument("--max-pending-requests", type=int, default=d.max_pending_requests,
                   help="sequences running in the engine before new requests get RESOURCE_EXHAUSTED")
    g.add_argument("--max-stream-buffered-outputs", type=int, default=d.max_stream_buffered_outputs,
                   help="engine outputs a completion queues while its client reads slowly; later ones are merged "
                        "into larger messages")
    g.add_argument("--stream-stall-timeout-s", type=float, default=d.stream_stall_timeout_s,
                   help="end a stream (RESOURCE_EXHAUSTED, its engine requests aborted) whose client reads "
                        "nothing for this long")
    g.add_argument("--max-prompt-bytes", type=int, default=limits.max_prompt_bytes,
                   help="UTF-8 bytes of a prompt or of a chat's roles and contents; larger is INVALID_ARGUMENT")
    g.add_argument("--max-receive-message-mb", type=int, default=d.max_receive_message_mb,
                   help="largest request gRPC reads (0: --max-prompt-bytes plus 1 MiB)")
    g.add_argument("--max-n", type=int, default=limits.max_n)
    g.add_argument("--max-logprobs", type=int, default=limits.max_logprobs)
    g.add_argument("--max-beam-width", type=int, default=limits.max_beam_width)
    g.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings)
    g.add_argument("--max-stop-string-length", type=int, default=limits.max_stop_string_length)
    g.add_argument("--default-max-tokens", type=int, default=limits.default_max_tokens)


def server_argv(config: ServerConfig) -> list[str]:
    """The flags that make `nanoserve frontend` take this config (the api key excepted: it goes by
    NANOSERVE_API_KEY, so that it never shows in a process list)."""
    values = {**{f.name: getattr(config.limits, f.name) for f in dataclasses.fields(RequestLimits)},
              **{f.name: getattr(config, f.name) for f in dataclasses.fields(ServerConfig)
                 if f.name not in ("limits", "api_key")}}
    argv = []
    for name, value in values.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(int(value) if isinstance(value, bool) else value)]
    return argv


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    limits = RequestLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)})
    names = [f.name for f in dataclasses.fields(ServerConfig) if f.name != "limits"]
    config = ServerConfig(limits=limits, **{n: getattr(args, n) for n in names if hasattr(args, n)})
    config.share_port = bool(config.share_port)
    config.validate()
    return config
