"""lit_ddp.ft.transport and lit_ddp.ft.membership: a heal moves a copy taken at the step boundary, only between
holders of the job's secret, verified before it is loaded; a quorum with a member without the secret is told apart.
In one process, over loopback (torchft not needed: the transport has torchft's interface without importing it)."""

from __future__ import annotations

import hashlib
import secrets
import threading
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lit_ddp.ft import membership
from lit_ddp.ft.transport import AUTH, NONCE, TIME, HealRefused, SignedTransport, own_address
from lit_ddp.launch.secret import tag

SECRET = bytes(range(32))
TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def sender() -> Iterator[SignedTransport]:
    transport = SignedTransport(SECRET, "127.0.0.1", TIMEOUT, "group_0 rank 0")
    yield transport
    transport.shutdown()


def receiver(key: bytes = SECRET) -> SignedTransport:
    return SignedTransport(key, "127.0.0.1", TIMEOUT, "group_1 rank 0")


def test_the_state_sent_is_a_copy_taken_at_the_step_boundary(sender: SignedTransport) -> None:
    """A buffer the sender changes in place right after the boundary (its next forward) reaches the healing group
    with the boundary's value; tensors and plain data arrive as sent."""
    buffer = torch.zeros(3)
    sender.send_checkpoint(
        [1], 7, {"user": {"default": {"buffer": buffer, "lr": 0.1}}, "torchft": {"step": 7}}, TIMEOUT
    )
    buffer.add_(1.0)  # the sender's next step, before the receiver asks
    got = receiver().recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
    assert torch.equal(got["user"]["default"]["buffer"], torch.zeros(3))
    assert got["user"]["default"]["lr"] == 0.1 and got["torchft"] == {"step": 7}


def test_a_process_without_the_secret_gets_nothing_and_cannot_be_a_source(sender: SignedTransport) -> None:
    """An intruder (another secret) asking for the state is refused (403), before anything is sent; an intruder
    serving a state is refused by the healing group before its bytes are read; each one line."""
    sender.send_checkpoint([1], 3, {"w": torch.ones(2)}, TIMEOUT)
    with pytest.raises(HealRefused, match="refused") as refused:
        receiver(secrets.token_bytes(32)).recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    assert "\n" not in str(refused.value)
    intruder = SignedTransport(secrets.token_bytes(32), "127.0.0.1", TIMEOUT, "intruder")
    try:
        intruder.send_checkpoint([1], 3, {"w": torch.full((2,), 9.0)}, TIMEOUT)
        # The healing group signs its request with the job's secret; the intruder's server cannot check it, so it
        # answers as a forger would: it is made to accept any request, and signs with its own secret.
        intruder.answer = lambda path, headers: (  # type: ignore[method-assign]
            200,
            {"X-Lit-DDP-Digest": "0" * 64, "X-Lit-DDP-Tag": "0" * 64, "Content-Length": "3"},
            b"abc",
        )
        with pytest.raises(HealRefused, match="no tag made with this job's secret") as forged:
            receiver().recv_checkpoint(0, intruder.metadata(), 3, TIMEOUT)
        assert "\n" not in str(forged.value)
    finally:
        intruder.shutdown()


def test_bytes_changed_on_the_way_fail_the_heal(sender: SignedTransport) -> None:
    """The sender's digest travels with the bytes: one flipped byte fails the heal in one line."""
    state = {"w": torch.arange(8.0)}
    sender.send_checkpoint([1], 5, state, TIMEOUT)
    answer = sender.answer

    def flipped(path: str, headers: object) -> tuple[int, dict[str, str], bytes]:
        status, head, body = answer(path, headers)
        return status, head, body[:-1] + bytes([body[-1] ^ 1])

    sender.answer = flipped  # type: ignore[method-assign]
    with pytest.raises(HealRefused, match="SHA-256 is not the digest") as changed:
        receiver().recv_checkpoint(0, sender.metadata(), 5, TIMEOUT)
    assert "\n" not in str(changed.value)


