#!/usr/bin/env python3
"""openapi_check.py - the OpenAPI contract checks for psd.

Runs with the test suite's PyPI environment (build/venv/bin/python, made by
`make deps` from tests/support/requirements.txt).

  openapi_check.py spec SPEC
      Validate SPEC against the OpenAPI 3.1 schema (openapi-spec-validator),
      resolve every $ref, and check every JSON schema in it strictly: against
      the JSON Schema 2020-12 meta-schema (jsonschema), and with no keyword
      that neither JSON Schema nor OpenAPI defines (a misspelt keyword is an
      error, as in a strict validator). Exit 1 with the problems.

  openapi_check.py responses SPEC EXCHANGES.json [--coverage OUT.json]
      EXCHANGES.json is a JSON list of recorded exchanges:
        {method, path, query?, status, headers{lower-case}, content_type,
         body (parsed JSON, or null for binary/empty), body_length?, body_error?}
      Each must match a path template of SPEC, use a documented method and
      status, carry a documented content type whose schema the body validates
      against, and carry every required header (with a valid value). A path
      no template matches must be answered as x-unrouted-responses["404"]; a
      method a path does not list as x-unrouted-responses["405"], whose Allow
      must list exactly the path's methods. One line per failure; exit 1 on any.
      --coverage writes {"METHOD /template": [statuses seen]} to OUT.json.
"""
import json
import re
import sys
import urllib.parse

import jsonschema
import yaml
from openapi_spec_validator import OpenAPIV31SpecValidator

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

