"""How a healing replica group receives a live peer's state: :class:`SignedTransport`, the checkpoint transport
lit-ddp hands torchft's ``Manager`` (its public ``checkpoint_transport`` argument) in place of torchft's
``HTTPTransport``.

torchft 0.2.0's ``HTTPTransport`` serves the sender's live tensors on CPU (it copies only accelerator tensors), to
anyone who asks for the current step, on every interface, and unpickles what a healing group receives. This one:

- **takes a copy at the step boundary**: ``send_checkpoint`` (called in the quorum, before the sender's next
  forward) serializes the state with ``torch.save`` into bytes at once, on every device, so that a buffer the sender
  changes in place during its next step reaches the healing group as it was at the boundary;
- **listens on the group's own address** (loopback where the lighthouse is: :func:`own_address`), never every
  interface;
- **answers only the job's groups**: a request must carry an HMAC, made with the job's secret
  (:mod:`lit_ddp.launch.secret`), of the server's address, the step, a fresh nonce and the time; a relayed or
  replayed request (another address, a nonce seen before, a time outside :data:`REQUEST_WINDOW_S`) is refused too;
- **proves what it sends**: the answer carries the SHA-256 digest of the bytes and an HMAC of (address, step, the
  request's nonce, digest, length), so the receiver checks that the sender holds the job's secret before reading
  the body, and that the bytes are those the sender serialized before loading them, ``torch.load(weights_only=True)``
  (tensors and plain data: nothing received runs code).

A failure raises :class:`HealRefused` with one line; torchft records it on the manager, the step is not committed,
and the group asks again at its next quorum. No library found does this (torchft's transports have no
authentication; torch's ``_streaming_save`` streams live tensors), hence this module; the state moved is whatever the
registered state function returns (:class:`lit_ddp.ft.heal.PeerState`).

torchft is not imported here: the class has the methods of torchft's ``CheckpointTransport`` interface
(``metadata``, ``send_checkpoint``, ``disallow_checkpoint``, ``recv_checkpoint``, ``shutdown``), which the manager
calls.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import logging
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from lit_ddp.launch.secret import is_tag, tag
from lit_ddp.strategies import loopback

NONCE, TIME, AUTH = "X-Lit-DDP-Nonce", "X-Lit-DDP-Time", "X-Lit-DDP-Auth"
DIGEST, STATE_TAG = "X-Lit-DDP-Digest", "X-Lit-DDP-Tag"
REQUEST_WINDOW_S = 300.0
"""How far a request's time may be from the server's clock (the nodes' clocks may differ by this much)."""
_METADATA = re.compile(r"^http://(\[[0-9a-fA-F:.]+\]|[0-9.]+|[A-Za-z0-9.-]+):(\d+)/state/$")
_log = logging.getLogger(__name__)


class HealRefused(RuntimeError):
    """A healing group did not load a peer's state (the peer refused it, or the state was not the job's or not
    intact); one line, ending in what happens next."""


def own_address(lighthouse: str) -> str:
    """The address this process's servers listen on and are reached at: ``127.0.0.1`` where the lighthouse is on
    loopback (one machine), else the address of this host's interface that routes to the lighthouse (the one the
    other nodes reach it by). ``lighthouse``: ``http://HOST:PORT``."""
    host, port = lighthouse.split("://")[-1].rstrip("/").rsplit(":", 1)
    host = host.strip("[]")
    if loopback.is_loopback(host):
        return loopback.LOOPBACK
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # UDP connect sends nothing: it picks the route
        probe.connect((host, int(port)))
        return str(probe.getsockname()[0])


def url_host(address: str) -> str:
    """``address`` as it goes in a URL (an IPv6 address in brackets)."""
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        return address


def quiet_refused_heals() -> None:
    """Keeps torchft's manager from logging a :class:`HealRefused` with its traceback (the strategy prints its one
    line): a filter on the ``torchft.manager`` logger, added once."""
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _RefusedHeals) for f in logger.filters):
        logger.addFilter(_RefusedHeals())


class _RefusedHeals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HealRefused))


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, handler: type[BaseHTTPRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, 0), handler)


