#!/usr/bin/env node
// openapi_check.mjs - the OpenAPI contract checks for psd.
//
//   node openapi_check.mjs spec SPEC
//       Validate SPEC against the OpenAPI schema (swagger-parser), resolve every
//       $ref, and compile every JSON schema in it with Ajv (strict, so a
//       misspelt keyword is an error). Exit 1 with the errors.
//
//   node openapi_check.mjs responses SPEC EXCHANGES.json [--coverage OUT.json]
//       EXCHANGES.json is a JSON list of recorded exchanges:
//         {method, path, query?, status, headers{lower-case}, content_type,
//          body (parsed JSON, or null for binary/empty), body_length?, body_error?}
//       Each must match a path template of SPEC, use a documented method and
//       status, carry a documented content type whose schema the body validates
//       against, and carry every required header (with a valid value). A path
//       no template matches must be answered as x-unrouted-responses["404"]; a
//       method a path does not list as x-unrouted-responses["405"], whose Allow
//       must list exactly the path's methods. One line per failure; exit 1 on any.
//       --coverage writes {"METHOD /template": [statuses seen]} to OUT.json.
import { readFileSync, writeFileSync } from "node:fs";
import SwaggerParser from "@apidevtools/swagger-parser";
import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";

const METHODS = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

function usage() {
  process.stderr.write(
    "usage: node openapi_check.mjs spec SPEC\n" +
      "       node openapi_check.mjs responses SPEC EXCHANGES.json [--coverage OUT.json]\n",
  );
  process.exit(2);
}

function newAjv() {
  // OpenAPI 3.1 schemas are JSON Schema 2020-12; OpenAPI's own keywords are
  // declared so strict mode accepts them and rejects anything else.
  const ajv = new Ajv2020({ strict: true, allErrors: true, strictTypes: false });
  addFormats(ajv);
  for (const k of ["discriminator", "xml", "externalDocs", "example"]) ajv.addKeyword(k);
  return ajv;
}

function errorsText(errors) {
  return errors.map((e) => `${e.instancePath || "/"} ${e.message}`).join("; ");
}

// Every schema object in an operation, response, header or parameter.
function* schemasOf(api) {
  for (const [name, s] of Object.entries(api.components?.schemas ?? {}))
    yield [`components/schemas/${name}`, s];
  for (const [p, item] of Object.entries(api.paths ?? {})) {
    for (const prm of item.parameters ?? []) yield [`${p} parameter ${prm.name}`, prm.schema];
    for (const m of METHODS) {
      const op = item[m];
      if (!op) continue;
      const where = `${m.toUpperCase()} ${p}`;
      for (const prm of op.parameters ?? []) yield [`${where} parameter ${prm.name}`, prm.schema];
      for (const [ct, media] of Object.entries(op.requestBody?.content ?? {}))
        yield [`${where} requestBody ${ct}`, media.schema];
      for (const [st, resp] of Object.entries(op.responses ?? {})) {
        for (const [h, hd] of Object.entries(resp.headers ?? {}))
          yield [`${where} ${st} header ${h}`, hd.schema];
        for (const [ct, media] of Object.entries(resp.content ?? {}))
          yield [`${where} ${st} ${ct}`, media.schema];
      }
    }
  }
}

async function loadSpec(path) {
  // validate() checks the document against the OpenAPI schema and returns it
  // with every $ref resolved.
  const api = await SwaggerParser.validate(path);
  const problems = [];
  const ajv = newAjv();
  const seen = new Set(); // a $ref'd schema is one object: report it once
  for (const [where, schema] of schemasOf(api)) {
    if (schema === undefined) {
      problems.push(`${where}: no schema`);
      continue;
    }
    if (seen.has(schema)) continue;
    seen.add(schema);
    try {
      ajv.compile(schema);
    } catch (e) {
      problems.push(`${where}: ${e.message}`);
    }
  }
  const ids = new Map();
  for (const [p, item] of Object.entries(api.paths ?? {}))
    for (const m of METHODS) {
      const op = item[m];
      if (!op) continue;
      if (!op.operationId) problems.push(`${m.toUpperCase()} ${p}: no operationId`);
      else if (ids.has(op.operationId))
        problems.push(`${m.toUpperCase()} ${p}: operationId ${op.operationId} also used by ${ids.get(op.operationId)}`);
      else ids.set(op.operationId, `${m.toUpperCase()} ${p}`);
      if (!op.security) problems.push(`${m.toUpperCase()} ${p}: no security requirement (use [] for an open route)`);
      for (const req of op.security ?? [])
        for (const name of Object.keys(req))
          if (!api.components?.securitySchemes?.[name])
            problems.push(`${m.toUpperCase()} ${p}: unknown security scheme ${name}`);
    }
  const unrouted = api["x-unrouted-responses"];
  if (!unrouted?.["404"] || !unrouted?.["405"]) problems.push("x-unrouted-responses needs 404 and 405");
  return { api, problems };
}

