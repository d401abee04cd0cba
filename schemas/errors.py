"""The one error type of the data contract: it names the record and the field, so a bad row can be found."""
from __future__ import annotations

import json
from typing import Any


class SchemaError(ValueError):
    """A record breaks the data contract. ``record`` is e.g. ``"document 'obelics-17'"``, ``field`` a dotted path."""

    def __init__(self, record: str, field: str, problem: str) -> None:
        self.record = record
        self.field = field
        self.problem = problem
        super().__init__(f"{record}: field {field!r}: {problem}")


def require(condition: bool, record: str, field: str, problem: str) -> None:
    """Raise :class:`SchemaError` unless ``condition`` holds."""
    if not condition:
        raise SchemaError(record, field, problem)


def require_int(value: object, record: str, field: str, *, minimum: int = 0) -> int:
    """Check an integer field (bools are not integers here) and return it."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    require(ok, record, field, f"must be an int >= {minimum}, got {value!r}")
    return value  # type: ignore[return-value]


def parse_json(raw: str | bytes, record: str, field: str = "<root>", what: str = "") -> Any:
    """``json.loads`` whose failure (bad JSON or bad UTF-8) is a :class:`SchemaError` naming the record and field."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(record, field, f"{what}not valid JSON ({exc})") from None
