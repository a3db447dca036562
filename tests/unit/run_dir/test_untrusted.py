"""lit_ddp.run_dir.untrusted: files someone else wrote run none of their code when lit-ddp reads them.

Each payload creates a marker file if any code of it runs (its ``__reduce__`` is ``open(marker, "w")``): the tests
assert the marker is absent and, where lit-ddp refuses, that it says so in one line.
"""

from __future__ import annotations

import builtins
import http.server
import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lit_ddp.chaos.compare import compare
from lit_ddp.run_dir import sharded, untrusted
from lit_ddp.run_dir.checkpoints import is_valid_checkpoint, ranked_checkpoints
from lit_ddp.run_dir.layout import HOLDER_FILE, LOCK_FILE
from lit_ddp.run_dir.lock import hold_run_directory
from lit_ddp.run_dir.untrusted import UntrustedFileError
from tests.helpers import usage_error


class Payload:
    """Unpickled, it creates ``marker``: proof that a load ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return builtins.open, (self.marker, "w")


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "code from the file ran"


def dcp_checkpoint(path: Path, state: dict) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: on purpose
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 3, "hyper_parameters": {}}, path / sharded.META)
    return path


def planted_metadata(path: Path, marker: Path) -> Path:
    """A directory named like a sharded checkpoint whose ``.metadata`` is a pickle payload."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    torch.save({"global_step": 9}, path / sharded.META)
    return path


def test_real_metadata_reads(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = dcp_checkpoint(tmp_path / "ok.ckpt", {"state_dict": model.state_dict(), "optimizer_0": opt.state_dict()})
    assert is_valid_checkpoint(str(path))
    whole = sharded.full_checkpoint(path)
    assert torch.equal(whole["state_dict"]["weight"], model.weight)
    assert whole["optimizer_states"][0]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    assert whole["global_step"] == 3


def test_planted_metadata_is_refused_when_checked(tmp_path: Path, marker: Path) -> None:
    path = planted_metadata(tmp_path / "run" / "checkpoints" / "epoch=0-step=9.ckpt", marker)
    with pytest.raises(UntrustedFileError, match=r"\.metadata is not a checkpoint's metadata .*open"):
        is_valid_checkpoint(str(path))
    with pytest.raises(UntrustedFileError):
        sharded.full_checkpoint(path)


def test_planted_metadata_given_as_ckpt_path(tmp_path: Path, marker: Path, capsys: pytest.CaptureFixture) -> None:
    path = planted_metadata(tmp_path / "planted.ckpt", marker)
    line = usage_error(capsys, "fit", "--config", "configs/regression/single_device.yaml", "--ckpt_path", str(path))
    assert "is not a checkpoint's metadata and was not loaded" in line


def test_a_planted_entry_of_a_sharded_checkpoint_is_not_unpickled(tmp_path: Path, marker: Path) -> None:
    path = dcp_checkpoint(tmp_path / "entry.ckpt", {"state_dict": {"w": torch.ones(2)}, "extra": Payload(marker)})
    with pytest.raises(UntrustedFileError, match="entry extra holds objects other than tensors"):
        sharded.full_checkpoint(path)


def test_a_pickle_planted_as_last_ckpt_is_not_loaded(tmp_path: Path, marker: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 5, "state_dict": {}, "payload": Payload(marker)}, path)
    with pytest.raises(UntrustedFileError, match="holds objects other than tensors and plain data"):
        untrusted.load(path)


def test_chaos_reference_is_read_weights_only(tmp_path: Path, marker: Path) -> None:
    reference, faulted = tmp_path / "reference", tmp_path / "faulted"
    for run in (reference, faulted):
        (run / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 1, "state_dict": {}}, faulted / "checkpoints" / "last.ckpt")
    torch.save({"global_step": 1, "payload": Payload(marker)}, reference / "checkpoints" / "last.ckpt")
    with pytest.raises(UntrustedFileError):
        compare(reference, faulted)
    (reference / "checkpoints" / "last.ckpt").unlink()
    planted_metadata(reference / "checkpoints" / "last.ckpt", marker)
    with pytest.raises(UntrustedFileError):
        compare(reference, faulted)


class _Server(http.server.BaseHTTPRequestHandler):
    body = b""
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).requests.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_http_checkpoint_is_refused(tmp_path: Path, marker: Path, capsys: pytest.CaptureFixture) -> None:
    planted = tmp_path / "served.ckpt"
    torch.save({"global_step": 5, "payload": Payload(marker)}, planted)
    _Server.body, _Server.requests = planted.read_bytes(), []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/last.ckpt"
        line = usage_error(capsys, "fit", "--config", "configs/regression/single_device.yaml", "--ckpt_path", url)
        assert f"--ckpt_path {url}: lit-ddp does not load checkpoints from URLs" in line
        with pytest.raises(UntrustedFileError, match="does not load checkpoints from URLs"):
            untrusted.load(url)
    finally:
        server.shutdown()
    assert _Server.requests == []  # nothing was fetched


def test_weights_only_false_is_refused(capsys: pytest.CaptureFixture) -> None:
    line = usage_error(capsys, "fit", "--config", "configs/regression/single_device.yaml", "--weights_only", "false")
    assert "--weights_only false: lit-ddp loads checkpoints weights-only" in line


def test_every_lit_ddp_process_loads_weights_only() -> None:
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    untrusted.force_weights_only(env)
    assert env == {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}


def test_paths_handed_to_lightning_are_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert untrusted.local_path("http_demo/checkpoints/last.ckpt") == str(tmp_path / "http_demo/checkpoints/last.ckpt")
    assert untrusted.local_path("s3://bucket/run/last.ckpt") == "s3://bucket/run/last.ckpt"


def test_a_symlinked_lock_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.symlink(target, root / LOCK_FILE)
    with pytest.raises(UntrustedFileError, match=rf"{LOCK_FILE} is a symbolic link \(to {target}\)"):
        hold_run_directory(str(root), {})
    assert target.read_text() == "keep me"
    (root / LOCK_FILE).unlink()
    os.symlink(target, root / HOLDER_FILE)
    with pytest.raises(UntrustedFileError, match=f"{HOLDER_FILE} is a symbolic link"):
        hold_run_directory(str(root), {})
    assert target.read_text() == "keep me"


def test_a_symlinked_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    elsewhere = tmp_path / "elsewhere.ckpt"
    torch.save({"global_step": 1}, elsewhere)
    os.symlink(elsewhere, tmp_path / "checkpoints" / "last.ckpt")
    with pytest.raises(UntrustedFileError, match="last.ckpt is a symbolic link"):
        ranked_checkpoints(str(tmp_path))


def test_a_run_directory_others_can_write_is_named(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o775)
    assert untrusted.writable_by_others(root)
    root.chmod(0o755)
    assert not untrusted.writable_by_others(root)
