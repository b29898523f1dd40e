"""What every settings model shares: a count refuses booleans.

pydantic takes booleans as 1/0 for counts: ``flush_every: true`` (once also PyYAML's ``yes``)
flushed every step, ``port: false`` bound a random port, a rule's ``cooldown: true`` kept it
quiet for one flush.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["NoBoolCounts"]


class NoBoolCounts(BaseModel):
    """Base of the config sections, rules and actions: an int field given a boolean is an
    error naming the field. Raised by the model (a field validator cannot cover a rule's
    discriminator ``type``), so its ``ctx`` names the field: a config error's source is the
    field's, not every source of the section."""

    @model_validator(mode="before")
    @classmethod
    def _no_bool_counts(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and _takes_int(field.annotation):
                    raise PydanticCustomError(
                        "bool_count",
                        "{field}: a number is expected, got the boolean {value}",
                        {"field": name, "value": str(value)},
                    )
        return data


def _takes_int(annotation: Any) -> bool:
    """An int field (PositiveInt and the like, or int | None), not a bool or float one."""
    if hasattr(annotation, "__metadata__"):  # Annotated[int, Gt(0)]: PositiveInt
        annotation = annotation.__origin__
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_takes_int(a) for a in get_args(annotation))
    return annotation is int
