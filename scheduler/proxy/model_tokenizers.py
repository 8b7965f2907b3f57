"""Each model's tokenizer, as ``kvherd serve --tokenizer`` names them.

Contract:
- `parse_tokenizer_specs(values)` reads the ``--tokenizer`` values: ``DIR`` (or ``byte``) is the
  default, for every model; ``MODEL=DIR`` is one base model's (repeatable). A value that is an
  existing path is a ``DIR`` even with a ``=`` in it. At most one default and one entry per model,
  else `ValueError`.
- `ModelTokenizers.load(specs)` loads each (`kvherd.tokenizer.load_tokenizer`, strict: a missing
  package or directory raises `TokenizerUnavailable` naming the model) once, at start-up.
- `for_model(base)`: the tokenizer of a base model (an adapter's parent): its own, else the
  default (the byte tokenizer when none was given). One dict lookup.
- `named(base)`: whether the operator gave `base` a tokenizer (its own or the default);
  `name_of(base)`: the spec it was loaded from (``byte`` for the byte tokenizer).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvherd.tokenizer import BYTE_TOKENIZER, Tokenizer, TokenizerUnavailable, load_tokenizer


@dataclass(frozen=True, slots=True)
class TokenizerSpecs:
    default: str | None  # DIR or "byte" for every model (None: not given)
    per_model: Mapping[str, str]  # base model -> DIR


def parse_tokenizer_specs(values: Sequence[str] | str | None) -> TokenizerSpecs:
    if values is None:
        return TokenizerSpecs(None, {})
    if isinstance(values, str):
        values = [values]
    default: str | None = None
    per_model: dict[str, str] = {}
    for value in values:
        model, sep, path = value.partition("=")
        if not sep or os.path.exists(value):
            if default is not None:
                raise ValueError(
                    f"--tokenizer {value!r}: a default tokenizer ({default!r}) is already given; "
                    "name the model of each other one: --tokenizer MODEL=DIR"
                )
            default = value
            continue
        if not model or not path:
            raise ValueError(f"--tokenizer {value!r}: expected DIR or MODEL=DIR")
        if model in per_model:
            raise ValueError(f"--tokenizer {value!r}: model {model!r} already has a tokenizer")
        per_model[model] = path
    return TokenizerSpecs(default, per_model)


class ModelTokenizers:
    """The default tokenizer and the per-model ones (`specs`: what they were loaded from)."""

    __slots__ = ("_by_model", "_default", "specs")

    def __init__(
        self,
        default: Tokenizer,
        by_model: Mapping[str, Tokenizer] | None = None,
        specs: TokenizerSpecs | None = None,
    ) -> None:
        self._default = default
        self._by_model = dict(by_model or {})
        self.specs = specs or TokenizerSpecs(None, {})

    @classmethod
    def load(cls, specs: TokenizerSpecs) -> ModelTokenizers:
        by_model: dict[str, Tokenizer] = {}
        for model, path in specs.per_model.items():
            try:
                by_model[model] = load_tokenizer(path, strict=True)
            except TokenizerUnavailable as exc:
                raise TokenizerUnavailable(f"model {model!r}: {exc}") from exc
        return cls(load_tokenizer(specs.default, strict=True), by_model, specs)

    def for_model(self, base: str | None) -> Tokenizer:
        if base is None:
            return self._default
        return self._by_model.get(base, self._default)

    def named(self, base: str | None) -> bool:
        return self.specs.default is not None or (base is not None and base in self._by_model)

    def name_of(self, base: str | None) -> str:
        if base is not None and base in self.specs.per_model:
            return self.specs.per_model[base]
        return self.specs.default or BYTE_TOKENIZER
