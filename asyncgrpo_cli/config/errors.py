"""The configuration errors: each names the key, the value and the fix (shared by every config check module)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .citations import cite_shipped


def shown_value(key: str, value: object) -> str:
    """``value`` as an error shows it after ``key=``: a dotted (CLI) key's boolean or null in the YAML words the user
    types (``true``, ``null``), and its mapping or list in YAML's flow style (``{every_n_layers: 2}``); anything
    else, and every value of a Python-API name, as Python's ``repr``."""
    if "." not in key:
        return repr(value)
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {shown_value(key, v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(shown_value(key, v) for v in value) + "]"
    return repr(value)


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and the fix.

    Attributes:
        key: the config key at fault (``rollout.top_p``, ``num_generations`` ...), None when not one key.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(cite_shipped(message))
        self.key = key


class ConfigTypeError(TypeError):
    """A configuration value has the wrong type (``num_generations="8"``). Same message form as `ConfigError`.

    Attributes:
        key: the config key at fault.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(cite_shipped(message))
        self.key = key


class ConfigErrors(ConfigError):
    """Several independent configuration problems, one per line (each a `ConfigError`).

    Attributes:
        errors: the individual errors, in the order found.
        keys: their keys (``key`` is the first one).
    """

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = list(errors)
        text = str(self.errors[0]) if len(self.errors) == 1 else \
            f"{len(self.errors)} problems:\n" + "\n".join(f"- {e}" for e in self.errors)
        super().__init__(text, key=self.errors[0].key)
        self.keys = [e.key for e in self.errors]


class Collector:
    """Runs independent checks and keeps every configuration problem they raise, so that one run of the checks names
    them all (a user fixes them in one go, not one per try).

    Attributes:
        errors: the problems found, in order (a `ConfigErrors` contributes each of its own).
        warnings: notes a caller may add (returned, not raised).
    """

    def __init__(self, first_per_key: bool = False) -> None:
        self.errors: list[ConfigError] = []
        self.warnings: list[str] = []
        self.first_per_key = first_per_key

    def add(self, error: ConfigError) -> None:
        """Keep ``error``; with ``first_per_key``, not when a problem of its key is kept already (two passes that
        check one field name it once)."""
        if not (self.first_per_key and error.key is not None and any(e.key == error.key for e in self.errors)):
            self.errors.append(error)

    def run(self, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``check(*args, **kwargs)``; its `ConfigError` / `ConfigErrors` / `ConfigTypeError` are kept (`add`), not
        raised. Returns what the check returned, or None when it raised one of them."""
        try:
            return check(*args, **kwargs)
        except ConfigErrors as exc:
            for error in exc.errors:
                self.add(error)
        except ConfigError as exc:
            self.add(exc)
        except ConfigTypeError as exc:
            self.add(ConfigError(str(exc), key=exc.key))
        return None

    def raise_if_any(self) -> None:
        """Raise what was kept: the one `ConfigError`, or a `ConfigErrors` of them all.

        Raises:
            ConfigError | ConfigErrors: when any problem was kept.
        """
        if self.errors:
            raise ConfigErrors(self.errors) if len(self.errors) > 1 else self.errors[0]
