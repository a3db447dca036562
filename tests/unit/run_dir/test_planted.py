"""Planted files (docs/security.md, "Threats": whoever can write a run directory, or hands over a checkpoint): none
deletes, reads or writes outside the run, runs code, takes more memory than the run's model, or hangs the command.
Each refusal is one ``lit-ddp: error:`` line and status 2 where the command line meets it, and the victim files are
untouched. (The payloads that run code through a pickle are in ``test_untrusted.py``.)"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools
import struct
import threading
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lit_ddp.cli import cli_main
from lit_ddp.resilience.checkpoint_io import AtomicCheckpointIO
from lit_ddp.resilience.periodic_checkpoint import PeriodicCheckpoint
from lit_ddp.run_dir import sharded, untrusted
from lit_ddp.run_dir.checkpoints import checkpoint_header, is_valid_checkpoint
from lit_ddp.run_dir.untrusted import UntrustedFileError
from lit_ddp.tensorboard import read_scalars
from tests.helpers import QUIET, compose, usage_error

REG = compose("regression/single_device")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-epoch regression run (in process): its checkpoints are what a planter edits."""
    root = tmp_path_factory.mktemp("trained") / "run"
    cli_main(["fit", *REG, *QUIET, "--trainer.default_root_dir", str(root), "--trainer.max_epochs", "1"])
    return root


def run_copy(trained: Path, into: Path) -> Path:
    import shutil

    shutil.copytree(trained, into)
    return into


def edit_checkpoint_callbacks(path: Path, **values: object) -> None:
    """Sets ``values`` in the ModelCheckpoint state of the checkpoint at ``path`` (strings only: a weights-only file)."""
    checkpoint = torch.load(path, weights_only=True)
    [key] = [k for k in checkpoint["callbacks"] if "Checkpoint" in k]
    checkpoint["callbacks"][key].update(values)
    torch.save(checkpoint, path)


# Case 2: a checkpoint's ModelCheckpoint state names the path the next save removes.


@pytest.mark.parametrize("field", ["last_model_path", "best_model_path", "best_k_models"])
def test_a_planted_callback_path_outside_the_run_deletes_nothing(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture, field: str
) -> None:
    """Lightning removes the "previous" last or top-k file it restored at the next save, after a lexical check that
    ``..`` passes: the planted ``last.ckpt`` made the next ``fit`` remove ``precious_dir`` and exit 0."""
    run = run_copy(trained, tmp_path / "run")
    victim = tmp_path / "victim" / "precious_dir"
    victim.mkdir(parents=True)
    (victim / "data.txt").write_text("keep me")
    outside = str(run / "checkpoints" / ".." / ".." / "victim" / "precious_dir")
    state: dict[str, object] = {"dirpath": os.path.realpath(run / "checkpoints"), "best_k_models": {}}
    state |= dict.fromkeys(["best_model_path", "kth_best_model_path", "last_model_path"], "")  # the copy's own: none
    state[field] = {outside: torch.tensor(0.0)} if field == "best_k_models" else outside
    edit_checkpoint_callbacks(run / "checkpoints" / "last.ckpt", **state)
    args = ["fit", *REG, *QUIET, "--trainer.default_root_dir", str(run), "--trainer.max_epochs", "2"]
    args += ["--checkpoint.save_top_k", "1"] if field != "last_model_path" else []
    err = _cli_error(capsys, *args)
    assert (victim / "data.txt").read_text() == "keep me", "the planted checkpoint's path was removed"
    assert err is not None and f"names {field}=" in err and "outside its directory" in err, err


def test_a_url_in_the_callback_state_is_refused() -> None:
    """Lightning removes a restored path that is not local without any check (an object store's, with the victim's
    credentials)."""
    callback = PeriodicCheckpoint(dirpath="/runs/x/checkpoints")
    state = {"dirpath": callback.dirpath, "best_model_path": "", "best_model_score": None}
    with pytest.raises(UntrustedFileError, match="last_model_path='s3://victim/bucket'"):
        callback.load_state_dict({**state, "last_model_path": "s3://victim/bucket"})
    callback.load_state_dict({**state, "last_model_path": "/runs/x/checkpoints/last.ckpt"})  # its own: kept


