"""Structured outputs in an OpenAI body → the request's ``StructuredOutput``, checked before dispatch.

Read from OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and vLLM's older ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``. At most one constraint a request. A schema is checked against its JSON
Schema metaschema (jsonschema) and every constraint by the grammar compiler without a tokenizer, so a bad one is a
400 naming the problem; the worker compiles it again against its tokenizer and caches it.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from tokenmill.v1 import common_pb2

from common.sampling import StructuredOutput
from common.structured import GrammarError, check
from common.wire import structured_to_proto

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class ConstraintError(ValueError):
    """A constraint the request cannot have; ``param`` is the body field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _schema(v: Any, where: str) -> str:
    """A JSON schema given as an object or as JSON text → its JSON text, after the metaschema check."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ConstraintError(f"{where} is not valid JSON: {e}", where.split(".")[0]) from None
    if not isinstance(v, dict):
        raise ConstraintError(f"{where} must be a JSON schema object, got {type(v).__name__}", where.split(".")[0])
    try:
        jsonschema.validators.validator_for(v).check_schema(v)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.path)
        raise ConstraintError(f"{where} is not a valid JSON schema: {e.message}" + (f" (at /{at})" if at else ""),
                              where.split(".")[0]) from None
    return json.dumps(v)


def _one(key: str, v: Any, where: str) -> StructuredOutput:
    """vLLM's ``structured_outputs[key]`` (or the matching ``guided_*``) → a constraint."""
    param = where.split(".")[0]
    if key == "json":
        return StructuredOutput("json_schema", _schema(v, where))
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise ConstraintError(f"{where} must be a non-empty list of non-empty strings", param)
        return StructuredOutput("choice", choices=tuple(v))
    if not isinstance(v, str) or not v:
        raise ConstraintError(f"{where} must be a non-empty string", param)
    return StructuredOutput("regex" if key == "regex" else "grammar", v)


def _response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict):
        raise ConstraintError("response_format must be an object with a type", "response_format")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ConstraintError("response_format.json_schema must be an object with name and schema",
                                  "response_format")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise ConstraintError("response_format.json_schema.name must be a string", "response_format")
        if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
            raise ConstraintError("response_format.json_schema.strict must be true or false", "response_format")
        if "schema" not in js:
            raise ConstraintError("response_format.json_schema.schema is missing: give the JSON schema the output "
                                  "must follow", "response_format")
        return StructuredOutput("json_schema", _schema(js["schema"], "response_format.json_schema.schema"))
    raise ConstraintError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          "response_format")


def from_body(body: dict[str, Any]) -> common_pb2.StructuredOutput | None:
    """The body's constraint, checked (None: unconstrained). Raises ConstraintError naming the field and the
    problem: a malformed or invalid constraint, or more than one."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        so = _response_format(body["response_format"])
        if so is not None:
            found.append(("response_format", so))
    sos = body.get("structured_outputs")
    if sos is not None:
        if not isinstance(sos, dict):
            raise ConstraintError("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(k for k, v in sos.items() if k not in _SO_KEYS and v not in (None, False, ""))
        if unknown:
            raise ConstraintError(f"structured_outputs.{unknown[0]} is not supported by this server; it takes "
                                  f"{', '.join(_SO_KEYS)}", "structured_outputs")
        for key in _SO_KEYS:
            v = sos.get(key)
            if v is not None and v is not False:
                found.append((f"structured_outputs.{key}", _one(key, v, f"structured_outputs.{key}")))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _one(key, body[name], name)))
    if not found:
        return None
    if len(found) > 1:
        raise ConstraintError(f"a request takes one output constraint; this one has {len(found)}: "
                              f"{', '.join(n for n, _ in found)}", found[1][0].split(".")[0])
    name, so = found[0]
    try:
        check(so)
    except GrammarError as e:
        raise ConstraintError(f"{name}: {e}", name.split(".")[0]) from None
    return structured_to_proto(so)