// Path templates, most specific (most literal characters) first. A parameter
// may be empty or hold '/': psd answers 400 for a bad variable name, so such a
// path still belongs to its template.
function compileTemplates(api) {
  const out = [];
  for (const tpl of Object.keys(api.paths)) {
    const names = [];
    const parts = tpl.split(/(\{[^}]+\})/);
    let re = "^";
    let literal = 0;
    for (const part of parts) {
      const m = /^\{([^}]+)\}$/.exec(part);
      if (m) {
        names.push(m[1]);
        re += "([^?#]*)";
      } else {
        re += part.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
        literal += part.length;
      }
    }
    out.push({ tpl, re: new RegExp(re + "$"), names, literal });
  }
  out.sort((a, b) => b.literal - a.literal || a.tpl.localeCompare(b.tpl));
  return out;
}

function matchPath(templates, path) {
  for (const t of templates) {
    const m = t.re.exec(path);
    if (m) return { tpl: t.tpl, params: Object.fromEntries(t.names.map((n, i) => [n, m[i + 1]])) };
  }
  return null;
}

function mediaTypeOf(ct) {
  return (ct ?? "").split(";")[0].trim().toLowerCase();
}

function findMedia(content, ct) {
  if (content[ct]) return content[ct];
  const [type] = ct.split("/");
  return content[`${type}/*`] ?? content["*/*"];
}

function checkResponse(ajv, resp, ex, fail) {
  // headers
  for (const [name, hd] of Object.entries(resp.headers ?? {})) {
    if (name.toLowerCase() === "content-type") continue; // OpenAPI: ignored
    const value = ex.headers?.[name.toLowerCase()];
    if (value === undefined) {
      if (hd.required) fail(`required header ${name} is missing`);
      continue;
    }
    if (hd.schema) {
      let v = value;
      const t = hd.schema.type;
      if ((t === "integer" || t === "number") && /^-?[0-9.eE+-]+$/.test(value)) v = Number(value);
      const validate = ajv.compile(hd.schema);
      if (!validate(v)) fail(`header ${name}: '${value}' ${errorsText(validate.errors)}`);
    }
  }
  // body
  const length = ex.body_length ?? (ex.body === null ? 0 : 1);
  if (ex.method.toUpperCase() === "HEAD") {
    if (length !== 0) fail(`HEAD response has a body of ${length} bytes`);
    return;
  }
  const content = resp.content ?? {};
  if (Object.keys(content).length === 0) {
    if (length !== 0) fail(`body of ${length} bytes where the spec documents none`);
    return;
  }
  const ct = mediaTypeOf(ex.content_type);
  if (!ct) {
    fail(`no Content-Type (documented: ${Object.keys(content).join(", ")})`);
    return;
  }
  const media = findMedia(content, ct);
  if (!media) {
    fail(`content type ${ct} is not documented (documented: ${Object.keys(content).join(", ")})`);
    return;
  }
  if (ct === "application/json" || ct.endsWith("+json")) {
    if (ex.body_error) {
      fail(`body is not JSON: ${ex.body_error}`);
      return;
    }
    if (!media.schema) return;
    const validate = ajv.compile(media.schema);
    if (!validate(ex.body)) fail(`body ${errorsText(validate.errors)}: ${JSON.stringify(ex.body).slice(0, 300)}`);
  } else if (ex.body !== null && ex.body !== undefined) {
    fail(`a ${ct} body was recorded as JSON`);
  }
}

function documentedQuery(item, op) {
  const names = new Set();
  for (const p of [...(item.parameters ?? []), ...(op.parameters ?? [])]) if (p.in === "query") names.add(p.name);
  return names;
}