def test_checkpoint_io_removes_only_its_own_files_inside_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    outside = tmp_path / "outside.ckpt"
    outside.write_text("keep")
    stranger = run / "checkpoints" / "stranger.ckpt"  # a directory lit-ddp did not write
    (stranger / "nested").mkdir(parents=True)
    (stranger / "nested" / "keep.txt").write_text("keep")
    io_ = AtomicCheckpointIO(root=str(run))
    for path, why in [
        (run / "checkpoints" / ".." / ".." / "outside.ckpt", "outside the run directory"),
        (stranger, "a directory that lit-ddp did not write"),
    ]:
        with pytest.raises(UntrustedFileError, match=why):
            io_.remove_checkpoint(path)
    from lit_ddp.run_dir.checkpoints import remove_checkpoint

    inner = run / "checkpoints" / "epoch=0-step=1.ckpt"
    inner.write_text("keep")
    os.symlink(inner, run / "checkpoints" / "link.ckpt")
    with pytest.raises(UntrustedFileError, match="a symbolic link that lit-ddp did not write"):
        remove_checkpoint(str(run / "checkpoints" / "link.ckpt"), str(run))
    assert outside.read_text() == "keep" and inner.read_text() == "keep" and (stranger / "nested" / "keep.txt").exists()
    own = run / "checkpoints" / "epoch=0-step=5.ckpt"
    torch.save({"global_step": 5}, own)
    io_.remove_checkpoint(own)
    assert not own.exists()


# Case 3: a sharded checkpoint's metadata names files outside its directory, FIFOs, sparse giants.


def sharded_checkpoint(path: Path, state: dict) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: on purpose
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 3, "hyper_parameters": {}}, path / sharded.META)
    return path


