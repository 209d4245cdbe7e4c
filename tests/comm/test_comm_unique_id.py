import pickle

import pytest

from shardkit.comm import UniqueId
from shardkit.errors import CommArgumentError, CommError


def test_unique_id_is_128_bytes_and_round_trips():
    uid = UniqueId.new(host="10.1.2.3")
    raw = uid.as_bytes()
    assert isinstance(raw, bytes) and len(raw) == 128
    back = UniqueId.from_bytes(raw)
    assert back == uid and (back.host, back.port, back.nonce) == ("10.1.2.3", uid.port, uid.nonce)


def test_unique_id_pickles_and_is_fresh_each_time():
    a, b = UniqueId.new(), UniqueId.new()
    assert pickle.loads(pickle.dumps(a)) == a
    assert a != b and a.nonce != b.nonce
    assert 0 < a.port < 65536


@pytest.mark.parametrize("raw", [b"", b"x" * 127, b"x" * 129])
def test_from_bytes_rejects_wrong_length(raw):
    with pytest.raises(CommArgumentError, match="exactly 128 bytes") as e:
        UniqueId.from_bytes(raw)
    assert isinstance(e.value, ValueError) and isinstance(e.value, CommError)


def test_from_bytes_rejects_foreign_bytes():
    with pytest.raises(CommArgumentError, match="not a shardkit UniqueId"):
        UniqueId.from_bytes(b"\x01" * 128)


def test_host_too_long_is_refused():
    with pytest.raises(CommArgumentError, match="host"):
        UniqueId("h" * 200, 1234, b"\0" * 16)
