"""``python -m lit_ddp.ft.lighthouse --bind HOST:PORT``: torchft's lighthouse in a process of its own, which prints
``lighthouse http://HOST:PORT`` once it listens (port 0: a free one, the one printed) and serves until it is
signalled. ``python -m lit_ddp.ft.launch`` and ``slurm/train_torchft.sbatch`` run it so, and start it again at the
same address when it dies: the groups' managers send their quorum requests again meanwhile (the strategy's
``quorum_retries``) and go on with the new one, which knows nothing of the old (a quorum forms again from the groups'
requests).

torchft's own ``torchft_lighthouse`` script would do as well, but it is installed where pip puts scripts, which need
not be on the ``PATH`` of every node, and it does not print the port it bound; this runs under the Python that runs
the groups.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading


def bound_address(server_address: str, bind: str) -> str:
    """The address groups reach the lighthouse at: the host of ``bind`` (a name resolved to its address), with the
    port of ``server_address`` (torchft's, which names the host by its host name, which may resolve to another
    interface; or ``bind`` itself where its port is not 0)."""
    port = server_address.rsplit(":", 1)[1].strip("/")
    host = bind.rsplit(":", 1)[0]
    if not host.startswith("["):
        host = socket.gethostbyname(host)
    return f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.ft.lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: a free one)")
    parser.add_argument("--min_replicas", type=int, default=1, help="the fewest groups a quorum forms with")
    parser.add_argument("--join_timeout_ms", type=int, default=2000)
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=5000)
    args = parser.parse_args(argv)
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(f"lighthouse {bound_address(server.address(), args.bind)}", flush=True)
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