def rewrite_metadata(path: Path, edit: object) -> None:
    """Reads ``path/.metadata`` (a checkpoint we wrote), applies ``edit(metadata)`` and writes it back as DCP does."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 - our own file, written just above
    edit(metadata)  # type: ignore[operator]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    return sharded_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", {"state_dict": {"w": torch.ones(4)}})


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_a_shard_path_outside_the_checkpoint_is_refused(shards: Path, tmp_path: Path, where: str) -> None:
    secret = tmp_path / "secret.distcp"
    secret.write_bytes(os.urandom(64))
    secret.chmod(0o600)

    def redirect(metadata: object) -> None:
        for info in metadata.storage_data.values():  # type: ignore[attr-defined]
            info.relative_path = str(secret) if where == "absolute" else "../../../secret.distcp"

    rewrite_metadata(shards, redirect)
    for read in (lambda: is_valid_checkpoint(str(shards)), lambda: sharded.full_checkpoint(shards)):
        with pytest.raises(UntrustedFileError, match="not a shard .* in the checkpoint's directory"):
            read()


def test_a_fifo_shard_is_refused_without_blocking(shards: Path) -> None:
    [shard] = shards.glob("*.distcp")
    shard.unlink()
    os.mkfifo(shard)
    result: list[BaseException | bool] = []
    reader = threading.Thread(target=lambda: result.append(_outcome(lambda: is_valid_checkpoint(str(shards)))))
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "reading a checkpoint with a FIFO shard blocked"
    assert isinstance(result[0], UntrustedFileError) and "is a FIFO" in str(result[0])


def test_a_sparse_giant_shard_is_refused_before_it_is_read(shards: Path) -> None:
    [shard] = shards.glob("*.distcp")

    def giant(metadata: object) -> None:
        for info in metadata.storage_data.values():  # type: ignore[attr-defined]
            info.length = 1 << 40
        for entry in metadata.state_dict_metadata.values():  # type: ignore[attr-defined]
            if hasattr(entry, "size"):
                entry.size = torch.Size([1 << 38])

    rewrite_metadata(shards, giant)
    with open(shard, "r+b") as f:
        f.truncate(1 << 40)  # sparse: no disk, a TiB of apparent size
    with pytest.raises(UntrustedFileError, match="more than this run can hold"):
        sharded.full_checkpoint(shards)


# Case 4: a .metadata pickle that sets attributes on an allowed class.


def test_metadata_cannot_set_attributes_on_a_class(shards: Path) -> None:
    """``GLOBAL pathlib.PurePosixPath`` then ``BUILD`` with slot state: ``setattr(PurePosixPath, "_str", ...)`` on
    the class redirected every path of the process."""
    real = (shards / ".metadata").read_bytes()
    # GLOBAL pathlib PurePosixPath, (None, {"_str": "/etc/passwd"}), BUILD, POP, then the real pickle's opcodes.
    attack = (
        b"\x80\x02cpathlib\nPurePosixPath\n"
        + pickle.dumps((None, {"_str": "/etc/passwd", "__init__": None}), protocol=2)[2:-1]
        + b"b0"
    )
    (shards / ".metadata").write_bytes(attack + real[2:])
    before = pathlib.PurePosixPath.__dict__.get("_str")
    with pytest.raises(UntrustedFileError, match="not a checkpoint's metadata"):
        is_valid_checkpoint(str(shards))
    assert pathlib.PurePosixPath.__dict__.get("_str") is before
    assert str(pathlib.PurePosixPath("/tmp/x")) == "/tmp/x"


def test_a_header_cannot_set_attributes_on_anything_it_names(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 1}, path)
    buffer = io.BytesIO()
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("data.pkl"):
                data = b"\x80\x02cpathlib\nPurePosixPath\n}(X\x04\x00\x00\x00_strX\x01\x00\x00\x00/ubb0" + data[2:]
            target.writestr(info, data)
    path.write_bytes(buffer.getvalue())
    with pytest.raises(UntrustedFileError, match="BUILD on a Global"):
        checkpoint_header(str(path))
    assert "_str" not in pathlib.PurePosixPath.__dict__ or pathlib.PurePosixPath("/a").as_posix() == "/a"


# Case 6: hyperparameters that name a class for jsonargparse to import.


def test_hyperparameters_that_name_a_class_are_refused(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``_class_path`` LightningCLI parses the hyperparameters as ``model`` itself: ``class_path`` made
    jsonargparse import ``evilmod`` from the working directory (``python -m`` puts it first on ``sys.path``)."""
    marker = tmp_path / "MARKER"
    (tmp_path / "evilmod.py").write_text(f"open({str(marker)!r}, 'w')\nclass Evil:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = trained / "checkpoints" / "last.ckpt"
    for hparams, expected in [
        ({"class_path": "evilmod.Evil"}, "hold class_path='evilmod.Evil'"),
        ({"_class_path": "lit_ddp.tasks.regression.RegressionModule", "evil": 1}, "hold evil, which"),
        ({"init_args": {"x": 1}}, "hold init_args="),
    ]:
        planted = tmp_path / "planted.ckpt"
        checkpoint = torch.load(source, weights_only=True)
        checkpoint["hyper_parameters"] = hparams
        torch.save(checkpoint, planted)
        for command in ("fit", "validate"):
            line = usage_error(capsys, command, *REG, *QUIET, "--ckpt_path", str(planted))
            assert expected in line, line
    assert not marker.exists(), "a module a checkpoint named was imported"


# Case 7: small files that claim large memory.


def archive_with(path: Path, compress: int) -> Path:
    """A checkpoint whose records are compressed with ``compress`` (torch.save stores them uncompressed)."""
    buffer = io.BytesIO()
    torch.save({"global_step": 1, "w": torch.zeros(1 << 18)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source, zipfile.ZipFile(path, "w", compress) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info), compress_type=compress)
    return path


@pytest.mark.parametrize("compress", [zipfile.ZIP_BZIP2, zipfile.ZIP_DEFLATED])
def test_a_compressed_checkpoint_is_refused_before_it_expands(tmp_path: Path, compress: int) -> None:
    (tmp_path / "checkpoints").mkdir()
    path = archive_with(tmp_path / "checkpoints" / "last.ckpt", compress)
    assert path.stat().st_size < 10_000  # a MiB of zeros, a few KB on disk
    for read in (
        lambda: checkpoint_header(str(path)),
        lambda: untrusted.load(path),
        lambda: is_valid_checkpoint(str(path)),
    ):
        with pytest.raises(UntrustedFileError, match="is compressed"):
            read()


def test_a_tensor_larger_than_its_storage_is_refused(tmp_path: Path) -> None:
    """A 1.5 KB file can hold a (10^6, 10^6) tensor of stride 0 over one element: 8 TB once anything copies it."""
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 1, "state_dict": {"w": torch.zeros(1).expand(10**6, 10**6)}}, path)
    assert path.stat().st_size < 4096
    with pytest.raises(UntrustedFileError, match="more than this run can hold"):
        untrusted.load(path)
    # Within the machine's memory but not what a model of 20 parameters holds (8 x its bytes + 256 MiB): 1 GiB.
    torch.save({"global_step": 1, "state_dict": {"w": torch.zeros(1).expand(1 << 28)}}, path)
    untrusted.load(path)
    with untrusted.bounded_by(torch.nn.Linear(4, 4)), pytest.raises(UntrustedFileError, match="more than this run"):
        untrusted.load(path)


