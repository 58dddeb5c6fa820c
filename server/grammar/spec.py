"""What a request constrains its output to (`GrammarSpec`) and the error of one that cannot be honoured: the
grammar's description alone, without torch or a tokenizer (server.grammar.compiler compiles it for a model)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

# llguidance's JSON options: json.dumps' separators, no free whitespace.
JSON_FORMAT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """A request's grammar, schema or tool definitions cannot be honoured; `param` names the request field (the
    serving layer answers 400 with it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


GrammarKind = Literal["json_schema", "regex", "choice", "lark", "ebnf"]


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: `kind` and its source text (a JSON schema as compact JSON, key order kept: it
    is the order the properties are generated in). `param` is the request field to blame, not part of the key."""

    kind: GrammarKind
    source: str
    param: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, param: str | None = None) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), param)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar definition; ValueError for a source it cannot even read."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_FORMAT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        return llguidance.grammar_from("ebnf", self.source)  # GBNF/EBNF, or Lark text, converted to Lark