def test_requests_are_bound_to_the_server_the_step_and_one_use(sender: SignedTransport) -> None:
    """A request's tag names the server it was made for (a relay to another group is refused), its nonce serves
    once (a replay is refused), and a step not served now is answered 409; after ``disallow_checkpoint`` nothing."""
    sender.send_checkpoint([1], 4, {"w": torch.ones(1)}, TIMEOUT)

    def ask(base: str, step: int, nonce: str, when: str) -> int:
        headers = {NONCE: nonce, TIME: when, AUTH: tag(SECRET, "heal request", base, step, nonce, when)}
        request = urllib.request.Request(f"{sender.metadata()}{step}", headers=headers)
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as e:
            return e.code

    import time

    now = f"{time.time():.3f}"
    assert ask(sender.metadata(), 4, "n1", now) == 200
    assert ask(sender.metadata(), 4, "n1", now) == 403  # replayed
    assert ask("http://127.0.0.1:1/state/", 4, "n2", now) == 403  # made for another server
    assert ask(sender.metadata(), 4, "n3", f"{time.time() - 3600:.3f}") == 403  # an hour old
    assert ask(sender.metadata(), 5, "n4", now) == 409  # another step
    sender.disallow_checkpoint()
    assert ask(sender.metadata(), 4, "n5", now) == 409
    with pytest.raises(HealRefused, match="not an address of a lit-ddp group"):
        receiver().recv_checkpoint(0, "http://127.0.0.1:1/checkpoint/", 4, TIMEOUT)


def test_the_server_listens_on_the_groups_address_only(sender: SignedTransport) -> None:
    port = int(sender.metadata().rsplit(":", 1)[1].split("/")[0])
    listening = [
        line.split()[1]
        for name in ("/proc/net/tcp", "/proc/net/tcp6")
        if Path(name).exists()
        for line in Path(name).read_text().splitlines()[1:]
        if line.split()[3] == "0A" and int(line.split()[1].rsplit(":", 1)[1], 16) == port
    ]
    assert listening == ["0100007F:" + f"{port:04X}"], listening  # 127.0.0.1 only
    assert own_address("http://127.0.0.1:29510") == "127.0.0.1"
    assert own_address("http://localhost:29510") == "127.0.0.1"


class _Quorum:
    """``n`` members' all-reduces (SUM) of one quorum, each member a thread: what torchft's process group does."""

    def __init__(self, n: int, quorum: int = 12) -> None:
        self.n, self.barrier, self.lock = n, threading.Barrier(n), threading.Lock()
        self.quorum, self.sums, self.parts = quorum, [], []

    def member(self, rank: int) -> object:
        quorum = self

        class PG:
            def __init__(self) -> None:
                self.quorum, self.rank_in_quorum, self.quorum_size = quorum.quorum, rank, quorum.n

            def allreduce(self, tensors: list[torch.Tensor], opts: object) -> object:
                with quorum.lock:
                    quorum.parts.append(tensors[0].clone())
                quorum.barrier.wait()
                with quorum.lock:
                    if len(quorum.parts) == quorum.n:
                        quorum.sums.append(torch.stack(quorum.parts).sum(0))
                        quorum.parts = []
                quorum.barrier.wait()
                tensors[0].copy_(quorum.sums[-1])
                return type("Work", (), {"wait": lambda self: True})()

        return PG()


def run_proofs(keys: list[bytes], healthy: list[bool]) -> list[membership.Verdict | None]:
    quorum = _Quorum(len(keys))
    verdicts: list[membership.Verdict | None] = [None] * len(keys)

    def prove(i: int) -> None:
        verdicts[i] = membership.QuorumProof(quorum.member(i), keys[i], group_rank=0).prove(healthy[i])

    threads = [threading.Thread(target=prove, args=(i,)) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return verdicts


def test_the_quorum_proof_tells_an_intruder_apart() -> None:
    """Three members with the job's secret: ready; one of them without it (it contributes what it can, an HMAC of
    its own secret): every member sees it; a member whose heal failed: the quorum is the job's but not ready."""
    honest = run_proofs([SECRET] * 3, [True] * 3)
    assert all(v is not None and v.ready for v in honest), honest
    intruded = run_proofs([SECRET, SECRET, secrets.token_bytes(32)], [True] * 3)
    assert all(v is not None and not v.members for v in intruded), intruded
    unhealed = run_proofs([SECRET] * 3, [True, False, True])
    assert all(v is not None and v.members and v.healthy == 2 and not v.ready for v in unhealed), unhealed


def test_proof_words_depend_on_quorum_rank_and_nonce() -> None:
    nonce = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    words = membership.proof_words(SECRET, 3, 0, nonce)
    assert len(words) == membership.WORDS and all(0 <= w < 2**32 and w == int(w) for w in words)
    assert words != membership.proof_words(SECRET, 4, 0, nonce)
    assert words != membership.proof_words(SECRET, 3, 1, nonce)
    assert words != membership.proof_words(SECRET, 3, 0, nonce + 1)
    assert words != membership.proof_words(hashlib.sha256(SECRET).digest(), 3, 0, nonce)
