"""A request's output constraint as a `GrammarSpec`: OpenAI's `response_format` and vLLM's `structured_outputs`.

- `response_format: {"type": "json_object"}`: any JSON object.
- `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`: JSON valid against the
  schema (strict or not: the grammar always holds the output to it, as vLLM does).
- `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object"}` (vLLM): exactly one of them;
  `grammar` is Lark (llguidance's dialect) or GBNF/EBNF (llama.cpp's).

A schema must be valid JSON Schema (its draft's meta-schema, by `jsonschema`); what the grammar engine does not
support is refused when it compiles (`GrammarCompiler`), with the feature named. Every refusal is a
`StructuredOutputError` naming the request field.
"""
from __future__ import annotations

import json
from typing import Any

import jsonschema

from server.grammar.spec import GrammarSpec, StructuredOutputError
from server.api.openai.protocol import ResponseFormat, StructuredOutputs

__all__ = ["JSON_OBJECT_SCHEMA", "check_json_schema", "json_schema_spec", "output_grammar"]

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def check_json_schema(schema: Any, param: str) -> None:
    """StructuredOutputError unless `schema` is a JSON Schema: an object (or boolean) valid against the
    meta-schema of its `$schema` draft (2020-12 when it names none)."""
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(f"a JSON schema must be an object, got {type(schema).__name__}", param)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise StructuredOutputError(f"not a valid JSON Schema{f' at {where}' if where else ''}: {e.message}",
                                    param) from None


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """The grammar of JSON valid against `schema`, once the schema is known to be JSON Schema."""
    check_json_schema(schema, param)
    return GrammarSpec.json_schema(schema, param)


def _response_format_spec(fmt: ResponseFormat) -> GrammarSpec | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec.json_schema(JSON_OBJECT_SCHEMA, "response_format")
    if fmt.json_schema is None:
        raise StructuredOutputError("response_format of type json_schema needs a json_schema object with a schema",
                                    "response_format.json_schema")
    if fmt.json_schema.schema_ is None:
        raise StructuredOutputError("response_format.json_schema needs a schema", "response_format.json_schema.schema")
    return json_schema_spec(fmt.json_schema.schema_, "response_format.json_schema.schema")


def _structured_outputs_spec(so: StructuredOutputs) -> GrammarSpec | None:
    given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(so, name) is not None]
    if so.json_object:
        given.append("json_object")
    if len(given) > 1:
        names = ", ".join(n.rstrip("_") for n in given)
        raise StructuredOutputError(f"structured_outputs takes one constraint, got {names}", "structured_outputs")
    if not given:
        return None
    kind = given[0]
    param = f"structured_outputs.{kind.rstrip('_')}"
    if kind == "json_object":
        return GrammarSpec.json_schema(JSON_OBJECT_SCHEMA, param)
    if kind == "json_":
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"not valid JSON: {e}", param) from None
        return json_schema_spec(schema, param)
    if kind == "regex":
        return GrammarSpec("regex", so.regex, param)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(so.choice, ensure_ascii=False), param)
    if not so.grammar.strip():
        raise StructuredOutputError("the grammar is empty", param)
    return GrammarSpec("ebnf", so.grammar, param)


def output_grammar(response_format: ResponseFormat | None,
                   structured_outputs: StructuredOutputs | None) -> GrammarSpec | None:
    """The constraint a request puts on its output, or None for free text."""
    from_format = _response_format_spec(response_format) if response_format is not None else None
    from_extra = _structured_outputs_spec(structured_outputs) if structured_outputs is not None else None
    if from_format is not None and from_extra is not None:
        raise StructuredOutputError("response_format and structured_outputs both constrain the output; send one",
                                    "structured_outputs")
    return from_format or from_extra