# Case 8: symbolic links to directories.


@pytest.mark.parametrize("link", ["run directory", "checkpoint directory"], ids=["run", "checkpoints"])
def test_a_symlinked_run_or_checkpoint_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, link: str
) -> None:
    elsewhere = tmp_path / "someone_elses"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text("theirs\n")
    run = tmp_path / "run"
    if link == "run directory":
        os.symlink(elsewhere, run)
    else:
        run.mkdir()
        os.symlink(elsewhere, run / "checkpoints")
    line = usage_error(capsys, "fit", *REG, *QUIET, "--trainer.default_root_dir", str(run), "--trainer.max_epochs", "1")
    assert f"is a symbolic link (to {elsewhere}), not the {link}" in line
    assert (elsewhere / "config.yaml").read_text() == "theirs\n" and sorted(os.listdir(elsewhere)) == ["config.yaml"]


# Case 9: FIFOs where lit-ddp reads a file.


def _outcome(read: object) -> BaseException | bool:
    try:
        read()  # type: ignore[operator]
    except BaseException as e:  # noqa: BLE001 - the outcome is what the test compares
        return e
    return True


def in_time(read: object, seconds: float = 30) -> BaseException | bool:
    """What ``read()`` raises (or True), within ``seconds``: a FIFO's reader would block forever."""
    result: list[BaseException | bool] = []
    thread = threading.Thread(target=lambda: result.append(_outcome(read)), daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert result, f"blocked for {seconds} s"
    return result[0]


def test_a_fifo_checkpoint_or_event_file_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    fifo = tmp_path / "checkpoints" / "last.ckpt"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    outcome = in_time(lambda: untrusted.load(fifo))
    assert isinstance(outcome, UntrustedFileError) and "is a FIFO" in str(outcome)
    line = usage_error(capsys, "fit", *REG, *QUIET, "--ckpt_path", str(fifo))
    assert "is a FIFO, not the checkpoint file" in line
    line = usage_error(capsys, "fit", *REG, *QUIET, "--trainer.default_root_dir", str(tmp_path))
    assert "is a FIFO, not the checkpoint file" in line
    os.mkfifo(tmp_path / "events.out.tfevents.0.host.1.0")
    outcome = in_time(lambda: read_scalars(tmp_path, "val/loss"))
    assert isinstance(outcome, UntrustedFileError) and "TensorBoard event file" in str(outcome)


# Case 10: one line, not a crash.


def test_a_deeply_nested_metadata_is_one_line(shards: Path) -> None:
    depth = 200_000
    (shards / ".metadata").write_bytes(b"\x80\x02" + b"(" * depth + b")" + b"t" * depth + b".")
    with pytest.raises(UntrustedFileError, match="nested deeper"):
        is_valid_checkpoint(str(shards))


@pytest.mark.parametrize(
    "header",
    [
        b"\x80\x02" + b"]" * 2 + b"(" * 100_000 + b"l" * 100_000 + b".",  # RecursionError in a recursive reader
        b"\x80\x02\x8e" + struct.pack("<Q", 1 << 62) + b".",  # BINBYTES8 of 4 EiB: MemoryError
        b"\x80\x02K\x01K\x02s.",  # SETITEM on an int: TypeError
        b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00id\x85R.",  # a call of os.system
    ],
    ids=["deep", "huge", "type", "call"],
)
def test_a_planted_header_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, header: bytes) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    path = run / "checkpoints" / "last.ckpt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", header)
        archive.writestr("archive/version", b"3\n")
    with pytest.raises(ValueError):  # UntrustedFileError or "not a readable checkpoint": one line either way
        checkpoint_header(str(path))
    for args in (["--ckpt_path", str(path)], ["--trainer.default_root_dir", str(run)]):
        err = _cli_error(capsys, "fit", *REG, *QUIET, *args)
        assert err is None or "Traceback" not in err


