// tokenmill's API reference: fetches /openapi.json (with the key kept in sessionStorage, as
// the dashboard does) and lists every operation and the models of its bodies. No libraries.
"use strict";

const KEY_STORAGE = "tokenmill.apiKey";

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function refName(schema) {
  return schema && schema.$ref ? schema.$ref.split("/").pop() : null;
}

function typeOf(schema) {
  if (!schema) return "any";
  const name = refName(schema);
  if (name) return name;
  if (schema.anyOf) return schema.anyOf.map(typeOf).join(" | ");
  if (schema.enum) return schema.enum.map((v) => JSON.stringify(v)).join(" | ");
  if (schema.const !== undefined) return JSON.stringify(schema.const);
  if (schema.type === "array") return `${typeOf(schema.items)}[]`;
  if (schema.type === "object" && schema.additionalProperties) {
    return `{string: ${typeOf(schema.additionalProperties)}}`;
  }
  return schema.type || "any";
}

function modelLink(schema) {
  const name = refName(schema);
  if (!name) return el("code", {}, typeOf(schema));
  const link = el("a", { href: `#model-${name}` }, name);
  return link;
}

function renderOperations(doc) {
  const box = document.getElementById("operations");
  box.append(el("h2", {}, "Operations"));
  for (const [path, item] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(item)) {
      const div = el("div", { class: "op", id: `op-${method}-${path}` });
      const head = el("div");
      head.append(el("span", { class: `method ${method.toUpperCase()}` }, method.toUpperCase()),
                  el("span", { class: "path" }, path), el("span", { class: "dim" }, `  ${op.summary || ""}`));
      div.append(head);
      const body = op.requestBody && op.requestBody.content["application/json"];
      if (body) {
        const line = el("div", {}, "request body: ");
        line.append(modelLink(body.schema));
        div.append(line);
      }
      for (const p of op.parameters || []) {
        div.append(el("div", { class: "dim" }, `${p.in} ${p.name}: ${p.description || typeOf(p.schema)}`));
      }
      for (const [status, response] of Object.entries(op.responses || {})) {
        for (const [media, content] of Object.entries(response.content || {})) {
          const line = el("div", {}, `${status} ${media}: `);
          line.append(modelLink(content["x-item-schema"] || content.schema));
          if (content["x-item-schema"]) line.append(el("span", { class: "dim" }, " (each event)"));
          div.append(line);
        }
      }
      box.append(div);
    }
  }
}

function renderModels(doc) {
  const box = document.getElementById("models");
  box.append(el("h2", {}, "Models"));
  const schemas = (doc.components && doc.components.schemas) || {};
  for (const [name, schema] of Object.entries(schemas)) {
    box.append(el("h3", { id: `model-${name}` }, name));
    if (schema.description) box.append(el("div", { class: "dim" }, schema.description));
    const required = new Set(schema.required || []);
    const table = el("table");
    const header = el("tr");
    for (const h of ["field", "type", "required", "default"]) header.append(el("th", {}, h));
    table.append(header);
    for (const [field, prop] of Object.entries(schema.properties || {})) {
      const row = el("tr");
      const type = el("td");
      type.append(modelLink(prop));
      row.append(el("td", {}, field), type, el("td", {}, required.has(field) ? "yes" : ""),
                 el("td", {}, prop.default === undefined ? "" : JSON.stringify(prop.default)));
      table.append(row);
    }
    box.append(table);
  }
}

async function load() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  const response = await fetch("/openapi.json", { headers: key ? { Authorization: `Bearer ${key}` } : {} });
  if (response.status === 401) {
    sessionStorage.removeItem(KEY_STORAGE);
    document.getElementById("key-form").classList.add("shown");
    document.getElementById("key-error").textContent = key ? "That key was refused." : "";
    return;
  }
  const doc = await response.json();
  document.getElementById("version").textContent = doc.info.version;
  renderOperations(doc);
  renderModels(doc);
  window.tokenmillDocs = doc;
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = document.getElementById("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  document.getElementById("key-form").classList.remove("shown");
  load();
});

load();