class SignedTransport:
    """torchft's checkpoint transport with a copy at the step boundary, an authenticated HTTP server on this
    process's address and a verified load (the module's docstring says what each guards against).

    Args:
        secret: the job's secret (:func:`lit_ddp.launch.secret.job_secret`), the same in every group.
        host: the address to listen on (:func:`own_address`).
        timeout: a transfer's (the strategy's ``timeout``).
        label: who this is in messages (``group_1 rank 0``).
    """

    def __init__(self, secret: bytes, host: str, timeout: timedelta, label: str) -> None:
        self.secret, self.timeout, self.label = secret, timeout, label
        self._lock = threading.Condition()
        self._snapshot: tuple[int, bytes, str] | None = None  # (step, bytes, digest) until disallowed
        self._over = -1  # the last step whose snapshot was dropped
        self._nonces: dict[str, float] = {}  # seen nonce -> when it may be forgotten
        self._server = _Server(host, self._handler())
        self.base = f"http://{url_host(host)}:{self._server.server_address[1]}/state/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="lit_ddp_heal_server")
        self._thread.start()

    # torchft's CheckpointTransport interface

    def metadata(self) -> str:
        """Where this process's state is served (``http://HOST:PORT/state/``), which the quorum hands a healing group."""
        return self.base

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serializes ``state_dict`` now (the step boundary: the copy the healing group gets) and serves it for
        ``step`` until :meth:`disallow_checkpoint`."""
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        data = buffer.getvalue()
        with self._lock:
            self._snapshot = (step, data, hashlib.sha256(data).hexdigest())
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        """The step is over (torchft calls this in ``should_commit``): the snapshot is dropped."""
        with self._lock:
            if self._snapshot is not None:
                self._over = max(self._over, self._snapshot[0])
            self._snapshot = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """A peer's state of ``step`` from ``metadata`` (its :meth:`metadata`), checked before it is loaded.

        Raises:
            HealRefused: the address is not one of this transport's, the peer refused the request (it does not hold
                this job's secret, or this process does not), the answer carries no tag of the job's secret, or its
                bytes do not match the digest it was sent with.
        """
        where = f"torchft heal ({self.label}): the state of step {step} from {metadata}"
        if _METADATA.match(metadata) is None:
            raise HealRefused(f"{where}: not an address of a lit-ddp group; not loaded, the group asks again")
        nonce, now = secrets.token_hex(16), f"{time.time():.3f}"
        request = urllib.request.Request(
            f"{metadata}{step}",
            headers={NONCE: nonce, TIME: now, AUTH: tag(self.secret, "heal request", metadata, step, nonce, now)},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        try:
            with opener.open(request, timeout=self.timeout.total_seconds()) as answer:
                digest, length = answer.headers.get(DIGEST), answer.headers.get("Content-Length", "")
                signed = answer.headers.get(STATE_TAG)
                if not length.isdigit() or not is_tag(self.secret, signed, "heal state", metadata, step, nonce,
                                                      str(digest), length):  # fmt: skip
                    raise HealRefused(
                        f"{where} carries no tag made with this job's secret: its sender is not one of the job's "
                        "groups; not loaded, the group asks again"
                    )
                data = answer.read(int(length))
        except urllib.error.HTTPError as e:
            reason = "refused: this process's secret is not the peer's" if e.code == 403 else f"HTTP {e.code}"
            raise HealRefused(f"{where}: {reason}; not loaded, the group asks again") from None
        except (OSError, ValueError) as e:
            raise HealRefused(f"{where}: {type(e).__name__}: {e}; not loaded, the group asks again") from None
        if len(data) != int(length) or hashlib.sha256(data).hexdigest() != digest:
            raise HealRefused(
                f"{where}: {len(data)} of {length} bytes received, their SHA-256 is not the digest the sender "
                "signed (changed on the way); not loaded, the group asks again"
            )
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the server (``wait`` False: in a thread of its own, returning at once)."""

        def stop() -> None:
            self._server.shutdown()
            self._server.server_close()

        if wait:
            stop()
        else:
            threading.Thread(target=stop, daemon=True).start()

    # the server side

    def answer(self, path: str, headers: Any) -> tuple[int, dict[str, str], bytes]:
        """The server's (status, headers, body) for a GET of ``path``: 403 without a valid tag, 404 for another path, 409 where
        no state of the step asked for is served (it waits for it up to ``timeout``, the sender serializing it)."""
        found = re.fullmatch(r"/state/(\d+)", path)
        nonce, when, auth = headers.get(NONCE), headers.get(TIME, ""), headers.get(AUTH)
        step = found.group(1) if found else ""
        try:
            fresh = abs(time.time() - float(when)) <= REQUEST_WINDOW_S
        except ValueError:
            fresh = False
        with self._lock:
            now = time.time()
            self._nonces = {n: t for n, t in self._nonces.items() if t > now}
            if (
                not found
                or not fresh
                or not nonce
                or nonce in self._nonces
                or not is_tag(self.secret, auth, "heal request", self.base, step, nonce, when)
            ):
                return 403, {}, b""
            self._nonces[nonce] = now + 2 * REQUEST_WINDOW_S
            # The quorum hands the healing group this address while the sender may still be serializing: wait for
            # the step's snapshot (not for one already dropped).
            self._lock.wait_for(
                lambda: int(step) <= self._over or (self._snapshot is not None and self._snapshot[0] >= int(step)),
                timeout=self.timeout.total_seconds(),
            )
            snapshot = self._snapshot
        if snapshot is None or snapshot[0] != int(step):
            return 409, {}, b""
        _, data, digest = snapshot
        signed = tag(self.secret, "heal state", self.base, step, nonce, digest, str(len(data)))
        return 200, {DIGEST: digest, STATE_TAG: signed, "Content-Length": str(len(data))}, data

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport.timeout.total_seconds()

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                status, headers, body = transport.answer(self.path, self.headers)
                if status == 403:
                    _log.warning(
                        "torchft heal (%s): refused a request for the state from %s without this job's tag",
                        transport.label,
                        self.client_address[0],
                    )
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", "0")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                pass  # one line per request otherwise

        return Handler
