"""safetensors headers, memory-mapped reads, the in-place shard writer, and checkpoint
directories (config + index): good files round-trip bit-exactly with the safetensors package,
bad ones raise one QStreamError naming the file and tensor."""

import hashlib
import json
import os
import struct
import threading

import pytest
import torch
from checkpoints import as_bytes, llama_tensors, write_checkpoint
from safetensors.torch import load_file, save_file

from qstream.checkpoint.files import open_checkpoint
from qstream.checkpoint.safetensors_io import (
    DTYPE_NAMES,
    PlannedTensor,
    ShardReader,
    ShardWriter,
    drop_resident_pages,
    planned_file_size,
    read_header,
)
from qstream.errors import QStreamError


def _mixed_tensors():
    gen = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(7, 5, generator=gen).bfloat16(),
        "b.weight": torch.randn(3, 4, generator=gen),
        "c.scale": torch.randn(3, 1, generator=gen).to(torch.float8_e4m3fn),
        "d.packed": torch.randint(0, 255, (4, 6), generator=gen, dtype=torch.uint8),
        "e.scalar": torch.tensor(2.5, dtype=torch.float16),
        "f.empty": torch.zeros(0, 3),
    }


def test_header_and_reads_match_the_safetensors_package(tmp_path):
    path = tmp_path / "x.safetensors"
    tensors = _mixed_tensors()
    save_file(tensors, path, metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    reader = ShardReader(header)
    for name, t in tensors.items():
        assert header.tensors[name].shape == tuple(t.shape)
        got = reader.tensor(name)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert as_bytes(got) == as_bytes(t), name
    # row ranges, and reads after the pages were released
    assert as_bytes(reader.tensor("a.weight", slice(2, 5))) == as_bytes(tensors["a.weight"][2:5])
    reader.release("a.weight")
    assert as_bytes(reader.tensor("a.weight")) == as_bytes(tensors["a.weight"])


@pytest.mark.parametrize("digest", [False, True])
def test_writer_in_row_pieces_out_of_order_is_read_back_by_safetensors(tmp_path, digest):
    tensors = _mixed_tensors()
    planned = [PlannedTensor(n, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "out.safetensors"
    writer = ShardWriter(path, planned, {"format": "pt"}, digest=digest)
    writer.write("a.weight", tensors["a.weight"][4:], row_start=4)
    for name, t in reversed(list(tensors.items())):
        if name != "a.weight":
            writer.write(name, t)
    writer.write("a.weight", tensors["a.weight"][:4], row_start=0)
    sha = writer.close()
    # the digest followed writes made out of file order: it equals a hash of the finished file
    assert sha == (hashlib.sha256(path.read_bytes()).hexdigest() if digest else None)
    assert path.stat().st_size == planned_file_size(planned, {"format": "pt"})
    back = load_file(path)
    for name, t in tensors.items():
        assert as_bytes(back[name]) == as_bytes(t), name
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert length % 8 == 0


@pytest.mark.parametrize("digest", [False, True])
def test_writer_refuses_to_close_an_incomplete_file(tmp_path, digest):
    writer = ShardWriter(
        tmp_path / "o.safetensors", [PlannedTensor("x", "F32", (4, 2))], digest=digest
    )
    writer.write("x", torch.zeros(2, 2), row_start=2)  # the hash cannot pass the gap at row 0
    with pytest.raises(RuntimeError, match="not completely written"):
        writer.close()


def test_an_aborted_writer_stops_its_digest(tmp_path):
    writer = ShardWriter(
        tmp_path / "o.safetensors", [PlannedTensor("x", "F32", (4, 2))], digest=True
    )
    writer.write("x", torch.zeros(2, 2), row_start=2)
    writer.abort()  # returns: the hashing thread waiting at the gap is stopped, not left behind
    assert not [t for t in threading.enumerate() if t.name == "qstream-sha256"]


def _raw_file(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    "header, data, message",
    [
        (
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
            "run past the end",
        ),
        (
            {
                "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlaps",
        ),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "unaccounted"),
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "unknown dtype 'Q4'"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"\0" * 8, "bad shape"),
        (
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
            b"\0" * 8,
            "bad data_offsets",
        ),
        (
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 9,
            "after the last",
        ),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "exactly dtype, shape and data_offsets"),
    ],
)
def test_bad_headers_name_the_file_and_tensor(tmp_path, header, data, message):
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(QStreamError, match=message) as exc:
        read_header(path)
    assert str(path) in str(exc.value)
    if message not in ("after the last",):
        assert "'w'" in str(exc.value) or "'v'" in str(exc.value)


def test_truncated_corrupt_and_oversized_headers(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(QStreamError, match="truncated"):
        read_header(short)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(struct.pack("<Q", 500) + b"{}")
    with pytest.raises(QStreamError, match="truncated"):
        read_header(cut)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(QStreamError, match="over the"):
        read_header(huge)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(QStreamError, match="corrupt safetensors header"):
        read_header(garbage)


def test_truncated_real_file_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(llama_tensors(layers=1), path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(QStreamError, match="truncated"):
        read_header(path)


def test_checkpoint_with_index(tmp_path):
    tensors = llama_tensors(layers=2)
    names = list(tensors)
    write_checkpoint(tmp_path, tensors, shards=[names[:9], names[9:]])
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.has_index and len(ckpt.shards) == 2
    assert list(ckpt.tensor_shard) == list(
        json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    )


def test_index_naming_a_missing_shard(tmp_path):
    tensors = llama_tensors(layers=1)
    names = list(tensors)
    write_checkpoint(tmp_path, tensors, shards=[names[:5], names[5:]])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(QStreamError, match="names shard 'model-00002-of-00002.safetensors'"):
        open_checkpoint(tmp_path)


def test_tensor_in_two_shards(tmp_path):
    tensors = llama_tensors(layers=1)
    names = list(tensors)
    write_checkpoint(tmp_path, tensors, shards=[names[:5], names[4:]])
    with pytest.raises(QStreamError, match=f"{names[4]!r} is in two shards"):
        open_checkpoint(tmp_path)


def test_index_with_a_tensor_listed_twice_or_misplaced(tmp_path):
    tensors = llama_tensors(layers=1)
    names = list(tensors)
    write_checkpoint(tmp_path, tensors, shards=[names[:5], names[5:]])
    index_path = tmp_path / "model.safetensors.index.json"
    text = index_path.read_text()
    index_path.write_text(
        text.replace(
            '"weight_map": {',
            f'"weight_map": {{"{names[0]}": "model-00002-of-00002.safetensors", ',
        )
    )
    with pytest.raises(QStreamError, match="appears twice"):
        open_checkpoint(tmp_path)
    index = json.loads(text)
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(QStreamError, match="is mapped to model-00002-of-00002.safetensors but"):
        open_checkpoint(tmp_path)


def test_missing_or_bad_config(tmp_path):
    write_checkpoint(tmp_path, llama_tensors(layers=1))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(QStreamError, match="config.json is not valid JSON"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(QStreamError, match="missing config.json"):
        open_checkpoint(tmp_path)


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssFile from /proc")
def test_dropped_pages_leave_memory_and_come_back_unchanged(tmp_path):
    """eval-drift drops mapped weights a pass no longer reads: the pages leave the process's
    resident set, the tensor reads back bit-identical, and a tensor outside any mapping (here
    anonymous memory, which MADV_DONTNEED would zero) is left alone."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(2048, 4096, generator=gen).to(torch.bfloat16)  # 16 MiB
    save_file({"w": weight, "tail": weight[:3].clone()}, tmp_path / "m.safetensors")
    reader = ShardReader(read_header(tmp_path / "m.safetensors"))
    mapped = reader.tensor("w")
    assert torch.equal(mapped, weight)  # touches every page
    touched = _rss_file_kib()
    drop_resident_pages(mapped)
    assert _rss_file_kib() < touched - 8 * 1024, (touched, _rss_file_kib())
    assert torch.equal(mapped, weight) and torch.equal(reader.tensor("tail"), weight[:3])
    drop_resident_pages()
    assert torch.equal(mapped, weight)
    anonymous = weight.clone()
    drop_resident_pages(anonymous)
    assert torch.equal(anonymous, weight)


SERIALIZE = """
import hashlib, sys, torch
from qstream.checkpoint.safetensors_io import serialize
tensors = {"ids": torch.arange(5), "aux": torch.linspace(-1, 1, 12).reshape(3, 4).bfloat16()}
meta = {"document": "3", "prompt_tokens": "2", "z": "1", "a": "0"}
sys.stdout.write(hashlib.sha256(serialize(tensors, meta)).hexdigest())
"""


def test_serialize_is_the_same_bytes_in_every_process_and_safetensors_reads_it(tmp_path):
    """capture's stream files: safetensors' own save orders metadata keys by a per-process hash
    seed, so two captures of one stream differed in their sha256s."""
    import subprocess
    import sys

    from safetensors import safe_open

    from qstream.checkpoint.safetensors_io import serialize

    digests = {
        subprocess.run([sys.executable, "-c", SERIALIZE], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
        for seed in range(4)
    }  # fmt: skip
    assert len(digests) == 1
    tensors = {"ids": torch.arange(5), "aux": torch.linspace(-1, 1, 12).reshape(3, 4).bfloat16()}
    path = tmp_path / "s.safetensors"
    path.write_bytes(serialize(tensors, {"document": "3", "prompt_tokens": "2"}))
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"document": "3", "prompt_tokens": "2"}
        for name, tensor in tensors.items():
            assert (
                torch.equal(f.get_tensor(name), tensor) and f.get_tensor(name).dtype == tensor.dtype
            )
