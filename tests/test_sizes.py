"""One size parser (shardkit.sizes) for every size shardkit takes, read as transformers reads them."""

from __future__ import annotations

import pytest
from transformers.utils.hub import convert_file_size_to_int

from shardkit.bench.runner import main as bench_main
from shardkit.errors import MetadataError
from shardkit.sizes import size_bytes


@pytest.mark.parametrize("text", ["5GB", "2GiB", "500MB", "64MiB", "10KB", "3KiB", "8Mb", "1gb", "7mib"])
def test_units_read_as_transformers_reads_them(text):
    assert size_bytes(text) == convert_file_size_to_int(text)


def test_bytes_pass_as_they_are():
    assert size_bytes(1000) == 1000 and size_bytes("1000") == 1000 and size_bytes(" 12 ") == 12


@pytest.mark.parametrize("bad", ["1.5GB", "abc", "GB", True, 2.0, None, "-"])
def test_what_is_no_size_names_the_argument(bad):
    with pytest.raises(MetadataError, match="--size"):
        size_bytes(bad, what="--size")


def test_bench_refuses_a_size_it_cannot_read_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--size", "1.5GB", "--only", "save"])
    assert exit_info.value.code == 2 and "write e.g. '1500MB'" in capsys.readouterr().err
