"""Nothing in a checkpoint runs code: malicious pickles in every file we unpickle.

Each payload would run ``touch SENTINEL`` if unpickled with plain pickle.
They reach the unpickler through every opcode that imports (GLOBAL,
STACK_GLOBAL with dotted attribute paths, INST, OBJ, EXT1/2/4 through the
extension registry), ``__reduce__`` gadgets, and persistent ids; the manifest
is re-signed each time, as an adversary would, so the checksums do not stop
them first. Every load must raise CheckpointError and the sentinel must not
exist. Runs in one process on a checkpoint saved without a process group.
"""

from __future__ import annotations

import builtins
import copyreg
import importlib
import io
import os
import pickle
import shutil
import struct
import subprocess
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from tests import checkpoint_files as files
from tests.models import TinyTransformer, make_optimizer
from tests.workers import config_for
from zero_core import CheckpointError, ZeroEngine
from zero_core.checkpoint import consolidate_checkpoint, load_full_checkpoint
from zero_core.checkpoint.consolidate import main as consolidate_main
from zero_core.checkpoint.unpickling import MetadataUnpickler


def _unicode(text: str) -> bytes:
    data = text.encode()
    if len(data) < 256:
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _stack_global(module: str, name: str, command: str) -> bytes:
    """Protocol 4: module and (possibly dotted) name from the stack, then a call."""
    return b"\x80\x04" + _unicode(module) + _unicode(name) + b"\x93" + _unicode(command) + b"\x85R."


class _Gadget:
    def __init__(self, call: Callable, *args: object):
        self.call, self.args = call, args

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.call, self.args)


def _payloads(sentinel: Path) -> dict[str, bytes]:
    touch = f"touch {sentinel}"
    python = f"open({str(sentinel)!r}, 'w').close()"
    payloads = {
        "GLOBAL opcode (protocol 0)": f"cos\nsystem\n(S'{touch}'\ntR.".encode(),
        "INST opcode": f"(S'{touch}'\nios\nsystem\n.".encode(),
        "OBJ opcode": f"(cos\nsystem\nS'{touch}'\no.".encode(),
        "STACK_GLOBAL": _stack_global("os", "system", touch),
        "dotted path through an allowed module": _stack_global(
            "torch.distributed.checkpoint.filesystem", "os.system", touch
        ),
        "dotted path through DCP's metadata module": _stack_global(
            "torch.distributed.checkpoint.metadata", "os.system", touch
        ),
        "dotted path through torch": _stack_global("torch", "os.system", touch),
        "dotted path through pathlib": _stack_global("pathlib", "os.system", touch),
        "builtins.eval": _stack_global("builtins", "eval", python),
    }
    for protocol in (0, 2, 4, 5):
        payloads[f"__reduce__ os.system, protocol {protocol}"] = pickle.dumps(
            _Gadget(os.system, touch), protocol=protocol
        )
    payloads["__reduce__ builtins.exec"] = pickle.dumps(_Gadget(builtins.exec, python), protocol=2)
    payloads["__reduce__ subprocess.Popen"] = pickle.dumps(
        _Gadget(subprocess.Popen, ["touch", str(sentinel)]), protocol=4
    )
    return payloads


def _inert_payloads(sentinel: Path) -> dict[str, bytes]:
    """Refused as well, though they would not leave the sentinel behind."""
    return {
        "persistent id": b"\x80\x02" + _unicode(f"touch {sentinel}") + b"Q.",  # BINPERSID
        "__reduce__ importlib.import_module": pickle.dumps(_Gadget(importlib.import_module, "antigravity"), protocol=2),
        "__reduce__ a method (dotted qualname)": pickle.dumps(_Gadget(subprocess.Popen.__init__), protocol=4),
    }


