"""What one setting of ember's registry (config.py) is: its name, type, default, help string and checks,
and how a raw value (an environment string, or a Python value from `options={...}`) becomes its value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A setting name or value that ember does not accept."""


@dataclass(frozen=True)
class Setting:
    name: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    codegen: bool = False  # changes what ember generates, so it enters cache keys
    check: Callable[[Any], bool] | None = None

    @property
    def env_var(self) -> str:
        return f"EMBER_{self.name.upper()}"

    def parse(self, raw: Any, source: str) -> Any:
        """Convert `raw` (a string from the environment, or a Python value) to this setting's type."""
        try:
            if self.type is bool:
                value = _parse_bool(raw)
            elif isinstance(raw, str) or not isinstance(raw, self.type):
                value = self.type(raw)
            else:
                value = raw
        except (TypeError, ValueError):
            raise ConfigError(
                f"{source}: {self.name}={raw!r} is not a valid {self.type.__name__}{self._valid_hint()}"
            ) from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{source}: {self.name}={raw!r} is not one of {list(self.choices)}")
        if self.check is not None:
            try:
                valid = self.check(value)
            except ValueError as e:  # a check that says what is wrong
                raise ConfigError(f"{source}: {self.name}={raw!r}: {e}") from None
            if not valid:
                raise ConfigError(f"{source}: {self.name}={raw!r} is not valid{self._valid_hint()}")
        return value

    def _valid_hint(self) -> str:
        return f" ({self.help})"


def _parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)
