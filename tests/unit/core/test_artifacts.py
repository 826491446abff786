"""Artifact envelopes and tensor files: what round-trips, and what a reader refuses."""

from __future__ import annotations

import msgspec
import pytest
import torch

from miniverl.engine.core import artifacts
from miniverl.engine.core.artifacts import (
    ChunkAttempt, Gradient, TensorFile, decode_artifact, encode_artifact, encode_tensors, read_artifact,
    read_tensors,
)
from miniverl.engine.core.atomic_io import sha256_bytes, write_bytes_atomic


def write_artifact(path, value) -> str:
    """What the driver does with a stage's output: encode, write atomically, journal the file's hash."""
    data = encode_artifact(value)
    write_bytes_atomic(path, data)
    return sha256_bytes(data)
from miniverl.engine.core.errors import ArtifactError


def _gradient() -> Gradient:
    return Gradient(3, "ab" * 32, TensorFile("g.safetensors", "cd" * 32), 0.5, 0.25, 17, 2, 64,
                    [ChunkAttempt(128, False, "oom"), ChunkAttempt(64, True, None)], 1.5)


def test_an_artifact_round_trips_and_its_hash_is_the_file_hash(tmp_path) -> None:
    path = tmp_path / "a" / "gradient.msgpack"
    digest = write_artifact(path, _gradient())
    assert digest == sha256_bytes(path.read_bytes())
    assert read_artifact(path, Gradient, digest) == _gradient()


def test_a_flipped_bit_a_wrong_kind_and_a_newer_schema_are_refused() -> None:
    data = bytearray(encode_artifact(_gradient()))
    data[-5] ^= 0x01  # inside the payload
    with pytest.raises(ArtifactError, match="content hash mismatch"):
        decode_artifact(bytes(data), Gradient, "x")
    with pytest.raises(ArtifactError, match="holds a Gradient, expected Rollout"):
        decode_artifact(encode_artifact(_gradient()), artifacts.Rollout, "x")
    envelope = msgspec.msgpack.decode(encode_artifact(_gradient()), type=artifacts.Envelope)
    newer = msgspec.msgpack.encode(msgspec.structs.replace(envelope, schema=artifacts.SCHEMA_VERSION + 1))
    with pytest.raises(ArtifactError, match="this miniverl reads"):
        decode_artifact(newer, Gradient, "x")
    with pytest.raises(ArtifactError, match="unreadable artifact"):
        decode_artifact(b"not msgpack at all", Gradient, "x")


def test_a_replaced_file_is_refused_against_the_journal_hash(tmp_path) -> None:
    path = tmp_path / "gradient.msgpack"
    digest = write_artifact(path, _gradient())
    write_artifact(path, msgspec.structs.replace(_gradient(), loss=0.75))  # valid, but not the journaled bytes
    with pytest.raises(ArtifactError, match="does not match the hash the journal recorded"):
        read_artifact(path, Gradient, digest)
    with pytest.raises(ArtifactError, match="missing"):
        read_artifact(tmp_path / "absent.msgpack", Gradient, digest)


def test_tensors_round_trip_bit_exact_and_corruption_is_caught(tmp_path) -> None:
    tensors = {"a": torch.randn(3, 4, dtype=torch.float32), "b": torch.arange(5, dtype=torch.int64)}
    data = encode_tensors(tensors)
    (tmp_path / "t.safetensors").write_bytes(data)
    ref = TensorFile("t.safetensors", sha256_bytes(data))
    back = read_tensors(tmp_path, ref)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    (tmp_path / "t.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match="content hash mismatch"):
        read_tensors(tmp_path, ref)
