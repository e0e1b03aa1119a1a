"""The scheduler process: its two ZeroMQ ROUTER sockets (front ends, executors) around the EngineCore.

The scheduler binds both; front ends and executors connect. Every frame is a protobuf message
(invariant 2); the core decodes them.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import zmq
from zmq.utils.monitor import recv_monitor_message

from protos import engine_pb2
from scheduler_svc.common.config import add_engine_args, engine_config_from_args
from scheduler_svc.common.parent_watch import add_watch_parent_flag, watch_parent
from scheduler_svc.core.engine_core import EngineCore
from scheduler_svc.core.executor_registry import EngineLostError

log = logging.getLogger("nanoserve.scheduler")

MAX_MESSAGE_BYTES = 64 << 20  # a peer that sends more is disconnected (no legitimate message comes near)


class ZmqTransport:
    def __init__(self, frontend_addr: str, executor_addr: str) -> None:
        self.ctx = zmq.Context()
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.frontend.bind(frontend_addr)
        self.executors = self.ctx.socket(zmq.ROUTER)
        self.executors.setsockopt(zmq.LINGER, 0)
        self.executors.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.executors.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted executor reclaims its identity
        # a send to an executor that is gone fails at once instead of vanishing: how a dead rank is found
        self.executors.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.executors.bind(executor_addr)
        self.executor_events = self.executors.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.executors, zmq.POLLIN)
        self.poller.register(self.executor_events, zmq.POLLIN)

    def send_frontend(self, identity: bytes, msg: engine_pb2.SchedulerToFrontend) -> None:
        try:
            self.frontend.send_multipart([identity, msg.SerializeToString()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # front end gone: its requests are aborted when it says so
            log.warning("cannot reach frontend %r: %s", identity, exc)

    def send_executor(self, rank: int, msg: engine_pb2.SchedulerToExecutor) -> None:
        try:
            self.executors.send_multipart([f"rank{rank}".encode(), msg.SerializeToString()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise EngineLostError(f"cannot send to executor rank {rank}: {exc}") from exc

    def poll(self, timeout_ms: int, core: EngineCore) -> None:
        events = dict(self.poller.poll(timeout_ms))
        if self.executor_events in events:
            while self.executor_events.poll(0):
                recv_monitor_message(self.executor_events)
            core.on_executor_disconnected()
        for sock, handle in ((self.frontend, core.on_frontend), (self.executors, core.on_executor)):
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:  # a ROUTER frame is [identity, payload]: one message per send
                    core.reject_message(frames[0], f"a message of {len(frames) - 1} frames, not one")
                    continue
                handle(frames[0], frames[1])

    def close(self) -> None:
        self.executors.disable_monitor()
        self.executor_events.close()
        self.frontend.close()
        self.executors.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("nanoserve scheduler", description="the control-plane process")
    parser.add_argument("--frontend-addr", default=os.environ.get("NANOSERVE_FRONTEND_ADDR", "tcp://127.0.0.1:5559"),
                        help="ZMQ address to bind for frontends")
    parser.add_argument("--executor-addr", default=os.environ.get("NANOSERVE_EXECUTOR_ADDR", "tcp://127.0.0.1:5560"),
                        help="ZMQ address to bind for executors")
    add_watch_parent_flag(parser)
    parser.add_argument("--log-level", default=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"))
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    if args.watch_parent is not None:
        watch_parent(args.watch_parent)
    transport = ZmqTransport(args.frontend_addr, args.executor_addr)
    core = EngineCore(engine_config_from_args(args), transport)

    def on_term(signum, frame):
        core.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        core.run()
    finally:
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
