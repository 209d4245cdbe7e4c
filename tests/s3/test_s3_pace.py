"""A background save's pace on S3 (SeaweedFS, see conftest.py): one part in flight, a rest after each,
lifted by a blocking wait; the object is whole and loads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import shardkit.checkpoint as ckpt
from shardkit import knobs
from shardkit.storage.backends import s3_upload

pytestmark = pytest.mark.usefixtures("s3_server")


@pytest.fixture
def parts(monkeypatch):
    """(start, end) of every part upload, each made to take at least 50 ms; ``most``: parts at once."""
    spans, lock, running, most = [], threading.Lock(), [0], [0]
    real = s3_upload.S3MultipartWriter._call

    def traced(self, operation, **kwargs):
        if operation != "upload_part":
            return real(self, operation, **kwargs)
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        start = time.monotonic()
        time.sleep(0.05)
        try:
            return real(self, operation, **kwargs)
        finally:
            with lock:
                running[0] -= 1
                spans.append((start, time.monotonic()))

    monkeypatch.setattr(s3_upload.S3MultipartWriter, "_call", traced)
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", 5 << 20)
    return spans, most


STATE = {"w": torch.arange(6 << 20, dtype=torch.float32)}    # 24 MiB: five parts of 5 MiB


def _loads(url) -> None:
    out = {"w": torch.zeros(6 << 20)}
    ckpt.load(out, url)
    assert torch.equal(out["w"], STATE["w"])


def test_a_paced_background_upload_sends_one_part_at_a_time_and_rests_after_each(s3_url, parts, monkeypatch):
    monkeypatch.setattr(knobs, "BACKGROUND_DISK_SHARE", 0.5)
    future = ckpt.async_save(STATE, s3_url)
    while not future.done():       # polled, as a training loop does: the pace stays
        time.sleep(0.01)
    future.wait()
    spans, most = parts
    assert len(spans) >= 4 and most[0] == 1
    spans.sort()
    for (start, end), (next_start, _) in zip(spans, spans[1:]):
        assert next_start - end >= 0.9 * (end - start)     # a rest at least as long as the part took
    _loads(s3_url)


def test_a_blocking_wait_lifts_the_pace_of_an_upload(s3_url, parts, monkeypatch):
    monkeypatch.setattr(knobs, "BACKGROUND_DISK_SHARE", 0.01)   # rests of 99x a part: 5 s each
    ckpt.async_save(STATE, s3_url).wait()
    spans, _ = parts
    spans.sort()
    assert max(b[0] - a[1] for a, b in zip(spans, spans[1:])) < 2.0
    _loads(s3_url)


def test_a_blocking_save_to_s3_keeps_its_parts_in_flight(s3_url, parts, monkeypatch):
    monkeypatch.setattr(knobs, "OBJECT_UPLOAD_PARTS_IN_FLIGHT", 4)
    ckpt.save(STATE, s3_url)
    assert parts[1][0] > 1
    _loads(s3_url)
