"""``python -m lit_ddp.ft.launch``: torchft's lighthouse and R replica groups on one machine.

    python -m lit_ddp.ft.launch --replica_groups 2 --root runs/regression/torchft -- \\
        fit --config configs/trainer/torchft.yaml --config configs/regression/single_device.yaml

starts the lighthouse (bound to loopback unless ``--bind`` says otherwise), prints its address, then starts each
group (``$TORCHFT_LIGHTHOUSE``, ``$REPLICA_GROUP_ID=group_<i>``, ``$TORCHFT_REPLICA_GROUPS=R``: group ``i`` trains
share ``i`` of each global batch; run directory ``<root>/group_<i>``), printing its process id at every start: a
``lit-ddp`` process of its own, or with ``--nproc_per_group W`` a torchrun job of W processes (``--standalone``,
``--trainer.devices W``). A group that fails is started again (at most ``--max_restarts`` times each; not one that
exited for bad use, a bad command or config) and rejoins the quorum from a live peer, the others going on
meanwhile. A torchrun group's dead worker ends its torchrun (``--max_restarts 0``), which the launcher starts
again: torchrun's own restart would start a bad config again too (it restarts on any failure and reports every one
with status 1), while the launcher learns of bad use from ``$LIT_DDP_BAD_USE_FILE``, which a worker exiting for it
creates. The price, measured here after a worker's SIGKILL: the group back 11.7 to 12.1 s after it, against 5.2 to
10.7 s with torchrun's own restart (a new torchrun's start-up, and its monitor's notice). Ends when every group has
ended: status 0 when all finished, else the first failure's (2 for bad use).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lit_ddp.errors import BAD_USE_FILE_ENV, UsageError
from lit_ddp.ft.strategy import LIGHTHOUSE_ENV, REPLICA_ENV, REPLICA_GROUPS_ENV, require_torchft


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    own, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.ft.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica_groups", type=int, default=2, help="R: how many replica groups (processes)")
    parser.add_argument(
        "--nproc_per_group", type=int, default=1, help="W: processes per group (W > 1: each group a torchrun job)"
    )
    parser.add_argument("--root", default="runs/torchft", help="each group's run directory is ROOT/group_<i>")
    parser.add_argument(
        "--bind",
        default="127.0.0.1:0",
        help="the lighthouse's listening address (port 0: a free one); loopback "
        "by default: a one-machine run needs nothing else (docs/security.md)",
    )
    parser.add_argument("--min_replicas", type=int, default=1, help="the fewest groups a quorum forms with")
    parser.add_argument(
        "--join_timeout_ms",
        type=int,
        default=2000,
        help="how long a quorum waits for a group that heartbeats but "
        "has not asked to join (a restarted one starting up): what a restart can cost the others, once",
    )
    parser.add_argument(
        "--heartbeat_timeout_ms",
        type=int,
        default=5000,
        help="a group silent this long is out of the quorum: about what a dead group costs the others",
    )
    parser.add_argument(
        "--max_restarts", type=int, default=3, help="restarts of each group (W > 1: of its torchrun job)"
    )
    args = parser.parse_args(own)
    if args.replica_groups < 1 or args.nproc_per_group < 1 or not command:
        parser.error(
            "give --replica_groups >= 1, --nproc_per_group >= 1 and, after --, the lit-ddp command (fit --config ...)"
        )
    return args, command


def lighthouse_address(server_address: str, bind: str) -> str:
    """The address groups reach the lighthouse at: loopback's where it is bound there (torchft reports the host
    name, which may resolve to another interface)."""
    port = server_address.rsplit(":", 1)[1].strip("/")
    host = bind.rsplit(":", 1)[0]
    return f"http://{host}:{port}" if host.startswith("127.") or host in ("localhost", "[::1]") else server_address


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(argv)
    require_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    address = lighthouse_address(server.address(), args.bind)
    print(f"lit_ddp.ft.launch: lighthouse {address} (bind {args.bind})", flush=True)

    def start(group: int) -> subprocess.Popen:
        group_env = {
            LIGHTHOUSE_ENV: address,
            REPLICA_ENV: f"group_{group}",
            REPLICA_GROUPS_ENV: str(args.replica_groups),
        }
        env = dict(os.environ, **group_env)
        run_dir = Path(args.root, f"group_{group}")
        cmd = [sys.executable, "-m", "lit_ddp", *command, "--trainer.default_root_dir", str(run_dir)]
        if args.nproc_per_group > 1:
            torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc_per_group)]
            cmd[1:3] = [*torchrun, "--max_restarts", "0", "-m", "lit_ddp"]
            cmd += ["--trainer.devices", str(args.nproc_per_group)]
        bad_use_file(group).unlink(missing_ok=True)
        env[BAD_USE_FILE_ENV] = str(bad_use_file(group))
        proc = subprocess.Popen(cmd, env=env)
        print(f"lit_ddp.ft.launch: group_{group} pid {proc.pid} run directory {run_dir}", flush=True)
        return proc

    bad_use_dir = tempfile.TemporaryDirectory(prefix="lit_ddp_ft_")

    def bad_use_file(group: int) -> Path:
        return Path(bad_use_dir.name, f"group_{group}")

    procs = {g: start(g) for g in range(args.replica_groups)}
    restarts = dict.fromkeys(procs, 0)
    status = 0

    def stop(signum: int, _frame: object) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while procs:
            for group, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[group]
                if code == 0:
                    print(f"lit_ddp.ft.launch: group_{group} finished", flush=True)
                elif code == UsageError.exit_code or bad_use_file(group).exists():  # every start would fail alike
                    print(f"lit_ddp.ft.launch: group_{group} exited with {code} (bad use): not restarted", flush=True)
                    status = status or UsageError.exit_code
                elif restarts[group] < args.max_restarts:
                    restarts[group] += 1
                    print(f"lit_ddp.ft.launch: group_{group} exited with {code}: restart {restarts[group]}", flush=True)
                    procs[group] = start(group)
                else:
                    print(f"lit_ddp.ft.launch: group_{group} exited with {code}, no restarts left", flush=True)
                    status = status or code
            time.sleep(0.1)
    finally:
        server.shutdown()
        bad_use_dir.cleanup()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
