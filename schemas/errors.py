"""The one error type of the data contract: it names the record and the field, so a bad row can be found."""
from __future__ import annotations


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
