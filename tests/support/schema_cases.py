"""Varied JSON schemas (nested objects, arrays, enums, integer ranges, string patterns, optional fields) shared by
tests/server/api/openai/test_structured_outputs.py, tests/server/api/openai/test_tool_calls.py and
tests/e2e/test_function_calling.py; and the two tools (weather, time) the chat, Responses and Messages endpoint tests
call."""
from __future__ import annotations

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS: list[dict] = [
    {"type": "object"},
    {**OBJ, "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {**OBJ, "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}}, "required": ["age"]},
    {**OBJ, "properties": {"n": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}}, "required": ["n"]},
    {**OBJ, "properties": {"x": {"type": "number", "minimum": 0.5, "maximum": 2.5}}, "required": ["x"]},
    {**OBJ, "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}}, "required": ["ok", "nothing"]},
    {**OBJ, "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {**OBJ, "properties": {"v": {"enum": [1, "two", None, True, 3.5]}}, "required": ["v"]},
    {**OBJ, "properties": {"kind": {"const": "fixed"}, "id": {"type": "integer"}}, "required": ["kind", "id"]},
    {**OBJ, "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {**OBJ, "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,4}$"}}, "required": ["code"]},
    {**OBJ, "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 6}}, "required": ["s"]},
    {**OBJ, "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}}}, "required": ["tags"]},
    {**OBJ, "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}},
     "required": ["xs"]},
    {**OBJ, "properties": {"grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                               "maxItems": 3}, "maxItems": 3}}, "required": ["grid"]},
    {**OBJ, "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]},
    {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}},
    {**OBJ, "properties": {"user": {**OBJ, "properties": {"name": {"type": "string", "maxLength": 10},
                                                           "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
                                     "required": ["name", "email"]}}, "required": ["user"]},
    {**OBJ, "properties": {"order": {**OBJ, "properties": {
        "items": {"type": "array", "minItems": 1, "items": {**OBJ, "properties": {
            "sku": {"type": "string", "pattern": "^[a-z]{3}$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}},
        "total": {"type": "number", "minimum": 0}}, "required": ["items", "total"]}}, "required": ["order"]},
    {**OBJ, "properties": {"maybe": {"type": ["string", "null"]}}, "required": ["maybe"]},
    {**OBJ, "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}},
     "required": ["v"]},
    {**OBJ, "properties": {"v": {"oneOf": [{"type": "boolean"}, {**OBJ, "properties": {"k": {"type": "integer"}},
                                                                  "required": ["k"]}]}}, "required": ["v"]},
    {"$defs": {"point": {**OBJ, "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"]}},
     **OBJ, "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
     "required": ["from", "to"]},
    {"type": "object", "properties": {"meta": {"type": "object", "additionalProperties": {"type": "integer"}}},
     "required": ["meta"], "additionalProperties": False},
    {**OBJ, "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]},
    {**OBJ, "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {**OBJ, "properties": {"pair": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 4},
                                                                     {"type": "integer"}],
                                    "items": False, "minItems": 2}}, "required": ["pair"]},
    {**OBJ, "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "note": {"type": "string", "maxLength": 8}},
     "required": ["level"]},
    {**OBJ, "properties": {"steps": {"type": "array", "maxItems": 3, "items": {**OBJ, "properties": {
        "op": {"enum": ["add", "sub"]}, "args": {"type": "array", "items": {"type": "number"}, "maxItems": 2}},
        "required": ["op", "args"]}}}, "required": ["steps"]},
    {**OBJ, "properties": {"unicode": {"type": "string", "maxLength": 12}, "count": {"type": "integer",
                                                                                     "minimum": 0}},
     "required": ["unicode", "count"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 5},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
]

# the endpoint tests' two tools: their parameters, by tool name
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}/[A-Z][a-z]{1,10}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
