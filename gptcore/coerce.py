"""A setting's value from text: `section.key=value` overrides, TOML files and saved configs give strings
(or JSON's types), and each field's annotation says what the value must become. One place, so that
`train.micro_batch=16`, `eval.hellaswag.limit=500` and a saved config's values are typed alike, with an
error that names the key."""

from __future__ import annotations

from gptcore.security import ConfigError


def coerce(value: str, typ: type, key: str):
    """Turn an override string into the field's type, with an error that names the key."""
    if typ == int | str:  # a number or a word (train.micro_batch: 16 or auto)
        text = str(value).replace("_", "")
        return int(text) if text.isdigit() else value
    if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
        return value
    try:
        if typ is bool:
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typ is int:
            return int(str(value).replace("_", ""))
        if typ is float:
            return float(value)
        return str(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not a valid {typ.__name__}") from None