# Every keyword a schema may hold: JSON Schema 2020-12 (core, applicator,
# unevaluated, validation, meta-data, format, content vocabularies) and the
# OpenAPI 3.1 base vocabulary. Anything else is a mistake.
SCHEMA_KEYWORDS = {
    "$schema", "$id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary",
    "$comment", "$defs",
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas",
    "prefixItems", "items", "contains", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties",
    "required", "dependentRequired",
    "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
    "format", "contentEncoding", "contentMediaType", "contentSchema",
    "discriminator", "xml", "externalDocs", "example",
}
# Keywords whose value is a schema, a list of schemas, or a map of schemas.
SUB_SCHEMA = {"not", "if", "then", "else", "items", "contains", "additionalProperties",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema"}
SUB_SCHEMA_LIST = {"allOf", "anyOf", "oneOf", "prefixItems"}
SUB_SCHEMA_MAP = {"$defs", "properties", "patternProperties", "dependentSchemas"}


class SpecError(Exception):
    pass


def usage():
    sys.stderr.write("usage: openapi_check.py spec SPEC\n"
                     "       openapi_check.py responses SPEC EXCHANGES.json [--coverage OUT.json]\n")
    sys.exit(2)


def pointer_get(doc, ref):
    """The value at a local reference '#/a/b~1c', or SpecError."""
    if not ref.startswith("#/"):
        raise SpecError(f"$ref '{ref}' is not a local reference")
    node = doc
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SpecError(f"$ref '{ref}' points at nothing")
    return node


def dangling_refs(doc):
    """(where, ref) for every $ref of doc that points at nothing."""
    out = []

    def walk(node, at):
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{at}/{i}")
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                try:
                    pointer_get(doc, ref)
                except SpecError:
                    out.append((at or "/", ref))
            for k, v in node.items():
                walk(v, f"{at}/{k}")

    walk(doc, "")
    return out


def dereference(doc):
    """doc with every {"$ref": ...} replaced by what it points at. One target
    stays one object wherever it is used, under its own place too (so it is
    reported once); a description or summary beside the $ref overrides the
    target's (OpenAPI 3.1 Reference Object). A chain of references that
    comes back to itself is a SpecError."""
    done = {}  # local reference ('#/a/b') -> its resolved object

    def resolve(node, ptr, active):
        if ptr in done:
            return done[ptr]
        if isinstance(node, list):
            return [resolve(v, f"{ptr}/{i}", active) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in active:
                raise SpecError(f"$ref '{ref}' refers to itself")
            target = resolve(pointer_get(doc, ref), ref, active | {ref})
            extra = {k: v for k, v in node.items() if k != "$ref"}
            if not extra:
                return target
            if not isinstance(target, dict):
                raise SpecError(f"$ref '{ref}' with siblings points at a non-object")
            return {**target, **resolve(extra, ptr + "/", active)}
        out = done[ptr] = {}
        for k, v in node.items():
            out[k] = resolve(v, ptr + "/" + k.replace("~", "~0").replace("/", "~1"), active)
        return out

    return resolve(doc, "#", frozenset())


def schemas_of(api):
    """(where, schema) for every schema object of an operation, response,
    header, parameter or component."""
    for name, s in (api.get("components", {}).get("schemas") or {}).items():
        yield f"components/schemas/{name}", s
    for p, item in (api.get("paths") or {}).items():
        for prm in item.get("parameters") or []:
            yield f"{p} parameter {prm.get('name')}", prm.get("schema")
        for m in METHODS:
            op = item.get(m)
            if not op:
                continue
            where = f"{m.upper()} {p}"
            for prm in op.get("parameters") or []:
                yield f"{where} parameter {prm.get('name')}", prm.get("schema")
            for ct, media in ((op.get("requestBody") or {}).get("content") or {}).items():
                yield f"{where} requestBody {ct}", media.get("schema")
            for st, resp in (op.get("responses") or {}).items():
                for h, hd in (resp.get("headers") or {}).items():
                    yield f"{where} {st} header {h}", hd.get("schema")
                for ct, media in (resp.get("content") or {}).items():
                    yield f"{where} {st} {ct}", media.get("schema")


def strict_problems(schema, where):
    """Unknown keywords anywhere in a (dereferenced) schema."""
    out, seen = [], set()

    def walk(s, at):
        if isinstance(s, bool):
            return
        if not isinstance(s, dict):
            out.append(f"{where}: {at or '/'} is not a schema")
            return
        if id(s) in seen:
            return
        seen.add(id(s))
        for k, v in s.items():
            if k not in SCHEMA_KEYWORDS:
                out.append(f"{where}: unknown keyword '{k}' at {at or '/'}")
            elif k in SUB_SCHEMA:
                walk(v, f"{at}/{k}")
            elif k in SUB_SCHEMA_LIST and isinstance(v, list):
                for i, sub in enumerate(v):
                    walk(sub, f"{at}/{k}/{i}")
            elif k in SUB_SCHEMA_MAP and isinstance(v, dict):
                for name, sub in v.items():
                    walk(sub, f"{at}/{k}/{name}")

    walk(schema, "")
    return out


def validator_for(schema):
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def load_spec(path):
    """(the dereferenced spec, its problems as a list of lines)."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"cannot read '{path}': {e}")
    if not isinstance(raw, dict):
        raise SpecError(f"'{path}' is not an OpenAPI document")
    problems = [f"$ref '{ref}' at {at} points at nothing" for at, ref in dangling_refs(raw)]
    if problems:
        return None, problems
    try:
        for e in OpenAPIV31SpecValidator(raw).iter_errors():
            at = "/".join(str(p) for p in e.path)
            problems.append(f"{at or '/'}: {e.message.splitlines()[0]}")
    except Exception as e:  # the validator's own failure on a broken document
        problems.append(f"the OpenAPI validator failed: {type(e).__name__}: {str(e)[:300]}")
    if problems:
        return None, problems
    api = dereference(raw)
    seen = set()
    for where, schema in schemas_of(api):
        if schema is None:
            problems.append(f"{where}: no schema")
            continue
        if id(schema) in seen:
            continue
        seen.add(id(schema))
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            problems.append(f"{where}: {e.message}")
        problems += strict_problems(schema, where)
    ids = {}
    schemes = (api.get("components") or {}).get("securitySchemes") or {}
    for p, item in api["paths"].items():
        for m in METHODS:
            op = item.get(m)
            if not op:
                continue
            where = f"{m.upper()} {p}"
            op_id = op.get("operationId")
            if not op_id:
                problems.append(f"{where}: no operationId")
            elif op_id in ids:
                problems.append(f"{where}: operationId {op_id} also used by {ids[op_id]}")
            else:
                ids[op_id] = where
            if "security" not in op:
                problems.append(f"{where}: no security requirement (use [] for an open route)")
            for req in op.get("security") or []:
                for name in req:
                    if name not in schemes:
                        problems.append(f"{where}: unknown security scheme {name}")
    unrouted = api.get("x-unrouted-responses") or {}
    if "404" not in unrouted or "405" not in unrouted:
        problems.append("x-unrouted-responses needs 404 and 405")
    return api, problems


def compile_templates(api):
    """Path templates, most specific (most literal characters) first. A
    parameter may be empty or hold '/': psd answers 400 for a bad variable
    name, so such a path still belongs to its template."""
    out = []
    for tpl in api["paths"]:
        names, rx, literal = [], "^", 0
        for part in re.split(r"(\{[^}]+\})", tpl):
            m = re.fullmatch(r"\{([^}]+)\}", part)
            if m:
                names.append(m.group(1))
                rx += "([^?#]*)"
            else:
                rx += re.escape(part)
                literal += len(part)
        out.append((tpl, re.compile(rx + "$"), names, literal))
    out.sort(key=lambda t: (-t[3], t[0]))
    return out


def match_path(templates, path):
    for tpl, rx, _, _ in templates:
        if rx.match(path):
            return tpl
    return None


def media_type_of(ct):
    return (ct or "").split(";")[0].strip().lower()


def find_media(content, ct):
    if ct in content:
        return content[ct]
    return content.get(ct.split("/")[0] + "/*") or content.get("*/*")


def errors_text(validator, value):
    errs = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
    return "; ".join(f"/{'/'.join(str(p) for p in e.path)} {e.message}" for e in errs)


def header_value(schema, value):
    """A header's text as the type its schema says (an integer or number
    header is validated as a number when it reads as one)."""
    if schema.get("type") in ("integer", "number") and re.fullmatch(r"-?[0-9.eE+-]+", value):
        for conv in (int, float):
            try:
                return conv(value)
            except ValueError:
                pass
    return value


def check_response(resp, ex, fail):
    for name, hd in (resp.get("headers") or {}).items():
        if name.lower() == "content-type":
            continue  # OpenAPI: ignored
        value = (ex.get("headers") or {}).get(name.lower())
        if value is None:
            if hd.get("required"):
                fail(f"required header {name} is missing")
            continue
        schema = hd.get("schema")
        if schema is not None:
            v = header_value(schema, value)
            text = errors_text(validator_for(schema), v)
            if text:
                fail(f"header {name}: '{value}' {text}")
    body = ex.get("body")
    length = ex.get("body_length", 0 if body is None else 1)
    if str(ex.get("method", "")).upper() == "HEAD":
        if length != 0:
            fail(f"HEAD response has a body of {length} bytes")
        return
    content = resp.get("content") or {}
    if not content:
        if length != 0:
            fail(f"body of {length} bytes where the spec documents none")
        return
    ct = media_type_of(ex.get("content_type"))
    if not ct:
        fail(f"no Content-Type (documented: {', '.join(content)})")
        return
    media = find_media(content, ct)
    if media is None:
        fail(f"content type {ct} is not documented (documented: {', '.join(content)})")
        return
    if ct == "application/json" or ct.endswith("+json"):
        if ex.get("body_error"):
            fail(f"body is not JSON: {ex['body_error']}")
            return
        schema = media.get("schema")
        if schema is None:
            return
        text = errors_text(validator_for(schema), body)
        if text:
            fail(f"body {text}: {json.dumps(body)[:300]}")
    elif body is not None:
        fail(f"a {ct} body was recorded as JSON")


def documented_query(item, op):
    return {p["name"] for p in (item.get("parameters") or []) + (op.get("parameters") or [])
            if p.get("in") == "query"}


def check_exchange(api, templates, ex, fail, coverage):
    method = str(ex.get("method") or "").upper()
    path, status = ex.get("path"), ex.get("status")
    if not isinstance(path, str) or not path.startswith("/") or \
            not isinstance(status, int) or isinstance(status, bool):
        fail("malformed exchange (needs path and integer status)")
        return
    unrouted = api["x-unrouted-responses"]
    tpl = match_path(templates, path)
    if tpl is None:
        if status != 404:
            fail("path matches no template of the spec, so 404 was due")
        else:
            check_response(unrouted["404"], ex, fail)
        coverage.setdefault("* unrouted", set()).add(status)
        return
    item = api["paths"][tpl]
    op = item.get(method.lower())
    if not op:
        allowed = [m.upper() for m in METHODS if item.get(m)]
        if status != 405:
            fail(f"{method} is not documented for {tpl} (documented: {', '.join(allowed)}), "
                 "so 405 was due")
            return
        check_response(unrouted["405"], ex, fail)
        allow = (ex.get("headers") or {}).get("allow")
        if allow is not None:
            got = sorted({s.strip() for s in allow.split(",") if s.strip()})
            if got != sorted(allowed):
                fail(f"Allow '{allow}' is not the documented methods of {tpl}: "
                     f"{', '.join(sorted(allowed))}")
        coverage.setdefault(f"* {tpl}", set()).add(status)
        return
    coverage.setdefault(f"{method} {tpl}", set()).add(status)
    known = documented_query(item, op)
    for k in ex.get("query") or {}:
        if k not in known:
            fail(f"query parameter '{k}' is not documented")
    responses = op.get("responses") or {}
    resp = responses.get(str(status)) or responses.get(f"{str(status)[0]}XX") or \
        responses.get("default")
    if resp is None:
        fail(f"status {status} is not documented (documented: {', '.join(responses)})")
        return
    check_response(resp, ex, fail)


def check_responses(spec_path, exchanges_path, coverage_path):
    api, problems = load_spec(spec_path)
    if problems:
        for p in problems:
            print(f"spec: {p}")
        return 1
    try:
        with open(exchanges_path) as f:
            exchanges = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{exchanges_path}: {e}")
        return 1
    if not isinstance(exchanges, list):
        print(f"{exchanges_path}: not a JSON list")
        return 1
    templates = compile_templates(api)
    coverage, failures = {}, 0
    for i, ex in enumerate(exchanges):
        if not isinstance(ex, dict):
            ex = {}
        query = ex.get("query") or {}
        label = f"[{i}] {str(ex.get('method') or '').upper()} {ex.get('path')}" + \
            (f"?{urllib.parse.urlencode(query)}" if isinstance(query, dict) and query else "") + \
            f" -> {ex.get('status')}"

        def fail(msg, label=label):
            nonlocal failures
            failures += 1
            print(f"FAIL {label}: {msg}")

        check_exchange(api, templates, ex, fail, coverage)
    if coverage_path:
        with open(coverage_path, "w") as f:
            json.dump({k: sorted(v) for k, v in coverage.items()}, f, indent=1)
    sys.stderr.write(f"openapi_check: {len(exchanges)} exchanges, {failures} failures\n")
    return 1 if failures else 0


def main(argv):
    if len(argv) < 2:
        usage()
    mode, spec, rest = argv[0], argv[1], argv[2:]
    try:
        if mode == "spec":
            if rest:
                usage()
            api, problems = load_spec(spec)
            for p in problems:
                print(f"spec: {p}")
            if problems:
                return 1
            n = sum(1 for item in api["paths"].values() for m in METHODS if item.get(m))
            sys.stderr.write(f"openapi_check: {spec} is valid OpenAPI {api['openapi']} "
                             f"({len(api['paths'])} paths, {n} operations)\n")
            return 0
        if mode == "responses":
            if not rest or len(rest) not in (1, 3) or (len(rest) == 3 and rest[1] != "--coverage"):
                usage()
            return check_responses(spec, rest[0], rest[2] if len(rest) == 3 else None)
    except SpecError as e:
        print(f"spec: {e}")
        return 1
    usage()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