async function checkResponses(specPath, exchangesPath, coveragePath) {
  const { api, problems } = await loadSpec(specPath);
  if (problems.length) {
    for (const p of problems) console.log(`spec: ${p}`);
    return 1;
  }
  const exchanges = JSON.parse(readFileSync(exchangesPath, "utf8"));
  if (!Array.isArray(exchanges)) {
    console.log(`${exchangesPath}: not a JSON list`);
    return 1;
  }
  const ajv = newAjv();
  const templates = compileTemplates(api);
  const unrouted = api["x-unrouted-responses"];
  const coverage = {};
  let failures = 0;
  exchanges.forEach((ex, i) => {
    const method = String(ex.method ?? "").toUpperCase();
    const label = `[${i}] ${method} ${ex.path}${ex.query && Object.keys(ex.query).length ? "?" + new URLSearchParams(ex.query) : ""} -> ${ex.status}`;
    const fail = (msg) => {
      failures++;
      console.log(`FAIL ${label}: ${msg}`);
    };
    if (typeof ex.path !== "string" || !ex.path.startsWith("/") || !Number.isInteger(ex.status)) {
      fail("malformed exchange (needs path and integer status)");
      return;
    }
    const match = matchPath(templates, ex.path);
    if (!match) {
      if (ex.status !== 404) fail(`path matches no template of the spec, so 404 was due`);
      else checkResponse(ajv, unrouted["404"], ex, fail);
      (coverage["* unrouted"] ??= new Set()).add(ex.status);
      return;
    }
    const item = api.paths[match.tpl];
    const op = item[method.toLowerCase()];
    if (!op) {
      const allowed = METHODS.filter((m) => item[m]).map((m) => m.toUpperCase());
      if (ex.status !== 405) {
        fail(`${method} is not documented for ${match.tpl} (documented: ${allowed.join(", ")}), so 405 was due`);
        return;
      }
      checkResponse(ajv, unrouted["405"], ex, fail);
      const allow = (ex.headers?.allow ?? "<none>").split(",").map((s) => s.trim()).filter(Boolean);
      const a = [...new Set(allow)].sort().join(", ");
      const b = [...allowed].sort().join(", ");
      if (ex.headers?.allow !== undefined && a !== b) fail(`Allow '${ex.headers?.allow}' is not the documented methods of ${match.tpl}: ${b}`);
      (coverage[`* ${match.tpl}`] ??= new Set()).add(ex.status);
      return;
    }
    (coverage[`${method} ${match.tpl}`] ??= new Set()).add(ex.status);
    const known = documentedQuery(item, op);
    for (const k of Object.keys(ex.query ?? {}))
      if (!known.has(k)) fail(`query parameter '${k}' is not documented`);
    const resp = op.responses[String(ex.status)] ?? op.responses[`${String(ex.status)[0]}XX`] ?? op.responses.default;
    if (!resp) {
      fail(`status ${ex.status} is not documented (documented: ${Object.keys(op.responses).join(", ")})`);
      return;
    }
    checkResponse(ajv, resp, ex, fail);
  });
  if (coveragePath)
    writeFileSync(
      coveragePath,
      JSON.stringify(Object.fromEntries(Object.entries(coverage).map(([k, v]) => [k, [...v].sort()])), null, 1),
    );
  process.stderr.write(`openapi_check: ${exchanges.length} exchanges, ${failures} failures\n`);
  return failures ? 1 : 0;
}

async function main(argv) {
  const [mode, spec, ...rest] = argv;
  if (!spec) usage();
  try {
    if (mode === "spec") {
      if (rest.length) usage();
      const { api, problems } = await loadSpec(spec);
      for (const p of problems) console.log(`spec: ${p}`);
      if (problems.length) return 1;
      const n = Object.values(api.paths).reduce((k, item) => k + METHODS.filter((m) => item[m]).length, 0);
      process.stderr.write(`openapi_check: ${spec} is valid OpenAPI ${api.openapi} (${Object.keys(api.paths).length} paths, ${n} operations)\n`);
      return 0;
    }
    if (mode === "responses") {
      const [exchanges, flag, out] = rest;
      if (!exchanges || (flag !== undefined && (flag !== "--coverage" || !out)) || rest.length > 3) usage();
      return await checkResponses(spec, exchanges, out);
    }
  } catch (e) {
    // swagger-parser throws one error that lists every schema violation
    console.log(`spec: ${e.message}`);
    return 1;
  }
  usage();
}

process.exitCode = await main(process.argv.slice(2));
