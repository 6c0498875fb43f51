"""A SuperNode's SuperExec that starts each message's ClientApp process warm: a fork of itself, with Flower, torch
and this project's ClientApp already imported.

Flower runs a fresh ClientApp process per message (Flower's process isolation; ``flwr-clientapp`` serves one task
and exits). With a SuperNode started with ``--isolation process``, the SuperNode launches no SuperExec: the operator
starts one beside it, and this is that SuperExec. It polls the SuperNode's Runtime API for a ClientApp task (Flower's
``AcquireTask``, every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds, default 0.1) as ``flower-superexec`` does, and
for each one forks a child that runs Flower's own ClientApp process (``flwr.supernode.runtime.run_clientapp``: the
task's token, its heartbeat, the message in and the reply out over the Runtime API) and exits. Only the start-up
changes: the child begins with the imports done (about 2 s of CPU a message on a 2-core machine), not a fresh
interpreter. It opens no port and reads nothing but the Runtime API's answers, talks only to the address it is given
(TLS with ``--root-certificates``, as ``flower-superexec``), and ends when the SuperNode (``--parent-pid``) does; its
children end with it, each within a fraction of a second.

    flower-supernode --isolation process --port 9094 ...   # then, on the same machine:
    python -m fl_server.flower.superexec --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid SUPERNODE_PID
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Callable, NoReturn

DEFAULT_POLL_S = 0.1  # Flower's own SuperExec polls every 1 s by default


def _poll_interval() -> float:
    raw = os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(DEFAULT_POLL_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.01 <= value <= 60:
        raise SystemExit(f"error: FLWR_SUPEREXEC_TASK_POLL_INTERVAL={raw!r}: give seconds between 0.01 and 60")
    return value


def _end_with(parent_pid: int) -> None:
    """Interrupt the main thread (KeyboardInterrupt) within 0.2 s of ``parent_pid``'s end. Flower's own monitor
    (``flwr.supercore.app_utils.start_parent_process_monitor``) raises SIGINT in its watching thread, which the main
    thread acts on only when its current wait ends: after a retry's backoff of up to 20 s against a Runtime API that
    is gone with its SuperNode. Sent to the main thread, the signal cuts that wait short."""
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        while True:
            time.sleep(0.2)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # alive, under another user
                continue
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _reap() -> None:
    """Collect the ClientApp children that exited (no zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fl_server.flower.superexec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime-api-address", required=True,
                    help="the SuperNode's Runtime API (HOST:PORT, its --port)")
    tls = ap.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="no TLS to the Runtime API (loopback only)")
    tls.add_argument("--root-certificates", help="CA certificate of the SuperNode's Runtime API (its --ssl-certfile)")
    ap.add_argument("--parent-pid", type=int, help="end when this process (the SuperNode) ends")
    args = ap.parse_args(argv)
    interval = _poll_interval()

    # what every ClientApp child would otherwise import anew: Flower's ClientApp runtime and the app, and
    # torch._dynamo, which a process's first torch.func.grad imports (about 1 s of CPU; fl_server.functional.grad;
    # about 70 MB of resident memory here, shared with the forks)
    import torch._dynamo  # noqa: F401
    import fl_server.flower.client_app  # noqa: F401
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime import run_clientapp as clientapp_process
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    # A warm child asks for the message's content within ~0.1 s of the task, often before its SuperNode has pulled it
    # from the SuperLink; Flower's ClientApp then retries after PULL_INITIAL_BACKOFF = 1 s (sized for a cold process
    # start). Its first retry after 0.05 s instead (then doubling, as Flower's): the only Flower default changed.
    clientapp_process.pull_and_inflate_object_from_tree.__kwdefaults__["initial_backoff"] = 0.05

    certificates = validate_and_resolve_root_certificates(args.root_certificates, args.insecure)
    client = RuntimeHttpClient.from_server_address(
        server_address=args.runtime_api_address, insecure=args.insecure, root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker())
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    try:
        if args.parent_pid is not None:
            _end_with(args.parent_pid)  # KeyboardInterrupt here when the SuperNode is gone
        while True:
            _reap()
            res = client.AcquireTask(request)
            if res.HasField("task") and res.token and os.fork() == 0:  # the child: Flower's ClientApp process
                _clientapp(lambda: run_clientapp(
                    runtime_api_address=args.runtime_api_address, token=res.token, insecure=args.insecure,
                    certificates=certificates, parent_pid=os.getppid()), os.getppid())  # it ends when this does
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _clientapp(run: Callable[[], None], parent_pid: int) -> NoReturn:
    """Run Flower's ClientApp process in this forked child, then end it with Flower's exit code; within 0.2 s of
    ``parent_pid``'s end (this SuperExec's) with code 1, also in the middle of a retry's backoff (:func:`_end_with`:
    Flower's own monitor, which ``run`` starts too, waits that backoff out)."""
    code = 1
    try:
        _end_with(parent_pid)
        run()
    except SystemExit as exc:  # Flower's flwr_exit, after the reply and the task's output are pushed
        code = exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:  # the SuperExec is gone: so is the task's Runtime API
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # nothing of the parent's (its HTTP client) is closed or run from here


if __name__ == "__main__":
    raise SystemExit(main())