def _cli_error(capsys: pytest.CaptureFixture, *args: str) -> str | None:
    """The error output of an in-process CLI call that stops, or None where it runs (a header the resume skips)."""
    try:
        cli_main(list(args))
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code in (1, 2), err[-2000:]
        assert len([line for line in err.splitlines() if line.startswith("lit-ddp: error:")]) == 1, err[-2000:]
        return err
    return None


def test_a_payload_checkpoint_is_one_line_for_every_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "payload.ckpt"
    torch.save({"global_step": 1, "state_dict": {}, "payload": pathlib.PurePosixPath("x")}, path)
    for command in ("fit", "validate", "test"):
        line = usage_error(capsys, command, *REG, *QUIET, "--ckpt_path", str(path))
        assert "holds objects other than tensors and plain data" in line


def test_a_chained_url_is_refused(capsys: pytest.CaptureFixture) -> None:
    url = "simplecache::http://127.0.0.1:9/last.ckpt"
    line = usage_error(capsys, "fit", *REG, *QUIET, "--ckpt_path", url)
    assert "lit-ddp does not load checkpoints from URLs" in line


def test_negative_devices_are_one_line(capsys: pytest.CaptureFixture) -> None:
    line = usage_error(capsys, "fit", *REG, *QUIET, "--trainer.devices", "-1")
    assert "trainer.devices" in line


def test_inert_reading_builds_nothing(tmp_path: Path) -> None:
    """The header reader never imports or calls what a pickle names, and keeps tensors as records."""
    from lit_ddp.run_dir import inert

    buffer = io.BytesIO()
    torch.save({"step": 3, "w": torch.zeros(2, 3)[:, 1], "p": pathlib.PurePosixPath("x")}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        data = archive.read([n for n in archive.namelist() if n.endswith("data.pkl")][0])
    header, tensors = inert.read(data)
    assert header["step"] == 3 and isinstance(header["p"], inert.Call)
    assert [t.size for t in tensors] == [(2,)] and tensors[0].stride == (3,) and tensors[0].storage.numel == 6
    assert any(op.name == "REDUCE" for op, _, _ in pickletools.genops(data))
