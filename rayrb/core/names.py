"""A buffer's name, as the user gave it, and the forms of it that Ray's metric tags and the file system take.

A name may be any string (``"puffer ü 1"``, ``"回放"``, 250 characters). Its actors are named with it as it is
(``<name>``, ``<name>/off-0``: Ray takes any string), so ``ray.get_actor(name)`` finds the coordinator. Ray's metric
tags must be ASCII and a file name at most 255 bytes, so tags and the names of state directories and version maps
use ``name_key(name)``: the name itself when it is printable ASCII of at most ``PLAIN_CHARS`` characters (every
name that worked before maps as it did), else a readable ASCII prefix and a hash of the whole name. The mapping is
one to one: a plain name never ends as a hashed one does (one that would is hashed too). ``directory_name`` also
turns ``/`` into ``_`` (as state directories always did): each file name it goes into has a part that makes it
unique besides (an instance id, an actor id).

Examples:
    >>> name_key("replay-1"), directory_name("team/replay-1")
    ('replay-1', 'team_replay-1')
    >>> name_key("puffer ü 1")
    'puffer u 1~edfd6d42cddb1d564c02'
    >>> len(name_key("n" * 250)) <= KEY_CHARS, name_key("n" * 250) != name_key("n" * 251)
    (True, True)
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
import uuid
from typing import Any

from rayrb.errors import InvalidArgumentTypeError

PLAIN_CHARS = 180  # a plain name's longest: its version map's file name is 64 bytes longer, and at most 255
PREFIX_CHARS = 150  # of a hashed name's readable part
HASH_CHARS = 20  # hex digits (80 bits) of a hashed name's digest
KEY_CHARS = PREFIX_CHARS + 1 + HASH_CHARS
_HASHED = re.compile(rf"~[0-9a-f]{{{HASH_CHARS}}}$")


def buffer_name(name: Any) -> str:
    """The buffer's name: ``name`` (any non-empty string), or a new unique one for None or ``""``.

    >>> buffer_name("回放"), buffer_name(None)[:6]
    ('回放', 'rayrb-')
    >>> buffer_name(7)
    Traceback (most recent call last):
    ...
    rayrb.errors.InvalidArgumentTypeError: name must be a string (or None for a unique one), got int 7
    """
    if name is None or (isinstance(name, str) and not name):
        return f"rayrb-{uuid.uuid4().hex[:12]}"
    if not isinstance(name, str):
        raise InvalidArgumentTypeError(f"name must be a string (or None for a unique one), got "
                                       f"{type(name).__name__} {name!r}"[:300])
    return name


def name_key(name: str) -> str:
    """``name`` as printable ASCII of at most ``KEY_CHARS`` characters, one to one (see the module)."""
    if len(name) <= PLAIN_CHARS and name.isascii() and name.isprintable() and not _HASHED.search(name):
        return name
    # the readable part: accents dropped (ü → u), other characters outside printable ASCII as "_"
    plain = "".join(c for c in unicodedata.normalize("NFKD", name) if not unicodedata.combining(c))
    prefix = "".join(c if c.isascii() and c.isprintable() else "_" for c in plain)[:PREFIX_CHARS]
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]
    return f"{prefix}~{digest}"


def directory_name(name: str) -> str:
    """``name_key(name)`` as one file name: ``/`` becomes ``_`` (as it always did for a state directory)."""
    return name_key(name).replace("/", "_")
