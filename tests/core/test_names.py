"""Buffer names as users type them, and the forms Ray's metric tags and the file system take (rayrb.core.names)."""
from __future__ import annotations

import itertools
import os

import pytest

from rayrb.core.names import KEY_CHARS, PLAIN_CHARS, buffer_name, directory_name, name_key
from rayrb.durability.leftovers import _VERSION, version_name
from rayrb.errors import InvalidArgumentTypeError

TYPED = ["puffer ü 1", "回放", "n" * 250, "n" * 251, "ü" * 200, "tab\there", "nul\0", "emoji 🦆", "a/b", "a_b", "..",
         "x~0123456789abcdef0123", "Ünïcödé/off-0", "\udcff lone surrogate", " ", "-", "~"]
OLD = ["replay", "rayrb-0123456789ab", "team/replay 1", "x" * PLAIN_CHARS, "with ~tilde", "a.b-c_d"]


def test_plain_ascii_names_keep_their_old_forms():
    for name in OLD:  # what state directories and version maps were named before
        assert name_key(name) == name
        assert directory_name(name) == name.replace("/", "_")


@pytest.mark.parametrize("name", TYPED + OLD)
def test_every_form_is_printable_ascii_and_bounded(name):
    key = name_key(name)
    assert key.isascii() and key.isprintable() and len(key) <= max(KEY_CHARS, PLAIN_CHARS)
    assert "/" not in directory_name(name) and "\0" not in directory_name(name)
    # what the file system takes: a state directory's name and a version map's, at most 255 bytes
    assert len(f"{directory_name(name)}-01234567".encode()) <= 255
    file = version_name(name, "c" * 56, "a" * 32)
    assert len(file.encode()) <= 255 and _VERSION.match(file)  # clean-up still recognizes it


def test_the_tag_form_is_one_to_one():
    names = TYPED + OLD + [name_key(n) for n in TYPED]  # a name typed as another's hashed form is hashed again
    keys = [name_key(n) for n in names]
    assert len(set(keys)) == len(set(names))
    assert name_key("puffer ü 1").startswith("puffer u 1~")  # readable: accents dropped
    for a, b in itertools.combinations(["n" * 250, "n" * 251, "n" * 250 + "ü"], 2):
        assert name_key(a) != name_key(b)  # past the readable prefix, the hash tells them apart


def test_a_state_directory_of_a_long_or_unicode_name_can_be_made(tmp_path):
    for name in TYPED:
        os.makedirs(tmp_path / f"{directory_name(name)}-01234567" / "coordinator", exist_ok=True)  # a/b, a_b: one


def test_the_name_option():
    assert buffer_name("回放") == "回放"
    assert buffer_name(None) != buffer_name(None) and buffer_name("").startswith("rayrb-")
    for bad in (7, b"bytes", ["a"]):
        with pytest.raises(InvalidArgumentTypeError, match=f"name must be a string .* got {type(bad).__name__}"):
            buffer_name(bad)
