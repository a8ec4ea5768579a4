"""engine.checkpoints.model_info on broken model folders: one-line UserErrors naming the file or the field."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from engine.checkpoints.model_info import read_model_info
from engine.checkpoints.weights import checkpoint_files
from engine.errors import UserError
from tests.conftest import mla_fields, write_config

LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1234\n"


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


GOOD = _safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (LFS_POINTER, "Git LFS pointer.*git lfs pull"),
        (b"\xff" * 64, "header length does not fit"),
        (b"abc", "header length does not fit"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "header is not JSON"),
        (_safetensors([1], b""), "not a JSON object"),  # type: ignore[arg-type]
        (_safetensors({"w": {"dtype": "F32"}}, b""), "'w' has a malformed header entry"),
        (GOOD[:-4], r"is truncated"),
    ],
)
def test_damaged_safetensors_is_a_one_line_error(tmp_path, content, match):
    folder = write_config(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(content)
    for read in (read_model_info, checkpoint_files):
        with pytest.raises(UserError, match=match) as err:
            read(folder)
        assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_a_good_header_is_read(tmp_path):
    folder = write_config(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(GOOD)
    assert read_model_info(folder).weight_bytes == 8


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"num_key_value_heads": 0}, "'num_key_value_heads' is 0; it must be at least 1"),
        ({"num_attention_heads": -2}, "'num_attention_heads' is -2"),
        ({"head_dim": 0}, "'head_dim' is 0"),
        ({"hidden_size": "abc"}, "'hidden_size' must be a whole number, not 'abc'"),
        ({"num_hidden_layers": None}, "missing field 'num_hidden_layers'"),
        ({"vocab_size": 0}, "'vocab_size' is 0"),
        ({"intermediate_size": -1}, "'intermediate_size' is -1; it must be at least 0"),
    ],
)
def test_zero_negative_or_mistyped_sizes_name_the_field(tmp_path, fields, match):
    folder = write_config(tmp_path / "m", **fields)
    with pytest.raises(UserError, match=match):
        read_model_info(folder)


@pytest.mark.parametrize("field", ["kv_lora_rank", "v_head_dim", "qk_rope_head_dim"])
def test_mla_sizes_must_be_positive(tmp_path, field):
    folder = write_config(tmp_path / "m", **mla_fields(**{field: 0}))
    with pytest.raises(UserError, match=f"'{field}' is 0"):
        read_model_info(folder)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_broken_tokenizer_is_a_one_line_error(tmp_path, tiny_models, damage):
    from engine.core.engine import load_tokenizer

    folder = tmp_path / "m"
    shutil.copytree(tiny_models("llama", num_layers=1), folder)
    if damage == "missing":
        (folder / "tokenizer.json").unlink()
    else:
        (folder / "tokenizer.json").write_text("{bad")
    with pytest.raises(UserError, match=r"its tokenizer cannot be loaded.*valid tokenizer\.json") as err:
        load_tokenizer(folder)
    assert "\n" not in str(err.value)
