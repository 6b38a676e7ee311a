"""probe's CRC-32C gives TensorBoard's checksums, and probe's event files read back."""

from __future__ import annotations

import os
import random

from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as tb_crc32c
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked

import probe
from probe.sinks import checksum
from tests.sinks.sinkutil import model_and_inputs, train_step


def test_the_checksums_of_tensorboards_own_implementation():
    assert checksum.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    rng = random.Random(0)
    lengths = list(range(0, 600)) + [1023, 1024, 1025, 4096, 7082, 65537]
    for n in lengths:
        for data in (os.urandom(n), bytes(n), b"\xff" * n, bytes(rng.randrange(256) for _ in range(n))):
            assert checksum.crc32c(data) == tb_crc32c(data), n
            assert checksum.masked_crc32c(data) == tb_masked(data), n


def test_probes_event_file_is_checksummed_and_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    model, xs = model_and_inputs(3)
    with probe.watch(model, logdir=tmp_path):
        for x in xs:
            train_step(model, x)
    (name,) = [n for n in os.listdir(tmp_path) if n.startswith("events.out.tfevents")]
    path = os.path.join(tmp_path, name)
    with open(path, "rb") as fh:
        raw = fh.read()
    records, offset = [], 0
    while offset < len(raw):  # every record's framing checked with TensorBoard's checksum
        header = raw[offset:offset + 8]
        length = int.from_bytes(header, "little")
        assert int.from_bytes(raw[offset + 8:offset + 12], "little") == tb_masked(header)
        data = raw[offset + 12:offset + 12 + length]
        assert int.from_bytes(raw[offset + 12 + length:offset + 16 + length], "little") == tb_masked(data)
        records.append(data)
        offset += 16 + length
    assert offset == len(raw) and len(records) > 3
    assert [bytes(r) for r in RawEventFileLoader(path).Load()] == records  # TensorBoard's reader agrees
    steps = [event_pb2.Event.FromString(r).step for r in records]
    assert {0, 1, 2} <= set(steps)


def test_speed_up_leaves_other_writers_alone():
    class Other:
        def _get_file_writer(self):
            return object()

    assert not checksum.speed_up(Other())
    assert not checksum.speed_up(object())


def test_probes_own_writer_uses_it(tmp_path, monkeypatch):
    from probe.sinks import eventfile
    from probe.sinks.tensorboard import TensorBoardSink
    from tests.sinks.sinkutil import reference_summary

    calls = []

    def spy(data):
        calls.append(len(data))
        return checksum.masked_crc32c(data)

    monkeypatch.setattr(eventfile, "masked_crc32c", spy)
    sink = TensorBoardSink(tmp_path)
    assert isinstance(sink.writer, eventfile.EventFile)  # probe's own writer, no TensorBoard thread
    sink.write(0, reference_summary(*model_and_inputs(1)))
    sink.close()
    assert len(calls) >= 4 and len(calls) % 2 == 0  # two checksums a record, every record