@contextmanager
def _extensions() -> Iterator[dict[str, int]]:
    """Shell-running functions registered as extension codes 1, 2 and 4 bytes wide (EXT1/EXT2/EXT4),
    as a victim's copyreg registry might hold them, so the unpickler resolves them through find_class."""
    registered = {
        "EXT1": ("posix", "system", 0xF0),
        "EXT2": ("os", "system", 0xF0F0),
        "EXT4": ("subprocess", "getoutput", 0x0F0F0F0),
    }
    for module, name, code in registered.values():
        copyreg.add_extension(module, name, code)
    try:
        yield {opcode: code for opcode, (_, _, code) in registered.items()}
    finally:
        for module, name, code in registered.values():
            copyreg.remove_extension(module, name, code)


def _extension_payload(opcode: str, code: int, command: str) -> bytes:
    opcode_byte, layout = {"EXT1": (b"\x82", "<B"), "EXT2": (b"\x83", "<H"), "EXT4": (b"\x84", "<i")}[opcode]
    encoded = opcode_byte + struct.pack(layout, code)
    return b"\x80\x02" + encoded + _unicode(command) + b"\x85R."


def _torch_file_with_pickle(payload: bytes) -> bytes:
    """A torch.save zip whose data.pkl is ``payload``: what torch.load(weights_only=True) reads."""
    template = io.BytesIO()
    torch.save({"a": 1}, template)
    source = zipfile.ZipFile(io.BytesIO(template.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name in source.namelist():
            archive.writestr(name, payload if name.endswith("data.pkl") else source.read(name))
    return out.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = TinyTransformer(blocks=1, width=8)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    path = tmp_path_factory.mktemp("unpickling") / "checkpoint"
    engine.save_checkpoint(path, extra={"epoch": 1})
    return path


def _refused(checkpoint: Path, work: Path, file_name: str, content: bytes, sentinel: Path) -> str:
    target = files.copy_checkpoint(checkpoint, work / "target")
    (target / file_name).write_bytes(content)
    files.resign(target)
    with pytest.raises(CheckpointError) as raised:
        load_full_checkpoint(target)
    assert not sentinel.exists()
    return str(raised.value)


@pytest.mark.parametrize("file_name", [".metadata", "meta.pt"])
def test_no_payload_runs_from_metadata_or_meta_pt(checkpoint: Path, tmp_path: Path, file_name: str) -> None:
    sentinel = tmp_path / "code-ran"
    for name, payload in {**_payloads(sentinel), **_inert_payloads(sentinel)}.items():
        content = payload if file_name == ".metadata" else _torch_file_with_pickle(payload)
        message = _refused(checkpoint, tmp_path, file_name, content, sentinel)
        assert "refusing" in message or "corrupt" in message, (name, message)
    with _extensions() as codes:
        for opcode, code in codes.items():
            payload = _extension_payload(opcode, code, f"touch {sentinel}")
            content = payload if file_name == ".metadata" else _torch_file_with_pickle(payload)
            message = _refused(checkpoint, tmp_path, file_name, content, sentinel)
            assert "refusing" in message or "corrupt" in message, (opcode, message)


def test_the_payloads_run_code_under_plain_pickle(tmp_path: Path) -> None:
    """The suite above proves something only if these payloads are live."""
    sentinel = tmp_path / "code-ran"
    live = dict(_payloads(sentinel))
    with _extensions() as codes:
        live.update({opcode: _extension_payload(opcode, code, f"touch {sentinel}") for opcode, code in codes.items()})
        for name, payload in live.items():
            result = pickle.loads(payload)
            if isinstance(result, subprocess.Popen):
                result.wait()
            assert sentinel.exists(), name
            sentinel.unlink()


def test_metadata_unpickler_refuses_dotted_names_of_allowed_modules() -> None:
    for module, name in (
        ("torch.distributed.checkpoint.filesystem", "os.system"),
        ("torch", "os.system"),
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
    ):
        with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
            MetadataUnpickler(io.BytesIO(_stack_global(module, name, "true"))).load()


def test_no_payload_runs_from_a_pickled_object_in_the_shards(checkpoint: Path, tmp_path: Path) -> None:
    """Param groups and other objects live pickled inside the .distcp files."""
    sentinel = tmp_path / "code-ran"
    for name, gadget in {
        "os.system": _Gadget(os.system, f"touch {sentinel}"),
        "exec": _Gadget(builtins.exec, f"open({str(sentinel)!r}, 'w').close()"),
    }.items():
        target = files.copy_checkpoint(checkpoint, tmp_path / "target")
        for stale in target.glob("*.distcp"):
            stale.unlink()
        (target / ".metadata").unlink()
        state = {"model": load_full_checkpoint(checkpoint)["model"], "optimizer_0": {"param_groups": [{"lr": gadget}]}}
        dcp.save(state, storage_writer=FileSystemWriter(target), no_dist=True)
        files.resign(target)
        with pytest.raises(CheckpointError, match="refusing to load an object from the checkpoint"):
            load_full_checkpoint(target)
        assert not sentinel.exists(), name


def test_consolidation_tool_refuses_and_exits_nonzero(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sentinel = tmp_path / "code-ran"
    target = files.copy_checkpoint(checkpoint, tmp_path / "target")
    (target / ".metadata").write_bytes(
        _stack_global("torch.distributed.checkpoint.filesystem", "os.system", f"touch {sentinel}")
    )
    files.resign(target)
    assert consolidate_main([str(target), str(tmp_path / "out.safetensors")]) == 2
    assert "refusing to load torch.distributed.checkpoint.filesystem.os.system" in capsys.readouterr().err
    assert not sentinel.exists() and not (tmp_path / "out.safetensors").exists()
    shutil.rmtree(target)
    with pytest.raises(CheckpointError, match="does not exist"):
        consolidate_checkpoint(target, tmp_path / "out.safetensors")


def _build_on_global(module: str, name: str, state: object) -> bytes:
    """GLOBAL module.name, then BUILD with ``state`` on it (setattr on a class or function), then None."""
    body = pickle.dumps(state, protocol=2)[2:-1]  # without PROTO and STOP
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + body + b"b0" + pickle.dumps(None, protocol=2)[2:]


def test_build_cannot_change_allowed_classes_or_functions_for_the_process() -> None:
    """BUILD on an allowed class would set attributes process-wide (every Path's name,
    DCP's records, torch's layout lookup), which later saves and loads would act on."""
    attacks = {
        ("pathlib", "PosixPath"): (None, {"name": "hijacked"}),
        ("torch.distributed.checkpoint.metadata", "Metadata"): (None, {"planner_data": {"model.x": ("evil",)}}),
        ("torch.serialization", "_get_layout"): {"cache": {"torch.sparse_coo": torch.strided}},
        ("torch", "Size"): (None, {"numel": None}),
    }
    for (module, name), state in attacks.items():
        with pytest.raises(pickle.UnpicklingError, match="refusing to set the state of"):
            MetadataUnpickler(io.BytesIO(_build_on_global(module, name, state))).load()
    assert Path("/ckpt/step-1").name == "step-1"
    assert torch.distributed.checkpoint.metadata.Metadata({}).planner_data is None
    assert torch.serialization._get_layout("torch.sparse_coo") is torch.sparse_coo
    assert torch.Size([2, 3]).numel() == 6


# ------------------------------------------------------------ resource bombs in re-signed files
def _assert_refused(checkpoint: Path, tmp_path: Path, tamper: Callable[[Path], None], match: str) -> None:
    target = files.copy_checkpoint(checkpoint, tmp_path / "target")
    tamper(target)
    files.resign(target)
    with pytest.raises(CheckpointError, match=match):
        load_full_checkpoint(target)


def test_deeply_nested_tuples_are_refused_not_a_crash(checkpoint: Path, tmp_path: Path) -> None:
    """A million-deep tuple used as a dict key would crash the process when hashed (C recursion)."""

    def nest(target: Path) -> None:
        (target / ".metadata").write_bytes(b"\x80\x02}" + b")" + b"\x85" * 1_000_000 + b"NsN.")

    _assert_refused(checkpoint, tmp_path, nest, "refusing tuples nested more than 32 deep")


def test_a_chunk_list_shared_by_many_entries_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    """Pickle stores a shared list once: N entries x N chunks from a few KB, quadratic to check."""

    def share(target: Path) -> None:
        metadata = files.read_metadata(target)
        template = next(e for e in metadata.state_dict_metadata.values() if hasattr(e, "chunks"))
        chunk = type(template.chunks[0])
        shared = [chunk(offsets=torch.Size([0, 0]), sizes=torch.Size([0, 0])) for _ in range(2000)]
        for index in range(2000):
            metadata.state_dict_metadata[f"junk{index}"] = type(template)(
                template.properties, torch.Size([1, 1]), shared
            )
        files.write_metadata(target, metadata)

    _assert_refused(checkpoint, tmp_path, share, "shares its chunk list|more chunks than stored items")


def test_a_compressed_record_is_refused_before_it_inflates(checkpoint: Path, tmp_path: Path) -> None:
    """A deflated record of zeros inflates a thousandfold inside torch.load before any size check."""

    def deflate(target: Path) -> None:
        metadata = files.read_metadata(target)
        info = next(s for i, s in metadata.storage_data.items() if i.fqn.startswith("model."))
        data = (target / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        source, bomb = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
        with zipfile.ZipFile(bomb, "w") as archive:
            for record in source.infolist():
                packed = "/data/" in record.filename
                body = source.read(record) + (bytes(1 << 20) if packed else b"")
                archive.writestr(
                    record.filename, body, compress_type=zipfile.ZIP_DEFLATED if packed else zipfile.ZIP_STORED
                )
        with open(target / info.relative_path, "ab") as stream:
            info.offset = stream.tell()
            stream.write(bomb.getvalue())
        info.length = len(bomb.getvalue())
        files.write_metadata(target, metadata)

    _assert_refused(checkpoint, tmp_path, deflate, "holds compressed records")


def test_a_manifest_that_is_a_symbolic_link_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    target = files.copy_checkpoint(checkpoint, tmp_path / "target")
    (target / "zero-manifest.json").rename(tmp_path / "elsewhere.json")
    (target / "zero-manifest.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        load_full_checkpoint(target)


def test_numpy_data_in_the_extra_state_round_trips_and_still_runs_no_code(checkpoint: Path, tmp_path: Path) -> None:
    """Users keep numpy arrays and scalars in their extra state (Lightning's on_save_checkpoint) as DDP's
    torch.save does: they save and read back exactly; an object array's elements still go through the allow-list."""
    torch.manual_seed(0)
    model = TinyTransformer(blocks=1, width=8)
    engine = ZeroEngine(model, make_optimizer("adamw", model), config_for(3))
    extra = {
        "array": np.arange(4.0),
        "ints": np.array([[1, 2]], dtype=np.int32),
        "scalars": (np.float64(2.5), np.int64(7), np.bool_(True)),
        "objects": np.array([1, "x"], dtype=object),
        "rng": np.random.default_rng(0).bit_generator.state,
    }
    engine.save_checkpoint(tmp_path / "numpy", extra=extra)
    loaded = engine.read_checkpoint_extra(tmp_path / "numpy")
    assert loaded.keys() == extra.keys() and loaded["rng"] == extra["rng"]
    for key in ("array", "ints", "objects"):
        assert loaded[key].dtype == extra[key].dtype and np.array_equal(loaded[key], extra[key])
    assert [(type(v), v) for v in loaded["scalars"]] == [(type(v), v) for v in extra["scalars"]]

    sentinel = tmp_path / "code-ran"
    hostile = io.BytesIO()
    torch.save({"epoch": np.array([_Gadget(os.system, f"touch {sentinel}")], dtype=object)}, hostile)
    message = _refused(checkpoint, tmp_path, "meta.pt", hostile.getvalue(), sentinel)
    assert "only arbitrary code could rebuild" in message
