"""JSON documents the service prints or stores, with NaN and infinities by name.

Standard JSON has no token for a nonfinite float, and orjson alone would write NaN as null,
erasing the very signal runhealth exists to catch; every document goes through the protocol's
codec (``policies.protocol.nonfinite``) first.
"""

from __future__ import annotations

from typing import Any

import orjson

from policies.protocol import to_wire


def dumps(obj: Any, *, indent: bool = False) -> bytes:
    option = orjson.OPT_INDENT_2 if indent else 0
    return orjson.dumps(to_wire(obj), option=option | orjson.OPT_NON_STR_KEYS)


def dumps_str(obj: Any) -> str:
    return dumps(obj).decode()
