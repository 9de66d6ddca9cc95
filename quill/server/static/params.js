// Settings form values -> chat-completion request fields (blank fields use the server's defaults),
// and what stops them from being sent, shown next to the form.

const NUMBER_FIELDS = {
  temperature: { integer: false },
  top_p: { integer: false },
  top_k: { integer: true },
  max_tokens: { integer: true },
  seed: { integer: true },
};

export const TOOL_CHOICES = ["auto", "required", "none"];

/** A setting that cannot be sent; the message names the field and the value, `field` the input's name. */
export class SettingsError extends Error {
  constructor(message, field = null) {
    super(message);
    this.field = field;
  }
}

function parseNumber(name, raw, integer) {
  const value = Number(raw);
  if (!Number.isFinite(value)) throw new SettingsError(`${name}: ${JSON.stringify(raw)} is not a number`, name);
  if (integer && !Number.isInteger(value)) throw new SettingsError(`${name}: ${raw} is not a whole number`, name);
  return value;
}

function parseStops(raw) {
  return raw
    .split("\n")
    .filter((line) => line.length > 0)
    .map((line) => line.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
}

function responseFormat(raw) {
  let schema;
  try {
    schema = JSON.parse(raw);
  } catch (err) {
    throw new SettingsError(`JSON schema: not valid JSON (${err.message})`, "json_schema");
  }
  if (schema === null || typeof schema !== "object" || Array.isArray(schema)) {
    throw new SettingsError("JSON schema: must be a JSON object", "json_schema");
  }
  // Accept either a bare schema or OpenAI's {name, schema, strict} wrapper.
  const wrapped = typeof schema.name === "string" && typeof schema.schema === "object";
  return { type: "json_schema", json_schema: wrapped ? schema : { name: "playground", schema, strict: true } };
}

function kindOf(value) {
  return value === null ? "null" : Array.isArray(value) ? "an array" : typeof value === "object" ? "an object" : `a ${typeof value}`;
}

// OpenAI's tools list: [{"type": "function", "function": {"name", "description", "parameters"}}].
// Only the shape that names a function is checked here; the server checks the rest.
function parseTools(raw) {
  let tools;
  try {
    tools = JSON.parse(raw);
  } catch (err) {
    throw new SettingsError(`Tools (JSON): not valid JSON (${err.message})`, "tools");
  }
  if (!Array.isArray(tools)) throw new SettingsError(`Tools (JSON): must be a JSON array of tools, got ${kindOf(tools)}`, "tools");
  tools.forEach((tool, i) => {
    const name = tool && typeof tool === "object" && tool.type === "function" && tool.function && tool.function.name;
    if (typeof name !== "string" || name === "") {
      throw new SettingsError(`Tools (JSON): item ${i} must be {"type": "function", "function": {"name": "...", "parameters": {...}}}`, "tools");
    }
  });
  return tools;
}

/** Request fields from the settings (strings as typed); throws SettingsError. */
export function requestFields(settings) {
  const fields = {};
  for (const [name, { integer }] of Object.entries(NUMBER_FIELDS)) {
    const raw = String(settings[name] ?? "").trim();
    if (raw !== "") fields[name] = parseNumber(name, raw, integer);
  }
  const stops = parseStops(String(settings.stop ?? ""));
  if (stops.length) fields.stop = stops;
  const schema = String(settings.json_schema ?? "").trim();
  if (schema !== "") fields.response_format = responseFormat(schema);
  const tools = String(settings.tools ?? "").trim();
  if (tools !== "") {
    const list = parseTools(tools);
    if (list.length) {
      fields.tools = list;
      fields.tool_choice = TOOL_CHOICES.includes(settings.tool_choice) ? settings.tool_choice : "auto";
    }
  }
  return fields;
}

/** Put saved settings into the form's inputs (by name). */
export function fillSettingsForm(form, settings) {
  for (const input of form.elements) {
    if (!input.name) continue;
    if (input.type === "checkbox") input.checked = Boolean(settings[input.name]);
    else input.value = settings[input.name] ?? "";
  }
}

/** Show what stops `settings` from being sent under the form (and mark its input); returns the SettingsError or null. */
export function showSettingsProblem(form, errorNode, settings) {
  let problem = null;
  try {
    requestFields(settings);
  } catch (err) {
    if (!(err instanceof SettingsError)) throw err;
    problem = err;
  }
  errorNode.textContent = problem ? problem.message : "";
  errorNode.hidden = !problem;
  for (const input of form.elements) {
    if (problem && input.name && input.name === problem.field) {
      input.setAttribute("aria-invalid", "true");
      input.setAttribute("aria-describedby", errorNode.id);
    } else {
      input.removeAttribute("aria-invalid");
      input.removeAttribute("aria-describedby");
    }
  }
  return problem;
}
